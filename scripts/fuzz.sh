#!/usr/bin/env bash
# Builds the libFuzzer targets (clang, ASan + UBSan) and runs each for a bounded time, starting from
# the kept corpus in tests/fuzz/corpus/. New inputs go to build/fuzz/found/, never into the source
# tree; a crash writes its input to build/fuzz/crashes/ and fails the run. Each target gets a
# dictionary (tests/fuzz/dicts/) of pickle opcodes, zip signatures, JSON and PNG tokens, so nesting
# depth and memo sharing are explored, not only byte flips.
#   scripts/fuzz.sh [SECONDS_PER_TARGET]      (default 30)
#   scripts/fuzz.sh --merge                   fold build/fuzz/found/ into the kept corpus (minimised)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
cd "$root"
seconds=30
merge=0
case "${1:-}" in
  --merge) merge=1 ;;
  "") ;;
  *) seconds=$1 ;;
esac
venv=${DIFFTRAIN_VENV:-$HOME/.cache/difftrain/venv}
export Torch_DIR=${Torch_DIR:-$("$venv/bin/python" -c 'import torch;print(torch.utils.cmake_prefix_path)')/Torch}
cmake --preset fuzz >/dev/null
cmake --build --preset fuzz
export ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
mkdir -p build/fuzz/crashes build/fuzz/logs
# The targets run side by side, as many at a time as there are cores (each is one process); each
# one's last lines are printed when it ends, and any crash fails the run.
jobs=$(nproc)
pids=() names=()
finish() {  # waits for the oldest running target, prints its summary, remembers a failure
  local pid=${pids[0]} name=${names[0]}
  pids=("${pids[@]:1}") names=("${names[@]:1}")
  local lines=12
  if ! wait "$pid"; then failed+=("$name") lines=200; fi
  echo "fuzz: $name"
  tail -n "$lines" "build/fuzz/logs/$name.log"
}
failed=()
for target in safetensors torch_file embedded_png image video; do
  # image, video: built where the data layer's decoders (and FFmpeg) are installed
  [ -x "build/fuzz/tests/fuzz/fuzz_$target" ] || continue
  found=build/fuzz/found/$target
  mkdir -p "$found"
  if ((merge)); then
    build/fuzz/tests/fuzz/fuzz_$target -merge=1 "tests/fuzz/corpus/$target" "$found"
    continue
  fi
  ((${#pids[@]} < jobs)) || finish
  echo "fuzz: $target for ${seconds}s"
  build/fuzz/tests/fuzz/fuzz_$target "$found" "tests/fuzz/corpus/$target" \
    -dict="tests/fuzz/dicts/$target.dict" \
    -max_total_time="$seconds" -timeout=10 -rss_limit_mb=4096 -max_len=262144 \
    -artifact_prefix=build/fuzz/crashes/$target- -print_final_stats=1 \
    > "build/fuzz/logs/$target.log" 2>&1 &
  pids+=($!) names+=("$target")
done
while ((${#pids[@]})); do finish; done
if ((${#failed[@]})); then
  echo "fuzz: ${failed[*]} failed; inputs in build/fuzz/crashes/" >&2
  exit 1
fi
