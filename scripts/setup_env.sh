#!/usr/bin/env bash
# Create (or reuse) the virtual environment .venv and install fastverify into it, editable, with its compiled
# extension: C++ CPU kernels always, CUDA kernels too when nvcc is found (no GPU needed to build them). A later run
# reuses the extension while its sources and build settings are unchanged ($VENV/.fastverify-build, below).
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
# `pip install -e .` compiles the extension from scratch every time (minutes on a small CPU). Skip it when this
# environment's last install built the same sources (setup.py, pyproject.toml, csrc/; the same top-level packages)
# with the same Python, torch and build settings, its fastverify is this checkout's, and the extension it left is
# still the one in place. A build with the CUDA kernels also serves FASTVERIFY_NO_CUDA=1 (they add to the CPU
# kernels); one without them is rebuilt when they are wanted (nvcc and a CUDA torch present, FASTVERIFY_NO_CUDA
# unset).
stamp="$VENV/.fastverify-build"
key=$( {
  env | grep -E '^(FASTVERIFY_(NO_EXT|DEBUG)|TORCH_CUDA_ARCH_LIST|CUDA_HOME|CUDA_PATH)=' | LC_ALL=C sort || true
  "$PY" -c "import sys, torch; print(sys.version, torch.__version__, torch.version.cuda)"
  find setup.py pyproject.toml csrc -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum
  ls -d ./*/__init__.py  # the top-level packages the editable install maps
} | sha256sum | cut -d' ' -f1)
want_cuda=0  # what setup.py decides: FASTVERIFY_NO_CUDA unset (or 0 / false / no / off), nvcc, a CUDA torch
case "$(echo "${FASTVERIFY_NO_CUDA:-0}" | tr '[:upper:]' '[:lower:]')" in
  1|true|yes|on) ;;
  *) if { command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; } \
        && "$PY" -c "import sys, torch; sys.exit(torch.version.cuda is None)"; then
       want_cuda=1
     fi ;;
esac
so_state() { stat -c '%s %Y' fastverify/_C*.so 2>/dev/null | head -1; }
up_to_date() {
  [ -f "$stamp" ] || return 1
  local s_key s_cuda s_so
  { read -r s_key; read -r s_cuda; read -r s_so; } <"$stamp"
  [ "$s_key" = "$key" ] && [ "$s_so" = "$(so_state)" ] && [ "$s_cuda" -ge "$want_cuda" ] || return 1
  "$PY" -c "import os, sys, fastverify._ext as e
sys.exit(0 if e.HAS_CPP and os.path.samefile(os.path.dirname(e.__file__), 'fastverify') else 1)" 2>/dev/null
}
if up_to_date; then
  echo "setup_env.sh: fastverify._C is up to date with its sources (remove $stamp to rebuild)"
else
  rm -f "$stamp"
  rc=0
  "$PY" -m pip install -q --no-build-isolation -e . 2>&1 | { grep -v '^WARNING: Location' || true; } || rc=$?
  # the stamp only after a build that succeeded (a failed one can leave the previous extension in place)
  if [ "$rc" -ne 0 ]; then
    echo "setup_env.sh: pip install -e . failed (exit $rc)" >&2
  elif "$PY" -c "import sys, fastverify._ext as e; sys.exit(0 if e.HAS_CPP else 1)" 2>/dev/null; then
    printf '%s\n%s\n%s\n' "$key" "$want_cuda" "$(so_state)" >"$stamp"
  fi  # else: the check below names why fastverify._C did not load
fi
"$PY" -c "import fastverify; print('fastverify backends on cpu:', fastverify.backends('cpu'))"
"$PY" -c "import fastverify._ext as e; assert e.HAS_CPP, 'fastverify._C was not built: ' + str(e._EXT_ERROR)"
