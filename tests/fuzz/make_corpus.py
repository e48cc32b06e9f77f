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
    return cases


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
    return out


def main(out):
    out = pathlib.Path(out)
    for folder, cases in [("safetensors", safetensors_cases()), ("torch_file", torch_file_cases()),
                          ("embedded_png", png_cases())]:
        (out / folder).mkdir(parents=True, exist_ok=True)
        for name, data in cases.items():
            (out / folder / name).write_bytes(data)
    print(f"corpus written to {out}")


if __name__ == "__main__":
    main(sys.argv[1])
