#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: builds against the torch that `python3` (or DIFFTRAIN_PYTHON)
# holds, runs every test (the CUDA ones run there instead of skipping) and the benchmarks, and
# writes the logs and JSON results into the folder given as the first argument.
#
#   scripts/gpu-check.sh RESULTS_DIR [benchmark filter regex]
#   XTENSOR_PREFIX   an install prefix of xtensor + xtl + xsimd headers, where none is installed
#   GTEST_PREFIX / BENCHMARK_PREFIX   likewise, where their CMake packages are elsewhere
#   GLOO_PREFIX   an install prefix of Gloo's headers (include/gloo), where none is installed
#   ICU_PREFIX   an install prefix of ICU (include/unicode, lib/libicuuc.so), where none is installed
#   (prefixes must lie outside the source tree: CMake refuses exported include paths inside it)
#   DIFFTRAIN_GOLDEN_DIR   golden values made elsewhere (tests/reference/generate_all.py); without
#   it they are generated here, which needs the reference packages (diffusers, ...) in python3
#   DIFFTRAIN_PREBUILT_DIR   a build tree made on another machine against the same torch wheel
#   (version and CUDA build): nothing is built here, the binaries find python3's torch libraries
#   through LD_LIBRARY_PATH (their RUNPATH names the building machine's), and
#   DIFFTRAIN_EXTRA_LIBS adds a folder of the other shared libraries they need (ICU, libpng, ...)
set -uo pipefail
out=${1:?usage: scripts/gpu-check.sh RESULTS_DIR [benchmark filter]}
filter=${2:-.}
mkdir -p "$out"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python=${DIFFTRAIN_PYTHON:-python3}
build=${BUILD_DIR:-build/gpu}
prefixes="${XTENSOR_PREFIX:-};${GTEST_PREFIX:-};${BENCHMARK_PREFIX:-};${CLI11_PREFIX:-};${GLOO_PREFIX:-};${ICU_PREFIX:-}"

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  "$python" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))'
} | tee "$out/device.txt"

if [ -n "${DIFFTRAIN_PREBUILT_DIR:-}" ]; then
  build=$DIFFTRAIN_PREBUILT_DIR
  torch_lib=$("$python" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')
  export LD_LIBRARY_PATH="$torch_lib${DIFFTRAIN_EXTRA_LIBS:+:$DIFFTRAIN_EXTRA_LIBS}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export DIFFTRAIN_BENCH_DIR=$PWD/benchmarks DIFFTRAIN_PYTHON="$python"
  echo "prebuilt binaries from $build" | tee -a "$out/device.txt"
else
  start=$(date +%s)
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDIFFTRAIN_PYTHON="$python" \
    -DCMAKE_PREFIX_PATH="$prefixes" -DDIFFTRAIN_WERROR=ON 2>&1 | tee "$out/configure.log" | tail -3
  cmake --build "$build" 2>&1 | tee "$out/build.log" | tail -3
  echo "cold build: $(( $(date +%s) - start )) s on $(nproc) cores" | tee -a "$out/device.txt"
fi

if [ -z "${DIFFTRAIN_GOLDEN_DIR:-}" ]; then
  "$python" tests/reference/generate_all.py "$build/tests/golden" >"$out/golden.log" 2>&1 ||
    echo "golden values could not be generated (see golden.log): tests that compare fail"
fi
"$build/tests/difftrain_tests" --gtest_output="json:$out/tests.json" 2>&1 | tee "$out/tests.log" | tail -15
"$build/benchmarks/difftrain_bench" --benchmark_filter="$filter" \
  --benchmark_out="$out/bench.json" --benchmark_out_format=json 2>&1 | tee "$out/bench.log" | tail -40
# Data-parallel: 2 ranks under torchrun beside Python's DDP (Gloo; torchrun from the same torch).
"$python" benchmarks/distributed.py "$build/benchmarks/difftrain_bench_distributed" 2>&1 |
  tee "$out/bench_distributed.log" | tail -9

# Data-parallel and sharded training on CUDA tensors: 2 ranks on GPU 0 (Gloo), each rank's CUDA
# generator through a resume.
"$python" tests/distributed/run_checks.py "$build/tests/difftrain_dist_worker" cuda 2>&1 |
  tee "$out/distributed_cuda.log" | tail -3

# The main job on the GPU: a longer Fashion-MNIST run (needs the IDX files; CLI11's headers via
# CLI11_PREFIX in CMAKE_PREFIX_PATH where no package is installed).
data=${FASHION_MNIST_DIR:-/usr/share/datasets/fashion-mnist}
if [ -x "$build/examples/fashion_mnist" ] && [ -d "$data" ]; then
  "$build/examples/fashion_mnist" --device cuda --data-dir "$data" --out "$out/fashion_mnist" \
    --overwrite --steps 20000 --batch-size 256 --channels 32 --attention-14 --warmup 500 \
    --ema-decay 0.999 --lr 1e-3 --samples-per-class 100 --checkpoint-every 2000 \
    2>&1 | tee "$out/fashion_mnist.log" | tail -20
fi

# The adapters example end to end; with CUDA present its script also runs the whole example with
# --device cuda.
if [ -x "$build/examples/fashion_mnist_adapters" ] && [ -d "$data" ]; then
  bash tests/e2e/fashion_mnist_adapters.sh "$build/examples/fashion_mnist_adapters" "$python" \
    tests/reference/check_cpp_adapters.py "$out/adapters_e2e" "$data" 2>&1 |
    tee "$out/adapters_e2e.log" | tail -5
fi
