#!/usr/bin/env bash
# On a machine with an NVIDIA GPU (run so far on an H100 SXM 80GB): build fastverify._C with its CUDA kernels
# in place, run every CUDA and Triton test on the GPU, and time the GPU backends (benchmarks/bench_gpu.py).
#
#   bash scripts/gpu_check.sh [build] [test] [bench] [quick]    (default: build test bench)
#
# Logs go to $OUT (default gpu_out/, ignored by git); bench.md there is a ready RESULTS.md section: copy it into
# benchmarks/RESULTS.md before the machine goes away (gpu_out/ lives on that machine only).
# The build (16 jobs) took 46-80 s on the H100 machine.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONUNBUFFERED=1 FASTVERIFY_SLOW_TESTS=1
STEPS=${*:-build test bench}
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
