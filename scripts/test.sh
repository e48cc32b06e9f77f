#!/usr/bin/env bash
# Sets up (scripts/setup.sh), builds with warnings as errors, and runs every test with CTest.
#   PRESET   the CMake preset (default: ci; `asan` runs the tests under sanitizers)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
preset=${PRESET:-ci}
start=$(date +%s)
cmake --preset "$preset"
cmake --build --preset "$preset"
echo "build: $(( $(date +%s) - start )) s"
ctest --preset "$preset"
