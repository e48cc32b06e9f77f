"""Writes the seed corpus the fuzz targets start from and the unit tests replay: valid files made
by the Python libraries plus hand-made hostile variants (truncated, huge header length, overlapping
or out-of-bounds offsets, wrong dtype size, NaN in metadata, bad CRC, zip bombs...). Usage:
make_corpus.py OUT_DIR. Files the fuzzers find later are added to the same folders."""
import io
import json
import pathlib
import struct
import sys
import zipfile
import zlib

import torch
from safetensors.torch import save

sys.path.insert(0, str(pathlib.Path(__file__).parent.parent / "reference"))
import ref_torch_files  # noqa: E402
import webui_embedding_image as wei  # noqa: E402


def st(header, data=b"", declared=None):
    h = json.dumps(header).encode() if not isinstance(header, bytes) else header
    return struct.pack("<Q", declared if declared is not None else len(h)) + h + data


def safetensors_cases():
    valid = save({"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(2, dtype=torch.bfloat16)},
                 metadata={"format": "pt"})
    f32 = lambda off, shape=(2,): {"dtype": "F32", "shape": list(shape), "data_offsets": off}  # noqa: E731
    return {
        "valid": valid,
        "truncated": valid[: len(valid) // 2],
        "huge_header_length": st({}, declared=2 ** 62),
        "header_past_end": st({}, declared=4096),
        "overlapping_offsets": st({"a": f32([0, 8]), "b": f32([4, 12])}, bytes(12)),
        "gap_between_tensors": st({"a": f32([0, 8]), "b": f32([12, 20])}, bytes(20)),
        "offsets_out_of_bounds": st({"a": f32([0, 8000])}, bytes(8)),
        "wrong_dtype_size": st({"a": {"dtype": "F64", "shape": [2], "data_offsets": [0, 8]}}, bytes(8)),
        "shape_overflow": st({"a": {"dtype": "F32", "shape": [2 ** 62, 2 ** 62], "data_offsets": [0, 8]}}, bytes(8)),
        "nan_in_metadata": st(b'{"__metadata__": {"lr": NaN}, "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}', bytes(8)),
        "number_in_metadata": st({"__metadata__": {"lr": 0.1}, "a": f32([0, 8])}, bytes(8)),
        "unknown_dtype": st({"a": {"dtype": "F33", "shape": [2], "data_offsets": [0, 8]}}, bytes(8)),
        "trailing_bytes": st({"a": f32([0, 8])}, bytes(16)),
        "not_json": st(b"{\"a\": [1, 2", b""),
        "duplicate_key": st(b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, '
                            b'"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}', bytes(8)),
        "zero_then_huge": st({"a": {"dtype": "F32", "shape": [0, 2 ** 62, 4], "data_offsets": [0, 0]}}),
        "deep_shape": st(b'{"a": {"dtype": "F32", "shape": ' + b"[" * 100_000 + b"]" * 100_000
                         + b', "data_offsets": [0, 8]}}', bytes(8)),
    }


def torch_bytes(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def rezip(data, edit):
    """Rewrites a torch.save archive with edit(name, bytes) applied to each record."""
    src = zipfile.ZipFile(io.BytesIO(data))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as dst:
        for name in src.namelist():
            dst.writestr(name, edit(name, src.read(name)))
    return out.getvalue()


def torch_file_cases():
    emb = torch_bytes(ref_torch_files.embedding())
    hn = torch_bytes(ref_torch_files.hypernetwork())
    class Evil:
        def __reduce__(self):
            return (print, ("owned",))
    cases = {
        "webui_embedding": emb,
        "webui_hypernetwork": hn,
        "dtypes": torch_bytes(ref_torch_files.dtypes()),
        "truncated": emb[: len(emb) // 2],
        "python_global": torch_bytes({"x": Evil()}),
        "storage_too_short": rezip(emb, lambda n, b: b[:8] if n.endswith("data/0") else b),
        "missing_storage": rezip(emb, lambda n, b: b"" if n.endswith("data/0") else b),
        "pickle_cut": rezip(emb, lambda n, b: b[: len(b) // 2] if n.endswith("data.pkl") else b),
        "big_endian": rezip(emb, lambda n, b: b"big" if n.endswith("byteorder") else b),
        "not_a_zip": b"PK\x03\x04" + bytes(100),
    }
    # A tensor declaring more elements than its storage holds: patch the size tuple in the pickle.
    def grow(n, b):
        return b.replace(b"K\x03K\x10\x86", b"K\x63K\x10\x86") if n.endswith("data.pkl") else b
    cases["tensor_past_storage"] = rezip(emb, grow)
    cases.update(hostile_pickles(emb))
    cases.update(format_cases())
    return cases


def archive(pickle, records=None, compression=zipfile.ZIP_STORED):
    """A torch.save-shaped zip around a hand-made pickle (with torch.save's version record unless
    `records` gives another; None in `records` leaves a record out)."""
    out = io.BytesIO()
    records = {"version": b"3\n"} | (records or {})
    with zipfile.ZipFile(out, "w", compression=compression) as z:
        z.writestr("archive/data.pkl", pickle)
        z.writestr("archive/byteorder", "little")
        for name, data in records.items():
            if data is not None:
                z.writestr("archive/" + name, data)
    return out.getvalue()


def format_cases():
    """What torch.load refuses before it unpickles: the archive's version record missing, not a
    number, or out of its range; and a pickle FRAME that promises more bytes than follow."""
    empty_dict = b"\x80\x02}q\x00."
    frame = b"\x80\x04\x95" + struct.pack("<Q", 1 << 20) + b"}q\x00."
    return {"version_missing": archive(empty_dict, {"version": None}),
            "version_garbage": archive(empty_dict, {"version": b"three"}),
            "version_99": archive(empty_dict, {"version": b"99\n"}),
            "frame_past_end": archive(frame)}


def hostile_pickles(emb):
    """Nesting, sharing and container damage that must end in a FormatError, quickly and
    without exhausting the stack or memory."""
    deep_tuples = b"\x80\x02N" + b"\x85" * 250_000 + b"."          # (((None,),),)...
    deep_lists = b"\x80\x02" + b"](" * 200_000 + b"e" * 200_000 + b"."  # [[[...]]] via APPENDS
    # Each level a tuple holding the previous level twice through the memo: 2^60 leaves.
    dag_tuples = b"\x80\x02]q\x00" + b"".join(
        b"0h" + bytes([i]) + b"h" + bytes([i]) + b"\x86q" + bytes([i + 1]) for i in range(60)) + b"."
    dag_dicts = b"\x80\x02}q\x00" + b"".join(
        b"0}(X\x01\x00\x00\x00ah" + bytes([i]) + b"X\x01\x00\x00\x00bh" + bytes([i]) + b"uq"
        + bytes([i + 1]) for i in range(60)) + b"."
    # A 100 MB `version` record deflated to ~100 KB: never read, so never inflated.
    version_bomb = archive(b"\x80\x02}q\x00.", {"version": b"0" * (100 << 20)}, zipfile.ZIP_DEFLATED)
    # A byte flipped inside a tensor's stored data: only the CRC-32 can tell.
    z = zipfile.ZipFile(io.BytesIO(emb))
    info = next(i for i in z.infolist() if i.filename.endswith("data/0"))
    name_len, extra_len = struct.unpack("<HH", emb[info.header_offset + 26:info.header_offset + 30])
    start = info.header_offset + 30 + name_len + extra_len  # the local header's own lengths
    flipped = bytearray(emb)
    flipped[start + 5] ^= 0x40
    # The same file with every record deflated, as Python's zipfile can write it: still readable.
    deflated = rezip_deflated(emb)
    return {"deep_tuples": archive(deep_tuples), "deep_lists": archive(deep_lists),
            "dag_tuples": archive(dag_tuples), "dag_dicts": archive(dag_dicts),
            "version_bomb": version_bomb, "flipped_tensor_byte": bytes(flipped),
            "deflated_records": deflated}


def rezip_deflated(data):
    src = zipfile.ZipFile(io.BytesIO(data))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED) as dst:
        for name in src.namelist():
            dst.writestr(name, src.read(name))
    return out.getvalue()


def adapter_torch_cases():
    """Adapter files that parse as torch files but are not adapters one can use."""
    g = torch.Generator().manual_seed(3)
    r = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731

    def hn(layers, **settings):
        return torch_bytes({**layers, "layer_structure": [1, 2, 1], "activation_func": "relu",
                            "is_layer_norm": False, "weight_initialization": "Normal", "name": "bad",
                            "step": 1, **settings})
    sd = {"linear.0.weight": r(16, 8), "linear.0.bias": r(16), "linear.2.weight": r(8, 16), "linear.2.bias": r(8)}
    adam_state = {"state": {0: {"step": torch.tensor(1.0), "exp_avg": r(5, 5), "exp_avg_sq": r(5, 5)}},
                  "param_groups": [{"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
                                    "amsgrad": False, "params": [0]}]}
    return {
        "adapter_embedding_two_terms": torch_bytes({"string_to_param": {"*": r(2, 8), "x": r(2, 8)}}),
        "adapter_embedding_int_vectors": torch_bytes({"string_to_param": {"*": torch.ones(2, 8, dtype=torch.int64)}}),
        "adapter_embedding_3d": torch_bytes({"string_to_param": {"*": r(2, 3, 4)}}),
        "adapter_embedding_list": torch_bytes([r(2, 8)]),
        "adapter_sdxl_mismatched": torch_bytes({"clip_l": r(2, 8), "clip_g": r(3, 12)}),
        "adapter_hypernetwork_wrong_shape": hn({8: ({**sd, "linear.2.weight": r(8, 15)}, sd)}),
        "adapter_hypernetwork_one_module": hn({8: (sd,)}),
        "adapter_hypernetwork_bad_structure": hn({8: (sd, sd)}, layer_structure=[2, 1]),
        "adapter_hypernetwork_bad_activation": hn({8: (sd, sd)}, activation_func="evil"),
        "adapter_hypernetwork_huge_width": hn({2 ** 40: (sd, sd)}),
        "adapter_optim_wrong_shapes": torch_bytes({"hash": "0000", "optimizer_state_dict": adam_state}),
    }


def adapter_safetensors_cases():
    """LoRA files for a CrossAttention(16, context 12, 2 heads of 8) that do not fit it."""
    g = torch.Generator().manual_seed(4)
    r = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    good = {"unet.to_q.lora_A.weight": r(4, 16), "unet.to_q.lora_B.weight": r(16, 4)}
    return {
        "adapter_lora_missing_B": save({"unet.to_q.lora_A.weight": r(4, 16)}),
        "adapter_lora_rank_mismatch": save({**good, "unet.to_q.lora_B.weight": r(16, 2)}),
        "adapter_lora_foreign_key": save({**good, "unet.down_blocks.0.lora_A.weight": r(4, 16)}),
        "adapter_lora_wrong_width": save({"unet.to_k.lora_A.weight": r(4, 16), "unet.to_k.lora_B.weight": r(16, 4)}),
    }


def png_cases():
    cover = ref_torch_files.cover()
    data = ref_torch_files.embedding()
    out = {}
    for name, text, pixels in [("both", True, True), ("text", True, False), ("image", False, True)]:
        buf = io.BytesIO()
        wei.save_embedding_png(buf, cover, data, text=text, image_data=pixels)
        out[name] = buf.getvalue()
    both = out["both"]
    out["truncated"] = both[: len(both) // 2]
    bad_crc = bytearray(both)
    bad_crc[20] ^= 1
    out["bad_crc"] = bytes(bad_crc)
    huge = bytearray(both)
    huge[16:24] = struct.pack(">II", 2 ** 31 - 1, 2 ** 31 - 1)
    huge[29:33] = struct.pack(">I", zlib.crc32(bytes(huge[12:29])))
    out["huge_dimensions"] = bytes(huge)
    bomb_body = b"sd-ti-embedding\x00\x00" + zlib.compress(b"A" * (64 << 20), 9)
    bomb = b"zTXt" + bomb_body
    chunk = struct.pack(">I", len(bomb_body)) + bomb + struct.pack(">I", zlib.crc32(bomb))
    out["ztxt_bomb"] = both[:-12] + chunk + both[-12:]  # after the real text chunk, so it wins
    bad_b64 = b"tEXt" + b"sd-ti-embedding\x00not base64 at all!"
    out["bad_base64"] = (both[:-12] + struct.pack(">I", len(bad_b64) - 4) + bad_b64
                         + struct.pack(">I", zlib.crc32(bad_b64)) + both[-12:])
    # 65 bytes declaring 8000 x 8000 pixels (under the pixel limit): refused by what its image
    # data can hold, before any pixel memory exists.
    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    sig = b"\x89PNG\r\n\x1a\n"
    out["tiny_huge_image"] = (sig + chunk(b"IHDR", struct.pack(">IIBBBBB", 8000, 8000, 8, 2, 0, 0, 0))
                              + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))
    itxt = b"sd-ti-embedding\x00\x01\x00\x00\x00" + zlib.compress(b"A" * (80 << 20), 9)
    out["itxt_bomb"] = both[:-12] + chunk(b"iTXt", itxt) + both[-12:]
    import base64
    huge_int = base64.b64encode(json.dumps(
        {"string_to_param": {"*": {"TORCHTENSOR": [[18446744073709551615, 1]]}}, "name": "x",
         "step": 0, "sd_checkpoint": None, "sd_checkpoint_name": None}).encode())
    out["torchtensor_u64"] = both[:-12] + chunk(b"tEXt", b"sd-ti-embedding\x00" + huge_int) + both[-12:]
    # All black: no lit pixel, so no data blocks (not blocks of different widths).
    import PIL.Image
    black = io.BytesIO()
    PIL.Image.new("RGB", (64, 48)).save(black, format="PNG")
    out["all_black"] = black.getvalue()
    return out


def many_entries_safetensors(n=200_000):
    """200,000 empty tensors (a 13 MB header): a reader must parse it in time linear in its size."""
    header = {f"t{i}": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for i in range(n)}
    return {"many_entries": st(header)}


def image_cases():
    """The image decoders' inputs: every good and hostile file ref_images.py writes (JPEG, PNG and
    WebP of each kind, EXIF orientations, truncated files, bombs, CMYK, wrong magic), by name."""
    import tempfile
    import ref_images
    with tempfile.TemporaryDirectory() as tmp:
        ref_images.generate(pathlib.Path(tmp))
        root = pathlib.Path(tmp) / "images"
        return {f"{kind}_{f.name}": f.read_bytes() for kind in ("good", "bad")
                for f in sorted((root / kind).iterdir()) if f.stat().st_size <= 65536}


def video_cases():
    """The video reader's inputs: small clips in each container and codec ref_video.py writes (and
    a GIF, a variable-frame-rate MP4, an audio-only file), then hostile ones: truncated, garbage
    after a real header, a zeroed middle, a GIF declaring 65535 x 65535 frames (an MP4 container
    saying so, which the decoder overrules), a clip longer than the target's frame limit, nothing."""
    import tempfile
    import av
    import numpy as np
    import ref_video
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        out = {}
        for name, (fmt, codec, pix, w, h, n, fps) in ref_video.CLIPS.items():
            ref_video.write_clip(root / name, fmt, codec, pix, w, h, n, fps)
            out[f"good_{name}"] = (root / name).read_bytes()
        ref_video.write_vfr(root / "vfr.mp4")
        out["good_vfr.mp4"] = (root / "vfr.mp4").read_bytes()
        ref_video.write_audio_only(root / "audio.m4a")
        out["bad_audio_only.m4a"] = (root / "audio.m4a").read_bytes()
        with av.open(str(root / "clip.gif"), "w", format="gif") as f:
            s = f.add_stream("gif", rate=5)
            s.width, s.height, s.pix_fmt = 16, 12, "rgb8"
            for t in range(4):
                frame = av.VideoFrame.from_ndarray(ref_video.picture(t, 16, 12), format="rgb24")
                for p in s.encode(frame.reformat(format="rgb8")):
                    f.mux(p)
            for p in s.encode():
                f.mux(p)
        out["good_clip.gif"] = (root / "clip.gif").read_bytes()
        # 100 frames of 16 x 16: past the fuzz target's limit of 64 frames.
        ref_video.write_clip(root / "long.mp4", "mp4", "libx264", "yuv420p", 16, 16, 100, 25)
        out["bad_too_many_frames.mp4"] = (root / "long.mp4").read_bytes()
    mp4 = out["good_h264_420.mp4"]
    out["bad_truncated.mp4"] = mp4[: len(mp4) // 2]
    out["bad_garbage.mp4"] = mp4[:32] + bytes(range(256)) * 4
    middle = bytearray(mp4)
    mdat = middle.find(b"mdat")
    middle[mdat + 64:mdat + 1024] = bytes(len(middle[mdat + 64:mdat + 1024]))
    out["zeroed_middle.mp4"] = bytes(middle)
    huge = bytearray(mp4)
    avc1 = huge.find(b"avc1")
    huge[avc1 + 28:avc1 + 32] = struct.pack(">HH", 65535, 65535)  # width, height in the sample entry
    tkhd = huge.find(b"tkhd")
    huge[tkhd + 80:tkhd + 88] = struct.pack(">II", 65535 << 16, 65535 << 16)  # the track's size
    out["container_says_huge.mp4"] = bytes(huge)  # the decoder's SPS wins: it decodes at 64x48
    gif = bytearray(out["good_clip.gif"])
    gif[6:10] = struct.pack("<HH", 65535, 65535)  # the logical screen: 2^32 pixels a frame
    out["bad_huge_size.gif"] = bytes(gif)
    out["bad_empty.mp4"] = b""
    out["bad_text.webm"] = b"not a video at all\n" * 8
    # What the fuzzer found: a Matroska stream whose frames change size midway (the frames did not
    # stack). Kept as it was found.
    found = pathlib.Path(__file__).parent / "corpus" / "video" / "bad_size_change.mkv"
    if found.exists():
        out["bad_size_change.mkv"] = found.read_bytes()
    return out


def main(out):
    out = pathlib.Path(out)
    for folder, cases in [("safetensors", safetensors_cases() | adapter_safetensors_cases()
                           | many_entries_safetensors()),
                          ("torch_file", torch_file_cases() | adapter_torch_cases()),
                          ("embedded_png", png_cases()),
                          ("image", image_cases()),
                          ("video", video_cases())]:
        (out / folder).mkdir(parents=True, exist_ok=True)
        for name, data in cases.items():
            (out / folder / name).write_bytes(data)
    print(f"corpus written to {out}")


if __name__ == "__main__":
    main(sys.argv[1])
