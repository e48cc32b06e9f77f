#!/usr/bin/env bash
# Sets up, builds (release) and runs the main job: the Fashion-MNIST example with its defaults —
# a class-conditional diffusion model trained on the CPU (about two minutes on two cores), its
# samples, loss curve and scores written to build/demo/fashion_mnist/.
#   extra arguments go to the program, e.g. `bash scripts/demo.sh --device cuda --steps 20000`
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
cmake --preset release >/dev/null
cmake --build --preset release --target fashion_mnist
mkdir -p build/demo
./build/release/examples/fashion_mnist --out build/demo/fashion_mnist --overwrite "$@"
