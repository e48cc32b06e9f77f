#!/usr/bin/env bash
# Sets up, builds (release) and runs the main demo. Extra arguments go to the demo program.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
cmake --preset release >/dev/null
cmake --build --preset release --target hello
./build/release/examples/hello "$@"
