#!/usr/bin/env bash
# Set up .venv (scripts/setup_env.sh) and run the whole test suite on the CPU: the torch reference, the C++
# kernels, the Triton kernels under TRITON_INTERPRET=1, the CUDA build check, tiny Hugging Face models of several
# architectures and the real SmolLM2-135M model. Tests that need a GPU are skipped here, with the reason.
# Then the microbenchmarks, each case once and untimed (so that they keep running); the C++ kernels' portable
# scalar paths (FASTVERIFY_NO_SIMD=1), which AVX2 machines otherwise never take, and skinny_linear's and
# masked_attention's AVX2 paths (FASTVERIFY_NO_AVX512=1), which AVX-512 machines otherwise never take; and the
# Hugging Face tests on the oldest transformers the integration supports
# (fastverify.hf.patch.SUPPORTED_TRANSFORMERS), installed beside .venv's own (.venv/transformers-MIN, on PYTHONPATH).
# Arguments go to the first pytest run only.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export TRITON_INTERPRET=1
.venv/bin/python -m pytest -q -rs "$@"
if [ "$#" -eq 0 ]; then
  echo "--- the microbenchmarks (benchmarks/bench_*.py), each case run once, untimed (--benchmark-disable)"
  .venv/bin/python -m pytest -q -rs benchmarks/ --benchmark-disable
  echo "--- C++ kernels, scalar paths (FASTVERIFY_NO_SIMD=1)"
  FASTVERIFY_NO_SIMD=1 .venv/bin/python -m pytest -q -rs tests/test_simd.py tests/test_linear.py
  echo "--- skinny_linear, AVX2 path on an AVX-512 CPU (FASTVERIFY_NO_AVX512=1)"
  FASTVERIFY_NO_AVX512=1 .venv/bin/python -m pytest -q -rs tests/test_simd.py tests/test_linear.py \
    tests/test_masked_attention.py
  FASTVERIFY_NO_SIMD=1 .venv/bin/python -m pytest -q -rs -k cpp tests/test_verify.py tests/test_sampling.py \
    tests/test_tree_attention.py tests/test_masks.py tests/test_masked_attention.py
  oldest=$(.venv/bin/python -c "from fastverify.hf.patch import SUPPORTED_TRANSFORMERS as s; print(s[0])")
  echo "--- the Hugging Face tests on transformers $oldest.*, the oldest supported"
  site=.venv/transformers-$oldest
  if [ ! -f "$site/.complete" ]; then
    rm -rf "$site"
    .venv/bin/python -m pip install -q --target "$site" "transformers==$oldest.*"
    touch "$site/.complete"
  fi
  PYTHONPATH="$site" .venv/bin/python -m pytest -q -rs tests/test_hf_*.py tests/test_real_model.py
fi
