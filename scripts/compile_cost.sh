#!/usr/bin/env bash
# What it costs to compile against difftrain: builds benchmarks/compile_cost one compiler run at a
# time (no compiler cache) and prints, for each translation unit, its wall time and the
# compiler's peak memory, as the Markdown table in docs/using.md. Usage:
#   bash scripts/compile_cost.sh [BUILD_TYPE]      (default Release; the folder is a scratch one)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build_type=${1:-Release}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
log="$work/times.txt"

# The launcher times one compiler run and notes its output file, wall seconds and peak RSS (KiB).
cat >"$work/timed.sh" <<LAUNCHER
#!/usr/bin/env bash
out=""; prev=""
for a in "\$@"; do [[ "\$prev" == "-o" ]] && out="\$a"; prev="\$a"; done
/usr/bin/time -f "%e %M" -o "$work/one.txt" "\$@"
echo "\$out \$(cat "$work/one.txt")" >>"$log"
LAUNCHER
chmod +x "$work/timed.sh"

cmake -S "$root/benchmarks/compile_cost" -B "$work/build" -G Ninja \
  -DDIFFTRAIN_SOURCE_DIR="$root" -DCMAKE_BUILD_TYPE="$build_type" \
  -DCMAKE_CXX_COMPILER_LAUNCHER="$work/timed.sh" >/dev/null
cmake --build "$work/build" -j1 --target torch_only umbrella trainer >/dev/null
cmake --build "$work/build" -j1 --target trainer_pch trainer_pch_reused >/dev/null

row() {  # label, pattern of the object's path
  local line
  line=$(grep -E "$2" "$log" | tail -1) || { echo "| $1 | (not built) | |"; return; }
  read -r _ secs kib <<<"$line"
  printf '| %s | %.1f | %.0f |\n' "$1" "$secs" "$((kib / 1024))"
}
echo "| translation unit ($build_type, $(${CXX:-c++} --version | head -1)) | wall s | peak MiB |"
echo "| --- | ---: | ---: |"
row '`#include <torch/torch.h>` alone' 'torch_only\.dir/torch_only\.cpp\.o '
row '`#include <difftrain/difftrain.hpp>` (everything)' 'umbrella\.dir/umbrella\.cpp\.o '
row 'a trainer program (`train/trainer.hpp`, one Trainer)' 'trainer\.dir/trainer\.cpp\.o '
row 'its precompiled header, built once (`difftrain_precompile_headers`)' 'trainer_pch\.dir/cmake_pch\.hxx\.gch '
row 'the trainer program with the precompiled header' 'trainer_pch\.dir/trainer\.cpp\.o '
row 'another target reusing it (`REUSE_FROM`)' 'trainer_pch_reused\.dir/trainer\.cpp\.o '
