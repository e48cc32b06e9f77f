"""Compiles one tests/compile_fail/ source with the exact command CMake generated for it (read from
compile_commands.json; parse only, nothing written) and passes when the compiler refuses it with
output matching the file's `// expect: <regex>` line. Reading the command instead of running
`cmake --build` lets these checks run side by side: two builds in one build tree at once would
share ninja's log. A check starts from the precompiled header tests/headers/headers.py chose for the
source (CTest's headers.precompile fixture builds it): it holds only headers the source includes
itself, so what is refused is refused the same.   check.py BUILD_DIR SOURCE"""
import json
import pathlib
import re
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "headers"))
import headers  # noqa: E402

build, source = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]).resolve()
first = source.read_text().splitlines()[0]
if not first.startswith("// expect: "):
    sys.exit(f"{source}: the first line must be `// expect: <regex>`")
expect = first[len("// expect: "):]
entries = json.loads((build / "compile_commands.json").read_text())
entry = next((e for e in entries if pathlib.Path(e["directory"], e["file"]).resolve() == source),
             None)
if entry is None:
    sys.exit(f"{source} is not in {build}/compile_commands.json (re-run CMake)")
# Parse only: the object file and the dependency file dropped, every flag that decides meaning kept.
kept = headers.compile_args(entry)
include_dir = pathlib.Path(__file__).resolve().parents[2] / "include"
level = headers.level_of_source(source, headers.search_path(entry, include_dir), {})
if level and not pathlib.Path(str(headers.pch_header(build, level)) + ".gch").is_file():
    level = None  # not precompiled (run outside CTest): parsed from scratch, as correct
run = subprocess.run(headers.with_pch(kept, build, level) + ["-fsyntax-only"],
                     cwd=entry["directory"], capture_output=True, text=True)
output = run.stdout + run.stderr
print(output[-20000:])
if run.returncode == 0:
    sys.exit(f"FAIL: {source.name} compiled; it must be refused")
if not re.search(expect, output, re.DOTALL):
    sys.exit(f"FAIL: {source.name} was refused, but no message matches: {expect}")
print(f"refused as expected: {expect} (starting from {level or 'no precompiled header'})")
