#!/usr/bin/env bash
# The sha256 of what fastverify._C is built from (setup.py and the C++ / CUDA files under csrc/, as they are in the
# working tree): the stamp that ties a prebuilt extension (scripts/gpu_prebuild.sh) to the sources it was built from.
set -euo pipefail
cd "$(dirname "$0")/.."
{ echo setup.py; find csrc -type f \( -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' \); } | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -d' ' -f1
