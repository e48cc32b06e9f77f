"""Text-encoder folders written by difftrain (CLIPTextModel, CLIPTextModelWithProjection as an fp16
variant, T5EncoderModel) load in transformers' from_pretrained with no missing or unexpected
weights and give the outputs difftrain computed. Usage: check_cpp_text_encoders.py TEST_BINARY GOLDEN_DIR"""
import os
import pathlib
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file
from transformers import CLIPTextModel, CLIPTextModelWithProjection, T5EncoderModel
from transformers.utils import logging


def main(binary, golden_dir):
    logging.set_verbosity_error()
    out = pathlib.Path(tempfile.mkdtemp())
    env = dict(os.environ, DIFFTRAIN_TEXT_OUT=str(out), DIFFTRAIN_GOLDEN_DIR=golden_dir)
    subprocess.run([binary, "--gtest_filter=ClipTextModel.SavedFoldersRoundTrip:"
                    "TextEncoderLora.TrainsAndItsFilesLoadBack:T5Encoder.SavedFoldersRoundTrip"],
                   check=True, env=env)
    t = load_file(out / "outputs.safetensors")
    for name, cls, variant, key in (("tiny_quick_gelu", CLIPTextModel, None, "pooler_output"),
                                    ("tiny_gelu_projection", CLIPTextModelWithProjection, "fp16",
                                     "text_embeds")):
        model, info = cls.from_pretrained(out / name, variant=variant, output_loading_info=True,
                                          dtype=torch.float32)
        bad = {k: v for k, v in info.items() if v}
        assert not bad, (name, bad)
        with torch.no_grad():
            o = model.eval()(t[name + ".input_ids"])
        for what, got in (("last_hidden_state", o.last_hidden_state), (key, getattr(o, key))):
            want = t[f"{name}.{what}"]
            err = (got - want).abs().max().item() / max(1.0, want.abs().max().item())
            assert err < 1e-5, (name, what, err)
            print(f"{name} {what}: transformers on difftrain's folder, max scaled error {err:.2e}")

    model, info = T5EncoderModel.from_pretrained(out / "t5", output_loading_info=True,
                                                 dtype=torch.float32)
    bad = {k: v for k, v in info.items() if v}
    assert not bad, ("t5", bad)
    t5 = load_file(out / "t5" / "outputs.safetensors")
    with torch.no_grad():
        got = model.eval()(t5["input_ids"]).last_hidden_state
    err = (got - t5["last_hidden_state"]).abs().max().item()
    assert err < 1e-5, ("t5", err)
    print(f"t5 last_hidden_state: transformers on difftrain's folder, max error {err:.2e}")
    check_lora(out, pathlib.Path(golden_dir))


def check_lora(out, golden):
    """difftrain's text-encoder LoRA files, PEFT and kohya, read by diffusers' lora_state_dict and
    merged into transformers' encoder with PEFT's formula, give difftrain's output."""
    from diffusers.loaders.lora_pipeline import StableDiffusionLoraLoaderMixin as Loader
    want = load_file(out / "te_lora_output.safetensors")
    for layout in ("peft", "kohya"):
        state_dict, alphas = Loader.lora_state_dict(load_file(out / f"te_lora_{layout}.safetensors"))
        te = CLIPTextModel.from_pretrained(golden / "encode_prompt" / "text_encoder").eval()
        weights = {"text_model." + k if not k.startswith("text_model.") else k: v.clone()
                   for k, v in te.state_dict().items()}
        pairs = {}
        proc = {"to_q_lora": "q_proj", "to_k_lora": "k_proj", "to_v_lora": "v_proj",
                "to_out_lora": "out_proj"}
        for key, value in state_dict.items():
            assert key.startswith("text_encoder."), key
            name = key[len("text_encoder."):]
            # PEFT names (lora_A / lora_B), or the converted kohya names diffusers returns:
            # lora_linear_layer.down / .up for the MLP, <attn>.to_q_lora.down / .up for attention.
            module = side = None
            for marker, s_ in ((".lora_A.", "A"), (".lora_B.", "B"),
                               (".lora_linear_layer.down.", "A"), (".lora_linear_layer.up.", "B")):
                if marker in name:
                    module, side = name.split(marker)[0], s_
            for p_name, proj in proc.items():
                for part, s_ in ((".down.", "A"), (".up.", "B")):
                    marker = "." + p_name + part
                    if marker in name:
                        module, side = name.split(marker)[0] + "." + proj, s_
            assert module is not None, key
            entry = pairs.setdefault(module, {})
            entry[side] = value
            alpha_key = key.replace(".up.", ".down.").replace(".lora_B.", ".lora_A.") + ".alpha"
            if alphas and alpha_key in alphas:
                entry["alpha"] = float(alphas[alpha_key])
        assert pairs, list(state_dict)[:4]
        for module, p in pairs.items():
            alpha = p.get("alpha", 8.0)  # PEFT keeps alpha in its adapter config: 8 here
            w = weights[module + ".weight"]
            weights[module + ".weight"] = w + (alpha / p["A"].shape[0]) * p["B"] @ p["A"]
        te.load_state_dict({k[len("text_model."):] if k not in te.state_dict() else k: v
                            for k, v in weights.items()})
        with torch.no_grad():
            y = te(want["input_ids"]).last_hidden_state
        err = (y - want["output"]).abs().max().item() / max(1.0, want["output"].abs().max().item())
        assert err < 1e-5, (layout, err)
        print(f"text-encoder LoRA ({layout}, {len(pairs)} layers) read by diffusers' "
              f"lora_state_dict: max scaled error {err:.2e}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
