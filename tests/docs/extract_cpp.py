"""Writes the ```cpp blocks of a Markdown page, in order, into one C++ file (each preceded by a
#line directive naming the page, so a compile error points at the page's line)."""
import pathlib
import sys

page, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
lines = page.read_text().splitlines()
code, inside = [], False
for n, line in enumerate(lines, 1):
    if not inside and line.strip() == "```cpp":
        inside = True
        code.append(f'#line {n + 1} "{page.name}"')
    elif inside and line.strip() == "```":
        inside = False
    elif inside:
        code.append(line)
if inside or len(code) == 0:
    sys.exit(f"{page}: no complete ```cpp block")
text = "\n".join(code) + "\n"
if not out.exists() or out.read_text() != text:
    out.write_text(text)
