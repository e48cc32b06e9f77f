"""Checks that every header includes only its own layer and the layers below it, as the table in
docs/architecture.md lists them. Prints each arrow that points elsewhere and exits 1 if any does."""
import pathlib
import re
import sys

ALLOWED = {
    "core": {"core"},
    "nn": {"core", "nn"},
    "schedule": {"core", "schedule"},
    "ema": {"core", "io", "ema"},
    "diffusion": {"core", "diffusion"},
    "io": {"core", "io"},
    "log": {"core", "io", "log"},
    "train": {"core", "nn", "schedule", "ema", "diffusion", "io", "log", "train"},
    "eval": {"core", "eval"},
    "distributed": {"core", "io", "log", "nn", "schedule", "ema", "diffusion", "train",
                    "distributed"},
    "models": {"core", "io", "nn", "models"},
    "text": {"core", "io", "nn", "models", "text"},
    "data": {"core", "io", "data"},
    "adapters": {"core", "io", "log", "nn", "schedule", "ema", "diffusion", "train", "models",
                 "text", "adapters"},
}

root = pathlib.Path(__file__).resolve().parent.parent / "include" / "difftrain"
include = re.compile(r'#include\s+[<"]difftrain/([a-z_]+)/')
bad = []
for header in sorted(root.glob("*/**/*.hpp")):
    layer = header.relative_to(root).parts[0]
    for n, line in enumerate(header.read_text().splitlines(), 1):
        m = include.match(line.strip())
        if m and m.group(1) not in ALLOWED[layer]:
            bad.append(f"{header.relative_to(root.parent.parent)}:{n}: {layer}/ includes {m.group(1)}/")
print("\n".join(bad) if bad else f"layers: every include points down ({len(ALLOWED)} layers)")
sys.exit(1 if bad else 0)
