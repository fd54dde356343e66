#!/usr/bin/env bash
# Build fastverify._C WITH the CUDA kernels into a scratch directory (no GPU needed) and check that the ops with a
# kernel in csrc/cuda have it registered with the dispatcher (tests/test_cuda_build.py then also checks that
# tree_attention and the CPU-only ops have none). Leaves the in-place (CPU) build alone.
#
# Usage: .ci/cuda_build_check.sh [scratch-dir]     (default: a fresh mktemp dir, removed at exit)
# Environment: TORCH_CUDA_ARCH_LIST (default 9.0), MAX_JOBS (default 2), CUDA_HOME (default: the directory of the
# real nvcc binary's parent, resolving wrapper scripts such as /usr/local/bin/nvcc -> /usr/local/cuda-X.Y), PYTHON.
# If a GPU is present, the GPU tests of tests/test_cuda_build.py (CUDA kernels vs the torch reference) run too.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python}"
if [[ -z "${1:-}" ]]; then
  SCRATCH="$(mktemp -d /tmp/fastverify-cuda-check.XXXXXX)"
  trap 'rm -rf "$SCRATCH"' EXIT
else
  SCRATCH="$1"
  mkdir -p "$SCRATCH"
fi

if [[ -z "${CUDA_HOME:-}" ]]; then
  # torch infers CUDA_HOME from `which nvcc`; a wrapper script in /usr/local/bin then yields /usr/local, whose lib
  # dir has no libcudart. Prefer the toolkit the wrapper execs, or /usr/local/cuda.
  if [[ -x /usr/local/cuda/bin/nvcc ]]; then
    export CUDA_HOME=/usr/local/cuda
  elif command -v nvcc >/dev/null; then
    export CUDA_HOME="$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")"
  fi
fi
echo "cuda_build_check: CUDA_HOME=${CUDA_HOME:-unset}, scratch=$SCRATCH"

cd "$ROOT"
env FASTVERIFY_FORCE_CUDA=1 TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" MAX_JOBS="${MAX_JOBS:-2}" \
  "$PYTHON" setup.py build_ext --build-temp "$SCRATCH/build" --build-lib "$SCRATCH/lib" 2>&1 | tail -20
SO="$(ls "$SCRATCH"/lib/fastverify/_C*.so | head -1)"
echo "cuda_build_check: built $SO"

# Load the scratch library alone (not the in-place fastverify._C: its schemas would be registered twice).
"$PYTHON" - "$SO" <<'PY'
import sys
import torch

torch.ops.load_library(sys.argv[1])
ops = ["verify", "uniform", "cdf_sample", "cdf_invert", "aux_bits", "tree_mask_bool", "tree_mask_additive",
       "tree_mask_packed", "tree_positions", "compact_cache"]
assert torch.ops.fastverify.has_cuda(), "the extension reports has_cuda() == False"
missing = [op for op in ops if not torch._C._dispatch_has_kernel_for_dispatch_key(f"fastverify::{op}", "CUDA")]
no_cpu = [op for op in ops if not torch._C._dispatch_has_kernel_for_dispatch_key(f"fastverify::{op}", "CPU")]
print("cuda_build_check: CUDA kernels registered for", len(ops) - len(missing), "of", len(ops), "ops")
if no_cpu:
    print("cuda_build_check: note: no CPU kernel (yet) for", no_cpu)
if missing:
    sys.exit(f"cuda_build_check: no CUDA kernel for {missing}")
PY

FASTVERIFY_DISABLE_EXT=1 FASTVERIFY_CUDA_SO="$SO" "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_cuda_build.py
