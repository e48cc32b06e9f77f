"""Checks that every public header compiles alone, and precompiles the headers that make the
check and the compile-fail checks quick without making them weaker.

    headers.py precompile BUILD_DIR INCLUDE_DIR [LAUNCHER...]
    headers.py self-contained BUILD_DIR INCLUDE_DIR [LAUNCHER...]

Both read the commands CMake generated for tests/self_contained/*.cpp (compile_commands.json; each
unit includes one header twice: alone, and again through its include guard). LAUNCHER is the
compiler launcher (the compiler cache with its settings), if any.

Parsing LibTorch's headers is most of each unit's time (6 s for <ATen/ATen.h>, 10 s for
<torch/nn/module.h> on one core), so a unit starts from a precompiled header that holds only headers
the checked source includes itself, unconditionally, directly or through other headers (difftrain's
and LibTorch's, read here): every name the precompiled header makes visible is visible to the source
without it, so a missing include is found exactly as before. The levels below are tried from the
largest; a source that includes none of them is parsed from scratch. `precompile` builds them once
(a CTest fixture); `self-contained` and tests/compile_fail/check.py use them.

An umbrella header (nothing but includes of other difftrain headers) that `difftrain/difftrain.hpp`
includes is not compiled on its own: each header it includes is checked alone, and
`difftrain/difftrain.hpp` checks that they compile together."""
import concurrent.futures
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys
import time

# Largest first: a header gets the first level whose headers it all includes.
LEVELS = {
    "torch_modules": ["torch/nn/module.h", "torch/nn/modules/linear.h", "torch/nn/modules/conv.h",
                      "torch/nn/modules/normalization.h"],
    "torch_module_json": ["torch/nn/module.h", "torch/optim/optimizer.h", "nlohmann/json.hpp"],
    "torch_module": ["torch/nn/module.h"],
    "aten_json": ["ATen/ATen.h", "nlohmann/json.hpp"],
    "aten": ["ATen/ATen.h"],
    "tensor": ["ATen/core/Tensor.h"],
}
INCLUDE = re.compile(r'\s*#\s*include\s*[<"]([^>"]+)[>"]')


# LibTorch 2.11 wraps each header in this condition, true unless a build asks for the stable ABI
# only (main() makes sure this one does not).
TORCH_WRAPPER = re.compile(r"#\s*if\s+!defined\(TORCH_STABLE_ONLY\)\s*&&\s*"
                           r"!defined\(TORCH_TARGET_VERSION\)")


def direct_includes(path):
    """The includes outside any #if block (an include guard and LibTorch's wrapper aside): only
    those are certain to be there."""
    found, depth, directives = [], 0, 0
    guard, base = None, 0
    for line in path.read_text(errors="replace").splitlines():
        stripped = line.strip()
        if not stripped.startswith("#"):
            continue
        directives += 1
        if directives == 1 and TORCH_WRAPPER.match(stripped):
            depth = base = -1  # its block is the file; its #else holds only an #error
            continue
        if directives == 1 and (m := re.match(r"#\s*ifndef\s+(\w+)", stripped)):
            guard = m.group(1)
            continue
        if directives == 2 and guard and re.match(rf"#\s*define\s+{guard}\b", stripped):
            continue  # the include guard's block holds the whole file
        if directives == 2 and guard:
            depth += 1  # the #ifndef was a condition, not a guard
        if re.match(r"#\s*if", stripped):
            depth += 1
        elif re.match(r"#\s*endif", stripped):
            depth -= 1
        elif re.match(r"#\s*(else|elif)", stripped) and depth == base == -1:
            break  # the wrapper's #else: nothing after it is compiled here
        elif depth == base and (match := INCLUDE.match(line)):
            found.append(match.group(1))
    return found


def closure(header, search, memo):
    """Every header `header` includes unconditionally, followed through every header found in the
    search path (difftrain's and LibTorch's); the others (the standard library's) are named only."""
    if header in memo:
        return memo[header]
    memo[header] = set()  # a cycle ends here
    result = set()
    path = next((d / header for d in search if (d / header).is_file()), None)
    if path is not None:
        for name in direct_includes(path):
            result.add(name)
            result |= closure(name, search, memo)
    memo[header] = result
    return result


def is_umbrella(header, include_dir):
    text = (include_dir / header).read_text()
    code = [l.strip() for l in text.splitlines()
            if l.strip() and not l.strip().startswith(("//", "#pragma once", "#include", "#if",
                                                        "#endif"))]
    return not code and all((include_dir / n).is_file()
                            for n in INCLUDE.findall(text) if n.startswith("difftrain/"))


def compile_args(entry):
    """The unit's command without its output, dependency file and parse-only switch."""
    args = entry["arguments"] if "arguments" in entry else shlex.split(entry["command"])
    kept, skip = [], 0
    for a in args:
        if skip:
            skip -= 1
        elif a in ("-o", "-MF", "-MT", "-MQ"):
            skip = 1
        elif a not in ("-MD", "-MMD", "-c", "-fsyntax-only"):
            kept.append(a)
    return kept


def run(command, cwd):
    started = time.monotonic()
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    return done.returncode, done.stdout + done.stderr, time.monotonic() - started


def units_of(build):
    """header -> its self-contained unit's compile_commands.json entry."""
    entries = json.loads((build / "compile_commands.json").read_text())
    units = {}
    for e in entries:
        source = pathlib.Path(e["directory"], e["file"])
        if source.parent.name == "self_contained" and source.parent.parent.name == "tests":
            units[INCLUDE.match(source.read_text()).group(1)] = e
    if not units:
        sys.exit(f"no tests/self_contained units in {build}/compile_commands.json (re-run CMake)")
    return units


def search_path(entry, include_dir):
    args = compile_args(entry)
    stable_only = [a for a in args if a.startswith(("-DTORCH_STABLE_ONLY", "-DTORCH_TARGET_VERSION"))]
    if stable_only:
        sys.exit(f"{stable_only}: LibTorch's stable-ABI mode hides the headers this check reads")
    search = [include_dir] + [pathlib.Path(entry["directory"], args[i + 1])
                              for i, a in enumerate(args[:-1]) if a in ("-I", "-isystem")]
    return search + [pathlib.Path(entry["directory"], a[2:]) for a in args
                     if a.startswith("-I") and len(a) > 2]


def level_for(included):
    return next((name for name, heads in LEVELS.items() if all(x in included for x in heads)),
                None)


def level_of_source(source, search, memo):
    """The level a source file (not itself in the search path) may start from."""
    included = set()
    for name in direct_includes(source):
        included |= {name} | closure(name, search, memo)
    return level_for(included)


def pch_header(build, level):
    return build / "tests" / "self_contained_pch" / f"{level}.hpp"


def with_pch(args, build, level):
    """args (a parse-only command) starting from `level`'s precompiled header. -Winvalid-pch (an
    error under -Werror): a precompiled header that was not used would make a check correct but slow
    without saying so. -O0 -g0 as the precompiled header was built."""
    if level is None:
        return args + ["-O0", "-g0"]
    i = next(i for i, a in enumerate(args) if a.endswith(".cpp"))
    return (args[:i] + ["-O0", "-g0", "-include", str(pch_header(build, level)), "-Winvalid-pch"]
            + args[i:])


def precompile(build, include_dir, launcher):
    units = units_of(build)
    entry = next(iter(units.values()))
    base = compile_args(entry)
    source_index = next(i for i, a in enumerate(base) if a.endswith(".cpp"))

    def build_pch(level):
        header = pch_header(build, level)
        header.parent.mkdir(parents=True, exist_ok=True)
        text = "".join(f"#include <{h}>\n" for h in LEVELS[level])
        if not header.is_file() or header.read_text() != text:
            header.write_text(text)
        return run(launcher + base[:source_index] + ["-x", "c++-header", str(header), "-o",
                                                     str(header) + ".gch"]
                   + base[source_index + 1:], entry["directory"])

    failed = 0
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        for level, (rc, out, seconds) in zip(LEVELS, pool.map(build_pch, LEVELS)):
            print(f"precompiled {level} ({', '.join(LEVELS[level])}): {seconds:.1f} s", flush=True)
            if rc != 0:
                failed += 1
                print(f"==== precompiling {level} failed ====\n{out[-20000:]}")
    if failed:
        sys.exit(f"{failed} precompiled headers failed to build")


def self_contained(build, include_dir, launcher):
    units = units_of(build)
    search = search_path(next(iter(units.values())), include_dir)
    memo = {}
    covered = closure("difftrain/difftrain.hpp", search, memo) \
        if "difftrain/difftrain.hpp" in units else set()
    skipped = sorted(h for h in units if h in covered and is_umbrella(h, include_dir))
    checked = sorted(h for h in units if h not in skipped)
    level_of = {h: level_for(closure(h, search, memo)) for h in checked}
    missing = sorted({str(pch_header(build, l)) + ".gch" for l in level_of.values()
                      if l and not pathlib.Path(str(pch_header(build, l)) + ".gch").is_file()})
    if missing:
        sys.exit(f"missing precompiled headers {missing}: run `headers.py precompile` first "
                 "(CTest's headers.precompile)")

    def check(header):
        entry = units[header]
        return run(launcher + with_pch(compile_args(entry), build, level_of[header])
                   + ["-fsyntax-only"], entry["directory"])

    started = time.monotonic()
    failures = []
    workers = max(1, min(len(checked), os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        for header, (rc, out, seconds) in zip(checked, pool.map(check, checked)):
            print(f"{'ok  ' if rc == 0 else 'FAIL'} {header} [{level_of[header] or 'no pch'}] "
                  f"{seconds:.1f} s", flush=True)
            if rc != 0:
                failures.append((header, out))
    for h in skipped:
        print(f"umbrella {h}: its headers are checked alone and together in difftrain/difftrain.hpp")
    print(f"{len(checked)} headers compiled alone in {time.monotonic() - started:.0f} s "
          f"({workers} at a time); {len(skipped)} umbrella headers covered")
    for what, out in failures:
        print(f"\n==== {what} does not compile alone ====\n{out[-20000:]}")
    if failures:
        sys.exit(f"{len(failures)} of {len(checked)} headers are not self-contained")


if __name__ == "__main__":
    if len(sys.argv) < 4 or sys.argv[1] not in ("precompile", "self-contained"):
        sys.exit(__doc__)
    command = precompile if sys.argv[1] == "precompile" else self_contained
    command(pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3]), sys.argv[4:])
