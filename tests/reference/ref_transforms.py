"""Image transforms as torchvision.transforms.v2.functional computes them on uint8 tensors
(resize with each interpolation, with and without antialiasing, upscaling, max_size; center crops
with odd anchors and padding; RandomCrop's corners from a seeded generator; the flip; ToTensor +
Normalize), and PIL's resize of the same pictures (diffusers' scripts resize PIL images), for the
C++ transforms to match to the bit and to measure against PIL."""
import json
import pathlib

import numpy as np
import torch


def generate(out: pathlib.Path):
    from PIL import Image
    from safetensors.torch import save_file
    from torchvision.transforms import InterpolationMode as IM
    from torchvision.transforms import v2
    from torchvision.transforms.v2 import functional as F
    root = out / "images" / "good"
    pics = {
        "large": torch.from_numpy(np.asarray(Image.open(root / "large_odd.jpg").convert("RGB")).copy()),
        "small": torch.from_numpy(np.asarray(Image.open(root / "baseline_420.jpg").convert("RGB")).copy()),
        "noise": torch.from_numpy(np.random.default_rng(3).integers(0, 256, (50, 80, 3), dtype=np.uint8)),
    }
    modes = {"nearest": IM.NEAREST, "bilinear": IM.BILINEAR, "bicubic": IM.BICUBIC}
    cases = [  # name, picture, size, mode, antialias, max_size
        ("short17_bilinear", "large", [17], "bilinear", True, None),
        ("short64_bilinear_up", "small", [64], "bilinear", True, None),
        ("hw_bilinear_noaa", "noise", [20, 33], "bilinear", False, None),
        ("short40_bicubic", "large", [40], "bicubic", True, None),
        ("hw_bicubic_noaa", "noise", [31, 19], "bicubic", False, None),
        ("short24_nearest", "noise", [24], "nearest", False, None),
        ("short40_max60", "large", [40], "bilinear", True, 60),
        ("short90_bicubic_up", "small", [90], "bicubic", True, None),
    ]
    tensors, meta = {}, {"resize": [], "center_crop": [], "random_crop": [],
                         "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    for name, pic in pics.items():
        tensors[f"pic.{name}"] = pics[name].permute(2, 0, 1).contiguous()
    for name, pic, size, mode, aa, max_size in cases:
        img = tensors[f"pic.{pic}"]
        tensors[f"resize.{name}"] = F.resize(img, size, interpolation=modes[mode], antialias=aa,
                                             max_size=max_size).contiguous()
        meta["resize"].append({"name": name, "pic": pic, "size": size, "mode": mode,
                               "antialias": aa, "max_size": max_size})
    for name, pic, h, w in [("c16", "small", 16, 16), ("c_odd", "noise", 17, 30),
                            ("c_pad", "small", 40, 41), ("c_half", "noise", 49, 79)]:
        tensors[f"center.{name}"] = F.center_crop(tensors[f"pic.{pic}"], [h, w]).contiguous()
        meta["center_crop"].append({"name": name, "pic": pic, "h": h, "w": w})
    for seed in range(6):
        torch.manual_seed(seed)
        h, w = 11 + seed, 20 + 3 * seed
        i, j, _, _ = v2.RandomCrop.get_params(tensors["pic.noise"], (h, w)) if hasattr(
            v2.RandomCrop, "get_params") else (None, None, None, None)
        if i is None:
            from torchvision.transforms import RandomCrop
            i, j, _, _ = RandomCrop.get_params(tensors["pic.noise"], (h, w))
        meta["random_crop"].append({"seed": seed, "h": h, "w": w, "top": int(i), "left": int(j)})
    tensors["flip.small"] = F.horizontal_flip(tensors["pic.small"]).contiguous()
    from torchvision import transforms as T
    pil_small = Image.fromarray(pics["small"].numpy())
    tensors["unit.small"] = T.Normalize([0.5], [0.5])(T.ToTensor()(pil_small)).contiguous()
    # PIL's resize, as diffusers' scripts call it (transforms.Resize on a PIL image).
    large = Image.open(root / "large_odd.jpg").convert("RGB")
    for mode, pil_mode in (("bilinear", Image.BILINEAR), ("bicubic", Image.BICUBIC)):
        for short in (64, 128):
            w, h = large.size
            nw, nh = (short, int(short * h / w)) if w <= h else (int(short * w / h), short)
            tensors[f"pil.{mode}.{short}"] = torch.from_numpy(
                np.asarray(large.resize((nw, nh), pil_mode)).copy()).permute(2, 0, 1).contiguous()
    save_file(tensors, out / "images" / "transforms.safetensors")
    (out / "transforms.json").write_text(json.dumps(meta))
