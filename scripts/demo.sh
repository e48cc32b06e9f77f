#!/usr/bin/env bash
# Sets up, builds (release) and runs the demo: difftrain on the best device, then every LR
# schedule's curve written to build/demo/schedule_curves.csv (and drawn to a PNG next to it).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
venv=${DIFFTRAIN_VENV:-$HOME/.cache/difftrain/venv}
cmake --preset release >/dev/null
cmake --build --preset release --target hello schedule_curves
mkdir -p build/demo
./build/release/examples/hello
./build/release/examples/schedule_curves --steps 1000 --out build/demo/schedule_curves.csv
"$venv/bin/python" scripts/plot_schedules.py build/demo/schedule_curves.csv build/demo/schedule_curves.png
