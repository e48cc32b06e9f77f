"""Adapter files written by difftrain load in Python as the web UI and diffusers load them.

  check_cpp_adapters.py TEST_BINARY GOLDEN_DIR   the unit test's files: a textual-inversion
      embedding and its .optim sidecar (torch's AdamW continues from it exactly as difftrain did),
      a hypernetwork and its sidecar (the web UI's module loads its state dicts strictly; the hash
      is the file's SHA-256), LoRA files in the PEFT and kohya layouts;
  check_cpp_adapters.py --example OUT_DIR      the adapters example's files (names, shapes and
      metadata of the embedding, hypernetwork and LoRA it wrote; its caption tokenizer folder, read
      by transformers' CLIPTokenizer, splits the prompts into the ids the example used).
"""
import hashlib
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import torch
from safetensors import safe_open
from safetensors.torch import load_file

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from ref_embedding import checksum  # noqa: E402
from ref_hypernetwork import HypernetworkModule  # noqa: E402


def load(path):
    # weights_only: the files must need nothing beyond tensors and plain containers.
    return torch.load(str(path), map_location="cpu", weights_only=True)


def check_embedding(path, vectors=None, width=None):
    e = load(path)
    assert e["string_to_token"] == {"*": 265}, e["string_to_token"]
    (vec,) = e["string_to_param"].values()
    assert vec.dim() == 2 and (vectors is None or vec.shape[0] == vectors) and (width is None or vec.shape[1] == width), vec.shape
    for key in ("name", "step", "sd_checkpoint", "sd_checkpoint_name"):
        assert key in e, key
    return e, vec


def check_optim_sidecar(path, hash_, name=None):
    s = load(str(path) + ".optim")
    assert s["hash"] == hash_, (s["hash"], hash_)
    assert s.get("optimizer_name") == name, s.get("optimizer_name")
    return s["optimizer_state_dict"]


def shorthash(path):
    return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()[:10]


def check_hypernetwork(path, optim=True):
    h = load(path)
    sizes = [k for k in h if isinstance(k, int)]
    assert sizes, "no layers"
    for key in ("step", "name", "layer_structure", "activation_func", "is_layer_norm", "weight_initialization",
                "sd_checkpoint", "sd_checkpoint_name", "activate_output", "use_dropout", "dropout_structure",
                "last_layer_dropout", "optional_info"):
        assert key in h, key
    modules = []
    for size in sizes:
        pair = h[size]
        assert len(pair) == 2
        for sd in pair:
            m = HypernetworkModule(size, h["layer_structure"], h["activation_func"], h["is_layer_norm"],
                                   h["activate_output"], h["dropout_structure"])
            m.load_state_dict(sd, strict=True)
            modules.append(m)
    if optim:
        state = check_optim_sidecar(path, shorthash(path), "AdamW")
        weights = [p for m in modules for p in m.parameters()]
        opt = torch.optim.AdamW(weights)
        opt.load_state_dict(state)
        assert len(opt.state) == len(weights)
    return h


def check_lora_peft(path, rank):
    with safe_open(str(path), framework="pt") as f:
        keys = list(f.keys())
        assert keys and all(k.endswith((".lora_A.weight", ".lora_B.weight")) for k in keys), keys
        for k in keys:
            if k.endswith(".lora_A.weight"):
                a, b = f.get_tensor(k), f.get_tensor(k.replace("lora_A", "lora_B"))
                assert a.shape[0] == rank and b.shape[1] == rank, (k, a.shape, b.shape)
        return keys, f.metadata()


def unit(binary):
    out = pathlib.Path(tempfile.mkdtemp())
    subprocess.run([binary, "--gtest_filter=AdapterFiles.WriteFilesForPython"], check=True,
                   env=dict(os.environ, DIFFTRAIN_ADAPTER_OUT=str(out)))
    e, vec = check_embedding(out / "py-check.pt", 3, 4)
    assert e["name"] == "py-check" and e["step"] == 3 and e["sd_checkpoint"] == "abcdef0123", e
    state = check_optim_sidecar(out / "py-check.pt", checksum(vec))
    param = torch.nn.Parameter(vec.clone())
    opt = torch.optim.AdamW([param], lr=0.01, weight_decay=0.0)
    opt.load_state_dict(state)
    param.grad = torch.sin(torch.arange(12, dtype=torch.float32).view(3, 4) * 4)
    opt.step()
    want = load_file(str(out / "after_fourth_step.safetensors"))["vec"]
    assert torch.allclose(param.detach(), want, atol=1e-6, rtol=1e-6), (param - want).abs().max()

    h = check_hypernetwork(out / "py-hn.pt")
    assert sorted(k for k in h if isinstance(k, int)) == [6, 10] and h["step"] == 7 and h["name"] == "py-hn"

    keys, meta = check_lora_peft(out / "lora_peft.safetensors", 4)
    assert sorted(keys) == sorted(f"unet.{m}.lora_{x}.weight" for m in ("to_q", "to_k", "to_v", "to_out.0")
                                  for x in "AB"), keys
    assert meta["ss_network_dim"] == "4", meta
    kohya = load_file(str(out / "lora_kohya.safetensors"))
    assert kohya["lora_unet_to_k.lora_down.weight"].shape == (4, 12)
    assert kohya["lora_unet_to_out_0.lora_up.weight"].shape == (16, 4)
    assert float(kohya["lora_unet_to_q.alpha"]) == 2.0
    print("torch and safetensors read difftrain's adapter files; AdamW continued from the sidecar exactly")


def example(out):
    out = pathlib.Path(out)
    results = json.loads((out / "results.json").read_text())
    files = results["files"]
    e, vec = check_embedding(out / files["embedding"])
    assert vec.shape[0] == results["embedding_vectors"], vec.shape
    check_optim_sidecar(out / files["embedding"], checksum(vec))
    check_hypernetwork(out / files["hypernetwork"])
    keys, meta = check_lora_peft(out / files["lora"], int(results["lora_rank"]))
    assert meta.get("lora_alpha") == str(results["lora_alpha"]) or "lora_alpha" in meta, meta
    # The caption tokenizer the example wrote is a transformers folder: CLIPTokenizer reads it and
    # splits the prompts into the ids difftrain used.
    from transformers import CLIPTokenizer
    tok = CLIPTokenizer.from_pretrained(str(out / results["tokenizer"]))
    for prompt, ids in results["prompt_ids"].items():
        got = tok(prompt, add_special_tokens=False).input_ids
        assert got == ids, (prompt, got, ids)
    for name in ("embedding", "hypernetwork", "lora"):
        size = (out / files[name]).stat().st_size
        assert size == results["file_bytes"][name], (name, size, results["file_bytes"][name])
    print(f"torch and safetensors read the example's adapter files in {out}")


if __name__ == "__main__":
    if sys.argv[1] == "--example":
        example(sys.argv[2])
    else:
        unit(sys.argv[1])
