#!/usr/bin/env bash
# Formatting (clang-format) over every C++ file, the include arrows between layers
# (scripts/check_layers.py), and clang-tidy over every public header through
# the self-contained-header translation units of a configured build (default build/dev).
#   --format-only   skip clang-tidy (fast; CTest runs this as lint.format)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mapfile -t files < <(git ls-files '*.hpp' '*.cpp' '*.h' '*.cc')
clang-format --dry-run --Werror "${files[@]}"
echo "clang-format: ${#files[@]} files clean"
python3 scripts/check_layers.py
[ "${1:-}" = "--format-only" ] && exit 0

build=${BUILD_DIR:-build/dev}
[ -f "$build/compile_commands.json" ] || cmake --preset dev >/dev/null
mapfile -t units < <(find "$build/tests/self_contained" -name '*.cpp' | sort)
printf '%s\n' "${units[@]}" | xargs -P "$(nproc)" -n 1 clang-tidy -p "$build" --quiet
echo "clang-tidy: ${#units[@]} headers clean"
