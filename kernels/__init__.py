"""Triton kernels of fastverify (installed as fastverify.kernels). Imported lazily: triton is optional."""
