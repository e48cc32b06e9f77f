"""Runs every reference script in this folder; each writes golden JSON into the given folder.

The scripts use the real Python libraries (torch, diffusers, timm, ...) at the versions pinned in
scripts/requirements-reference.txt, so the C++ tests compare against the behaviour users know.
"""
import importlib.util
import pathlib
import sys


def main() -> int:
    out = pathlib.Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    here = pathlib.Path(__file__).parent
    scripts = sorted(p for p in here.glob("ref_*.py"))
    for script in scripts:
        spec = importlib.util.spec_from_file_location(script.stem, script)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.generate(out)
        print(f"{script.name}: ok")
    print(f"{len(scripts)} reference scripts wrote golden values to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
