"""A safetensors file written by Python's `safetensors` with every dtype difftrain maps, metadata,
an empty and a scalar tensor; the C++ test reads it and compares the values recorded here."""
import json

import torch
from safetensors.torch import save_file


def tensors():
    base = torch.linspace(-3, 3, 24).reshape(2, 3, 4)
    return {
        "f64": base.double(), "f32": base.clone(), "f16": base.half(), "bf16": base.bfloat16(),
        "i64": (base * 100).long(), "i32": (base * 10).int(), "i16": (base * 10).short(), "i8": (base * 10).to(torch.int8),
        "u8": (base.abs() * 10).to(torch.uint8), "bool": base > 0,
        "f8_e4m3": base.to(torch.float8_e4m3fn), "f8_e5m2": base.to(torch.float8_e5m2),
        "empty": torch.zeros(0, 5), "scalar": torch.tensor(7.5),
        "down.blocks.0.to_q.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3),
    }


def generate(out):
    t = tensors()
    save_file(t, str(out / "python.safetensors"), metadata={"format": "pt", "ss_network_dim": "4"})
    (out / "safetensors.json").write_text(json.dumps({
        k: {"shape": list(v.shape), "values": v.double().flatten().tolist()} for k, v in t.items()}))
