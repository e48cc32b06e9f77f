"""Files in the layouts the web UI and diffusers write with torch.save (seeds 000 and 001): a
textual-inversion embedding, a hypernetwork with integer keys and OrderedDict state dicts, a
diffusers concept file, every tensor dtype, plus the same embedding hidden in PNGs both ways the web
UI does it. The C++ tests read them and compare with the summary written here."""
import collections
import json

import torch
from PIL import Image

import webui_embedding_image as wei


def embedding():
    g = torch.Generator().manual_seed(7)
    vec = torch.randn(3, 16, generator=g)
    return {"string_to_token": {"*": 265}, "string_to_param": {"*": vec}, "name": "cat-toy",
            "step": 1500, "sd_checkpoint": "a9263745", "sd_checkpoint_name": "v1-5-pruned"}


def hypernetwork():
    g = torch.Generator().manual_seed(3)
    def sd():
        return collections.OrderedDict([("linear.0.weight", torch.randn(8, 4, generator=g)),
                                        ("linear.0.bias", torch.zeros(8)),
                                        ("linear.1.weight", torch.randn(4, 8, generator=g)),
                                        ("linear.1.bias", torch.zeros(4))])
    return {4: [sd(), sd()], 320: [sd(), sd()], "step": 10, "name": "hn", "layer_structure": [1, 2, 1],
            "activation_func": "relu", "is_layer_norm": False, "weight_initialization": "Normal",
            "sd_checkpoint": None, "sd_checkpoint_name": None, "activate_output": False,
            "use_dropout": True, "dropout_structure": [0, 0.3, 0], "last_layer_dropout": False,
            "optional_info": None}


def dtypes():
    base = torch.linspace(-2, 2, 6).reshape(2, 3)
    return {"f32": base, "f64": base.double(), "f16": base.half(), "bf16": base.bfloat16(),
            "i64": (base * 10).long(), "i32": (base * 10).int(), "u8": (base.abs() * 10).to(torch.uint8),
            "bool": base > 0, "strided": torch.arange(12.0).reshape(3, 4).t(),
            "scalar": torch.tensor(2.5), "param": torch.nn.Parameter(torch.ones(2)),
            "tuple": (1, "two", 3.0), "nested": {"list": [1, [2, 3]], "none": None, "t": True}}


def summary(v):
    if isinstance(v, torch.Tensor):
        return {"tensor": str(v.dtype).replace("torch.", ""), "shape": list(v.shape),
                "values": v.detach().double().flatten().tolist()}
    if isinstance(v, dict):
        return {"dict": [[k if isinstance(k, str) else int(k), summary(x)] for k, x in v.items()]}
    if isinstance(v, (list, tuple)):
        return {"list": [summary(x) for x in v]}
    return {"value": v}


def cover():
    pixels = [(x * 4 % 256, y * 4 % 256, 200) for y in range(48) for x in range(40)]
    image = Image.new("RGB", (40, 48))
    image.putdata(pixels)
    return image


def generate(out):
    files = {"webui_embedding.pt": embedding(), "webui_hypernetwork.pt": hypernetwork(),
             "dtypes.pt": dtypes()}
    for name, data in files.items():
        torch.save(data, out / name)
    concept = {"<cat-toy>": embedding()["string_to_param"]["*"][0].clone()}
    torch.save(concept, out / "learned_embeds.bin")
    files["learned_embeds.bin"] = concept
    torch.save(embedding(), out / "legacy_embedding.pt", _use_new_zipfile_serialization=False)
    for name, data in files.items():
        loaded = torch.load(out / name, weights_only=True)
        (out / (name + ".json")).write_text(json.dumps(summary(loaded)))
    # The same embedding in PNGs: text chunk only, image data only, both.
    data = embedding()
    wei.save_embedding_png(out / "embedding_text.png", cover(), data, text=True, image_data=False)
    wei.save_embedding_png(out / "embedding_image.png", cover(), data, text=False, image_data=True)
    wei.save_embedding_png(out / "embedding_both.png", cover(), data, text=True, image_data=True)
    (out / "embedding_png.json").write_text(json.dumps({
        "vec": data["string_to_param"]["*"].double().flatten().tolist(),
        "shape": list(data["string_to_param"]["*"].shape),
        "cover": list(cover().getdata())}))
    generate_idx(out)


def generate_idx(out):
    """Sums of Debian's Fashion-MNIST test split, read with gzip + numpy (when installed)."""
    import gzip
    import pathlib

    import numpy as np
    root = pathlib.Path("/usr/share/datasets/fashion-mnist")
    if not root.exists():
        return
    images = np.frombuffer(gzip.open(root / "t10k-images-idx3-ubyte.gz").read()[16:], np.uint8)
    labels = np.frombuffer(gzip.open(root / "t10k-labels-idx1-ubyte.gz").read()[8:], np.uint8)
    (out / "fashion_mnist_t10k.json").write_text(json.dumps({
        "pixel_sum": int(images.astype(np.int64).sum()), "label_counts": np.bincount(labels).tolist(),
        "first_pixels": images[:784].tolist()}))
