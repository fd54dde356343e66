#!/usr/bin/env bash
# Set up .venv (scripts/setup_env.sh) and run the whole test suite on the CPU: the torch reference, the C++
# kernels, the Triton kernels under TRITON_INTERPRET=1, the CUDA build check, tiny Hugging Face models of several
# architectures and the real SmolLM2-135M model. Tests that need a GPU are skipped here, with the reason.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export TRITON_INTERPRET=1
exec .venv/bin/python -m pytest -q -rs "$@"
