"""Aspect-ratio buckets as kohya's sd-scripts compute them (library/train_util.py:
make_bucket_resolutions and BucketManager.select_bucket, transcribed here since sd-scripts is not a
package): the bucket tables of SD 1.x, SD 2.x and SDXL settings and the bucket, resized size and
aspect error of a sweep of image sizes (portrait, landscape, square, tiny, huge, exact bucket
sizes), with and without --bucket_no_upscale."""
import json
import math
import pathlib
import random

import numpy as np


def make_bucket_resolutions(max_reso, min_size=256, max_size=1024, divisible=64):
    max_width, max_height = max_reso
    max_area = max_width * max_height
    resos = set()
    width = int(math.sqrt(max_area) // divisible) * divisible
    resos.add((width, width))
    width = min_size
    while width <= max_size:
        height = min(max_size, int((max_area // width) // divisible) * divisible)
        if height >= min_size:
            resos.add((width, height))
            resos.add((height, width))
        width += divisible
    return sorted(resos)


def select_bucket(cfg, resos, image_width, image_height):
    steps = cfg["steps"]

    def round_to_steps(x):
        x = int(x + 0.5)
        return x - x % steps

    aspect_ratio = image_width / image_height
    if not cfg["no_upscale"]:
        reso = (image_width, image_height)
        if reso not in set(resos):
            ratios = np.array([w / h for w, h in resos])
            reso = resos[np.abs(ratios - aspect_ratio).argmin()]
        ar_reso = reso[0] / reso[1]
        scale = reso[1] / image_height if aspect_ratio > ar_reso else reso[0] / image_width
        resized = (int(image_width * scale + 0.5), int(image_height * scale + 0.5))
    else:
        max_area = cfg["max_width"] * cfg["max_height"]
        if image_width * image_height > max_area:
            rw = math.sqrt(max_area * aspect_ratio)
            rh = max_area / rw
            bw = round_to_steps(rw)
            bh_in_w = round_to_steps(bw / aspect_ratio)
            ar_w = bw / bh_in_w
            bh = round_to_steps(rh)
            bw_in_h = round_to_steps(bh * aspect_ratio)
            ar_h = bw_in_h / bh
            if abs(ar_w - aspect_ratio) < abs(ar_h - aspect_ratio):
                resized = (bw, int(bw / aspect_ratio + 0.5))
            else:
                resized = (int(bh * aspect_ratio + 0.5), bh)
        else:
            resized = (image_width, image_height)
        reso = (resized[0] - resized[0] % steps, resized[1] - resized[1] % steps)
    return reso, resized, reso[0] / reso[1] - aspect_ratio


def generate(out: pathlib.Path):
    configs = [
        dict(name="sd15", max_width=512, max_height=512, min_size=256, max_size=1024, steps=64, no_upscale=False),
        dict(name="sd2", max_width=768, max_height=768, min_size=320, max_size=1536, steps=64, no_upscale=False),
        dict(name="sdxl", max_width=1024, max_height=1024, min_size=512, max_size=2048, steps=64, no_upscale=False),
        dict(name="wide_steps32", max_width=640, max_height=384, min_size=256, max_size=1024, steps=32, no_upscale=False),
        dict(name="sd15_no_upscale", max_width=512, max_height=512, min_size=256, max_size=1024, steps=64, no_upscale=True),
        dict(name="sdxl_no_upscale", max_width=1024, max_height=1024, min_size=512, max_size=2048, steps=64, no_upscale=True),
    ]
    rng = random.Random(5)
    sizes = [(512, 512), (512, 768), (768, 512), (1920, 1080), (1080, 1920), (300, 2000), (2000, 300),
             (64, 64), (100, 80), (4000, 3000), (3000, 4000), (1024, 1024), (640, 384), (384, 640)]
    sizes += [(rng.randint(200, 5000), rng.randint(200, 5000)) for _ in range(400)]
    result = {"sizes": sizes, "configs": []}
    for cfg in configs:
        resos = make_bucket_resolutions((cfg["max_width"], cfg["max_height"]), cfg["min_size"],
                                        cfg["max_size"], cfg["steps"])
        sizes_here = sizes + [list(r) for r in resos[:10]]
        choices = [select_bucket(cfg, resos, w, h) for w, h in sizes_here]
        result["configs"].append({**cfg, "table": [] if cfg["no_upscale"] else resos,
                                  "sizes": sizes_here, "choices": choices})
    (out / "buckets.json").write_text(json.dumps(result))
