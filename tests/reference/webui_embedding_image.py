"""The web UI's PNG embedding carriers, restated from its image_embedding module so tests can make
and read such files without the web UI: the `sd-ti-embedding` text chunk (base64 JSON) and the
image-data variant (zlib JSON as nibbles around the picture, styled with ellipses, XOR-ed with an
LCG). Used to produce golden files for the C++ reader and to check files the C++ writer makes."""
import base64
import json
import zlib

import numpy as np
import torch
from PIL import Image, ImageDraw, PngImagePlugin


class Encoder(json.JSONEncoder):
    def default(self, obj):
        if isinstance(obj, torch.Tensor):
            return {"TORCHTENSOR": obj.cpu().detach().numpy().tolist()}
        return super().default(obj)


def decode_hook(d):
    if "TORCHTENSOR" in d:
        return torch.from_numpy(np.array(d["TORCHTENSOR"]))
    return d


def to_b64(data):
    return base64.b64encode(json.dumps(data, cls=Encoder).encode())


def from_b64(text):
    return json.loads(base64.b64decode(text), object_hook=decode_hook)


def lcg_values(n, m=2 ** 32, a=1664525, c=1013904223):
    seed, out = 0, np.empty(n, dtype=np.uint8)
    for i in range(n):
        seed = (a * seed + c) % m
        out[i] = seed % 255
    return out


def xor_block(block):
    rand = lcg_values(block.size).reshape(block.shape)
    return np.bitwise_xor(block.astype(np.uint8), rand & 0x0F)


def style_block(block, sequence):
    im = Image.new("RGB", (block.shape[1], block.shape[0]))
    draw = ImageDraw.Draw(im)
    i = 0
    for x in range(-6, im.size[0], 8):
        for yi, y in enumerate(range(-6, im.size[1], 8)):
            offset = 4 if yi % 2 == 0 else 0
            shade = int(sequence[i % len(sequence)])
            i += 1
            draw.ellipse((x + offset, y, x + 6 + offset, y + 6), fill=(shade, shade, shade))
    return block ^ (np.array(im).astype(np.uint8) & 0xF0)


def insert_image_data(image, data):
    packed = np.frombuffer(zlib.compress(json.dumps(data, cls=Encoder).encode(), level=9), np.uint8).copy()
    high, low = packed >> 4, packed & 0x0F
    h, d = image.size[1], 3
    n = low.shape[0] + (h - low.shape[0] % h)
    n = n + (h * d - n % (h * d))
    low = np.resize(low, n).reshape((h, -1, d))
    high = np.resize(high, n).reshape((h, -1, d))
    edge = list(data["string_to_param"].values())[0].cpu().detach().numpy().tolist()[0][:1024]
    edge = (np.abs(edge) / np.max(np.abs(edge)) * 255).astype(np.uint8)
    low = xor_block(style_block(low, edge))
    high = xor_block(style_block(high, edge[::-1]))
    im_low, im_high = Image.fromarray(low, mode="RGB"), Image.fromarray(high, mode="RGB")
    canvas = Image.new("RGB", (image.size[0] + im_low.size[0] + im_high.size[0] + 2, image.size[1]), (0, 0, 0))
    canvas.paste(im_low, (0, 0))
    canvas.paste(image, (im_low.size[0] + 1, 0))
    canvas.paste(im_high, (im_low.size[0] + 1 + image.size[0] + 1, 0))
    return canvas


def crop_black(img, tol=0):
    mask = (img > tol).all(2)
    mask0, mask1 = mask.any(0), mask.any(1)
    c0, c1 = mask0.argmax(), mask.shape[1] - mask0[::-1].argmax()
    r0, r1 = mask1.argmax(), mask.shape[0] - mask1[::-1].argmax()
    return img[r0:r1, c0:c1]


def extract_image_data(image):
    arr = np.array(image.convert("RGB").getdata()).reshape(image.size[1], image.size[0], 3).astype(np.uint8)
    out = crop_black(arr) & 0x0F
    black = np.where(np.sum(out, axis=(0, 2)) == 0)
    if black[0].shape[0] < 2:
        return None
    lower = xor_block(out[:, :black[0].min(), :].astype(np.uint8))
    upper = xor_block(out[:, black[0].max() + 1:, :].astype(np.uint8))
    return json.loads(zlib.decompress(((upper << 4) | lower).flatten().tobytes()), object_hook=decode_hook)


def read_embedding_png(path):
    image = Image.open(path)
    if "sd-ti-embedding" in getattr(image, "text", {}):
        return from_b64(image.text["sd-ti-embedding"])
    return extract_image_data(image)


def save_embedding_png(path, cover, data, text=True, image_data=True):
    picture = insert_image_data(cover, data) if image_data else cover
    info = PngImagePlugin.PngInfo()
    if text:
        info.add_text("sd-ti-embedding", to_b64(data))
    picture.save(path, format="PNG", pnginfo=info)
