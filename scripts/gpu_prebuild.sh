#!/usr/bin/env bash
# Build fastverify._C with its CUDA kernels here, against the torch of the device machine, and pack it for a device
# call, so that `scripts/gpu_check.sh` loads it there instead of spending ~75 s of device time compiling:
#
#   gpu_carry/so/_C.abi3.so.gz   the extension, debug sections stripped (~2.4 MiB gzipped; 45 MiB as built)
#   gpu_carry/so/STAMP           the sources it was built from (scripts/gpu_source_stamp.sh) and the torch version
#
# Carry gpu_carry/so with the first call (beside p0: ~62 MiB with the working tree, under the 64 MiB a call takes).
# On the device, gpu_check.sh's build step uses it when the stamp matches the checkout's sources and the device's
# torch, and it loads with its CUDA kernels; otherwise it builds there as before.
#
# Needs nvcc (this machine's CUDA 13.0 toolkit), the package index (torch's wheel, ~530 MB, kept in
# $HOME/.cache/fastverify/torch-<version>) and ~8 min of both cores. Environment: TORCH_VERSION (default 2.11.0, the
# device's: /work/.library/device/KINDS.md), PY (default .venv/bin/python, a Python with setuptools and ninja),
# CARRY (default gpu_carry), MAX_JOBS (default 2).
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION=${TORCH_VERSION:-2.11.0}
PY=${PY:-.venv/bin/python}
case $PY in */*) PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY") ;; esac  # the build runs in another folder
CARRY=${CARRY:-gpu_carry}
site="$HOME/.cache/fastverify/torch-$TORCH_VERSION"

if [ ! -f "$site/torch/version.py" ]; then
  wheels=$(mktemp -d)
  $PY -m pip download -q --no-deps -d "$wheels" "torch==$TORCH_VERSION"
  $PY -m pip install -q --no-deps --target "$site" "$wheels"/torch-*.whl
  rm -rf "$wheels"
fi
got=$(PYTHONPATH="$site" $PY -c "import torch; print(torch.__version__)")
echo "torch for the build: $got ($site)"

# the checkout's tracked sources, built out of tree (this checkout's own build stays as it is)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
git ls-files -z | xargs -0 tar -cf - | tar -xf - -C "$work"
start=$(date +%s)
(cd "$work" && PYTHONPATH="$site" FASTVERIFY_FORCE_CUDA=1 MAX_JOBS=${MAX_JOBS:-2} $PY setup.py -q build_ext --inplace \
  >build.log 2>&1) || { tail -30 "$work/build.log"; exit 1; }
echo "built in $(( $(date +%s) - start )) s"

mkdir -p "$CARRY/so"
cp "$work/fastverify/_C.abi3.so" "$CARRY/so/_C.abi3.so"
strip --strip-debug "$CARRY/so/_C.abi3.so"
gzip -f "$CARRY/so/_C.abi3.so"
{ echo "SOURCES=$(bash scripts/gpu_source_stamp.sh)"; echo "TORCH=$got"; } >"$CARRY/so/STAMP"
ls -l "$CARRY/so"
cat "$CARRY/so/STAMP"
