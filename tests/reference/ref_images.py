"""Images as the training scripts open them: PIL (Pillow) writes JPEG, PNG and WebP files of every
kind the image-folder datasets meet (colour, grey, palette, alpha, 1- and 16-bit, interlaced,
progressive, chroma subsampled, with gamma chunks, EXIF orientations 1 to 8), and for each the
pixels of `ImageOps.exif_transpose(Image.open(f)).convert("RGB")`, which the C++ decoder must
give. Also hostile files (truncated, wrong kind, decompression bombs, CMYK) for its errors."""
import io
import json
import pathlib
import struct
import zlib

import numpy as np


def picture(h, w, seed):
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x * 255 / max(w - 1, 1), y * 255 / max(h - 1, 1), (x + y) * 127 / max(h + w - 2, 1)], -1)
    return np.clip(base + rng.normal(0, 20, (h, w, 3)), 0, 255).astype(np.uint8)


def chunk(kind, data):
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_raw(arr, depth, color_type, extra=b""):
    h, w = arr.shape[:2]
    dtype = ">u2" if depth == 16 else "u1"
    rows = b"".join(b"\x00" + arr[y].astype(dtype).tobytes() for y in range(h))
    ihdr = struct.pack(">IIBBBBB", w, h, depth, color_type, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + extra + chunk(b"IDAT", zlib.compress(rows))
            + chunk(b"IEND", b""))


def exif_bytes(orientation):
    from PIL import Image
    e = Image.Exif()
    e[0x0112] = orientation
    return e.tobytes()


def generate(out: pathlib.Path):
    from PIL import Image
    from PIL import ImageOps
    from safetensors.numpy import save_file
    root = out / "images"
    good, bad = root / "good", root / "bad"
    for d in (good, bad):
        d.mkdir(parents=True, exist_ok=True)
    rgb = picture(23, 37, 1)
    files = {}

    def save(name, image, **kw):
        buf = io.BytesIO()
        image.save(buf, **kw)
        files[name] = buf.getvalue()

    img = Image.fromarray(rgb)
    save("baseline_420.jpg", img, format="JPEG", quality=90)
    save("q75_444.jpg", img, format="JPEG", quality=75, subsampling=0)
    save("q95_422.jpg", img, format="JPEG", quality=95, subsampling=1)
    save("progressive.jpg", img, format="JPEG", quality=85, progressive=True)
    save("grey.jpg", img.convert("L"), format="JPEG", quality=90)
    save("large_odd.jpg", Image.fromarray(picture(301, 157, 2)), format="JPEG", quality=80)
    for o in range(1, 9):
        save(f"orientation_{o}.jpg", img, format="JPEG", quality=90, exif=exif_bytes(o))
    save("rgb.png", img, format="PNG")
    save("rgba.png", Image.fromarray(np.dstack([rgb, picture(23, 37, 3)[..., 0]])), format="PNG")
    save("grey.png", img.convert("L"), format="PNG")
    save("grey_alpha.png", img.convert("LA"), format="PNG")
    save("palette.png", img.convert("P", palette=Image.ADAPTIVE, colors=17), format="PNG")
    pal = img.convert("P", palette=Image.ADAPTIVE, colors=5)
    pal.info["transparency"] = 2
    save("palette_trns.png", pal, format="PNG", transparency=2)
    save("bits1.png", img.convert("1"), format="PNG")
    save("interlaced.png", img, format="PNG", optimize=False)
    save("exif_6.png", img, format="PNG", exif=exif_bytes(6))
    wide = (rgb.astype(np.uint16) * 257 + np.arange(3, dtype=np.uint16)).astype(np.uint16)
    files["rgb16.png"] = png_raw(wide, 16, 2)
    files["rgba16.png"] = png_raw(np.dstack([wide, wide[..., :1]]), 16, 6)
    grey16 = np.array([[0, 1, 255, 256, 1000, 65535]] * 3, dtype=np.uint16)
    files["grey16.png"] = png_raw(grey16, 16, 0)
    files["grey_alpha16.png"] = png_raw(np.dstack([grey16, grey16]), 16, 4)
    files["gamma.png"] = png_raw(rgb, 8, 2, chunk(b"gAMA", struct.pack(">I", 100000)))
    files["grey2.png"] = png_raw((rgb[..., 0] >> 6).astype(np.uint8), 8, 0)  # values 0..3 in 8 bit
    save("lossless.webp", img, format="WEBP", lossless=True)
    save("lossless_alpha.webp", Image.fromarray(np.dstack([rgb, rgb[..., 1]])), format="WEBP",
         lossless=True)
    save("lossy.webp", img, format="WEBP", quality=80)
    save("exif_8.webp", img, format="WEBP", lossless=True, exif=exif_bytes(8))
    # Animated WebPs: PIL opens the first frame (composited on the canvas as libwebp's animation
    # decoder gives it), opaque and with alpha.
    frames = [img] + [Image.fromarray(picture(23, 37, s)) for s in (4, 5)]
    save("animated.webp", frames[0], format="WEBP", save_all=True, append_images=frames[1:],
         lossless=True, duration=80, loop=0)
    alpha = [Image.fromarray(np.dstack([picture(23, 37, s), picture(23, 37, s + 1)[..., 0]]))
             for s in (6, 8)]
    save("animated_alpha.webp", alpha[0], format="WEBP", save_all=True, append_images=alpha[1:],
         lossless=True, duration=80)
    expected = {}
    exact = {}
    for name, data in files.items():
        (good / name).write_bytes(data)
        with Image.open(io.BytesIO(data)) as im:
            expected[name] = np.ascontiguousarray(np.asarray(ImageOps.exif_transpose(im).convert("RGB")))
        exact[name] = not (name.endswith(".webp") and "lossy" in name)
    save_file(expected, root / "expected.safetensors")

    # Hostile files: the decoder must refuse each with a typed error saying what is wrong.
    jpg, png, webp = files["baseline_420.jpg"], files["rgb.png"], files["lossy.webp"]
    hostile = {
        "truncated.jpg": jpg[: len(jpg) - 30],
        "truncated_header.jpg": jpg[: len(jpg) // 2],
        "truncated.png": png[: len(png) - 40],
        "truncated.webp": webp[: len(webp) // 2],
        "empty.png": b"",
        "gif.jpg": b"GIF89a" + bytes(20),
        "bmp.png": b"BM" + bytes(40),
        "text.webp": b"hello, this is not an image\n",
        "bomb.png": png_raw(np.zeros((1, 1), np.uint8), 8, 0).replace(
            struct.pack(">II", 1, 1), struct.pack(">II", 100000, 100000), 1),
        "bomb.jpg": jpg.replace(struct.pack(">HH", 23, 37), struct.pack(">HH", 60000, 60000), 1),
        "cmyk.jpg": None,
        # 16-bit grey declaring 9,400 x 9,400 pixels (under the pixel limit) in a few bytes of
        # image data: 177 MB of rows its 69-byte body cannot hold.
        "bomb16.png": (b"\x89PNG\r\n\x1a\n"
                       + chunk(b"IHDR", struct.pack(">IIBBBBB", 9400, 9400, 16, 0, 0, 0, 0))
                       + chunk(b"IDAT", zlib.compress(b"\x00" * 1000)) + chunk(b"IEND", b"")),
        "garbage_after_magic.jpg": b"\xff\xd8\xff" + bytes(range(256)) * 4,
    }
    buf = io.BytesIO()
    Image.fromarray(rgb).convert("CMYK").save(buf, format="JPEG")
    hostile["cmyk.jpg"] = buf.getvalue()
    for name, data in hostile.items():
        (bad / name).write_bytes(data)
    (out / "images.json").write_text(json.dumps({"exact": exact, "hostile": sorted(hostile)}))
