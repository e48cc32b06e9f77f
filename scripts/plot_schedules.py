"""Draws the CSV of examples/schedules/schedule_curves as a grid of small plots (PNG, Pillow only).

    python scripts/plot_schedules.py curves.csv docs/images/schedules.png
"""
import csv
import math
import sys

from PIL import Image, ImageDraw


def main(src, dst):
    with open(src) as f:
        rows = list(csv.reader(f))
    names, data = rows[0][1:], [[float(v) for v in r[1:]] for r in rows[1:]]
    cols = 4
    cell_w, cell_h, pad = 300, 170, 26
    grid_rows = math.ceil(len(names) / cols)
    img = Image.new("RGB", (cols * cell_w, grid_rows * cell_h), "white")
    draw = ImageDraw.Draw(img)
    for k, name in enumerate(names):
        x0, y0 = (k % cols) * cell_w, (k // cols) * cell_h
        ys = [row[k] for row in data]
        top = max(max(ys), 1e-12)
        left, right, upper, lower = x0 + 10, x0 + cell_w - 10, y0 + pad, y0 + cell_h - 12
        draw.rectangle([left, upper, right, lower], outline=(200, 200, 200))
        draw.text((left, y0 + 6), f"{name}  (max {top:.3g})", fill=(0, 0, 0))
        pts = [(left + (right - left) * i / max(1, len(ys) - 1), lower - (lower - upper) * y / top)
               for i, y in enumerate(ys)]
        draw.line(pts, fill=(31, 119, 180), width=2)
    img.save(dst)
    print(f"wrote {dst}: {len(names)} schedules")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
