#!/usr/bin/env bash
# Create (or reuse) the virtual environment .venv and install fastverify into it, editable, with its compiled
# extension: C++ CPU kernels always, CUDA kernels too when nvcc is found (no GPU needed to build them).
#
#   TORCH_SPEC      the torch to install (default torch==2.14.1: a CUDA 13.0 build, which also runs on CPU and
#                   brings triton; use torch==2.13.0 for the CPU-only build)
#   FASTVERIFY_NO_CUDA=1   skip compiling the CUDA kernels (much faster build on a small CPU)
#   VENV            where the environment lives (default .venv)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
TORCH_SPEC=${TORCH_SPEC:-torch==2.14.1}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip setuptools wheel 2>&1 | grep -v '^WARNING: Location' || true
"$PY" -m pip install -q "$TORCH_SPEC" 2>&1 | grep -v '^WARNING: Location' || true
"$PY" -m pip install -q -r requirements.txt 2>&1 | grep -v '^WARNING: Location' || true
"$PY" -c "import torch, transformers, gguf, accelerate, pytest, pytest_benchmark, ninja" \
  || { echo "setup_env.sh: dependency installation failed" >&2; exit 1; }
"$PY" -m pip install -q --no-build-isolation -e . 2>&1 | grep -v '^WARNING: Location' || true
"$PY" -c "import fastverify; print('fastverify backends on cpu:', fastverify.backends('cpu'))"
"$PY" -c "import fastverify._ext as e; assert e.HAS_CPP, 'fastverify._C was not built: ' + str(e._EXT_ERROR)"
