"""Golden files for difftrain's reader of CogVideoX SAT checkpoints.

For tiny diffusers CogVideoX transformers of every kind the transformer sweep has (2B's fixed
sine-cosine table, 5B's rotary embeddings, I2V's learned table, 1.5's frame-pair patches with the
ofs embedding) and a 4-level CogVideoX VAE, this writes the checkpoints the SAT training code
writes: `mp_rank_00_model_states.pt` as DeepSpeed saves it (the weights under "module" in SAT's
names, beside an argparse.Namespace of the run's arguments, numpy's and Python's random states, a
set, torch.Size shapes and counters) and `3d-vae.pt` (a "state_dict" with the training loss's
tensors beside the model's). Two transformer files come from SAT's LoRA fine-tuning
(sat.model.finetune.lora2): each attention's query_key_value and dense as `original` weights with
matrix_A / matrix_B per partition, one with LoraMixin's default alpha (1) and one with alpha 8.

SAT's names are made from diffusers' by inverting convert_cogvideox_to_diffusers.py's tables; the
script's own conversion (its rename tables and handlers, as in diffusers' scripts/ at v0.42.1) is
then run on every file here and must give back, under a strict load, exactly the model's tensors
(for the LoRA files: SAT's merge_linear_lora of them). The models themselves are saved with
save_pretrained: difftrain reads the .pt files and compares with them.
"""
import argparse
import collections
import json
import pathlib
import random

import numpy as np
import torch
from diffusers import AutoencoderKLCogVideoX, CogVideoXTransformer3DModel
from diffusers.utils import logging as diffusers_logging

import ref_cogvideox_vae
import ref_transformers

diffusers_logging.set_verbosity_error()

PREFIX = "model.diffusion_model."

# convert_cogvideox_to_diffusers.py's TRANSFORMER_KEYS_RENAME_DICT and VAE_KEYS_RENAME_DICT.
TRANSFORMER_RENAMES = {
    "transformer.final_layernorm": "norm_final", "transformer": "transformer_blocks",
    "attention": "attn1", "mlp": "ff.net", "dense_h_to_4h": "0.proj", "dense_4h_to_h": "2",
    ".layers": "", "dense": "to_out.0", "input_layernorm": "norm1.norm",
    "post_attn1_layernorm": "norm2.norm", "time_embed.0": "time_embedding.linear_1",
    "time_embed.2": "time_embedding.linear_2", "ofs_embed.0": "ofs_embedding.linear_1",
    "ofs_embed.2": "ofs_embedding.linear_2", "mixins.patch_embed": "patch_embed",
    "mixins.final_layer.norm_final": "norm_out.norm", "mixins.final_layer.linear": "proj_out",
    "mixins.final_layer.adaLN_modulation.1": "norm_out.linear",
    "mixins.pos_embed.pos_embedding": "patch_embed.pos_embedding",
}
VAE_RENAMES = {
    "block.": "resnets.", "down.": "down_blocks.", "downsample": "downsamplers.0",
    "upsample": "upsamplers.0", "nin_shortcut": "conv_shortcut",
    "encoder.mid.block_1": "encoder.mid_block.resnets.0",
    "encoder.mid.block_2": "encoder.mid_block.resnets.1",
    "decoder.mid.block_1": "decoder.mid_block.resnets.0",
    "decoder.mid.block_2": "decoder.mid_block.resnets.1",
}


def diffusers_convert_transformer(sd):
    """convert_transformer's renaming and special handlers, on a state dict."""
    sd = {k[len(PREFIX):]: v for k, v in sd.items()}
    renamed = {}
    for key, value in sd.items():
        new = key
        for a, b in TRANSFORMER_RENAMES.items():
            new = new.replace(a, b)
        renamed[new] = value
    sd = renamed
    for key in list(sd.keys()):
        if "query_key_value" in key:
            q, k, v = torch.chunk(sd.pop(key), 3, dim=0)
            sd[key.replace("query_key_value", "to_q")] = q
            sd[key.replace("query_key_value", "to_k")] = k
            sd[key.replace("query_key_value", "to_v")] = v
        elif "query_layernorm_list" in key or "key_layernorm_list" in key:
            layer, wb = key.split(".")[-2:]
            which = "norm_q" if "query" in key else "norm_k"
            sd[f"transformer_blocks.{layer}.attn1.{which}.{wb}"] = sd.pop(key)
        elif "adaln_layer.adaLN_modulations" in key:
            layer, _, wb = key.split(".")[-3:]
            c = sd.pop(key).chunk(12, dim=0)
            sd[f"transformer_blocks.{layer}.norm1.linear.{wb}"] = torch.cat(c[0:3] + c[6:9])
            sd[f"transformer_blocks.{layer}.norm2.linear.{wb}"] = torch.cat(c[3:6] + c[9:12])
        elif any(s in key for s in ("embed_tokens", "freqs_sin", "freqs_cos", "position_embedding")):
            sd.pop(key)
    return sd


def diffusers_convert_vae(sd):
    """convert_vae's renaming and handlers (its up blocks renumbered as 4 - 1 - i)."""
    out = {}
    for key, value in sd.items():
        new = key
        for a, b in VAE_RENAMES.items():
            new = new.replace(a, b)
        out[new] = value
    for key in list(out.keys()):
        if "loss" in key:
            out.pop(key)
        elif "up." in key:
            parts = key.split(".")
            parts[1], parts[2] = "up_blocks", str(4 - 1 - int(parts[2]))
            out[".".join(parts)] = out.pop(key)
    return out


def to_sat_transformer(model, cfg):
    """The model's tensors in SAT's names (the inverse of the tables above)."""
    sd = {k: v.clone() for k, v in model.state_dict().items()}  # not views of the model's
    out = {}
    blocks = cfg["num_layers"]
    for i in range(blocks):
        p, s = f"transformer_blocks.{i}.", f"transformer.layers.{i}."
        out[s + "input_layernorm.weight"] = sd.pop(p + "norm1.norm.weight", None)
        out[s + "input_layernorm.bias"] = sd.pop(p + "norm1.norm.bias", None)
        out[s + "post_attention_layernorm.weight"] = sd.pop(p + "norm2.norm.weight", None)
        out[s + "post_attention_layernorm.bias"] = sd.pop(p + "norm2.norm.bias", None)
        for wb in ("weight", "bias"):
            q = sd.pop(p + f"attn1.to_q.{wb}", None)
            if q is not None:
                out[s + f"attention.query_key_value.{wb}"] = torch.cat(
                    [q, sd.pop(p + f"attn1.to_k.{wb}"), sd.pop(p + f"attn1.to_v.{wb}")])
            out[s + f"attention.dense.{wb}"] = sd.pop(p + f"attn1.to_out.0.{wb}", None)
            out[s + f"mlp.dense_h_to_4h.{wb}"] = sd.pop(p + f"ff.net.0.proj.{wb}")
            out[s + f"mlp.dense_4h_to_h.{wb}"] = sd.pop(p + f"ff.net.2.{wb}")
            n1 = sd.pop(p + f"norm1.linear.{wb}").chunk(6)
            n2 = sd.pop(p + f"norm2.linear.{wb}").chunk(6)
            out[f"mixins.adaln_layer.adaLN_modulations.{i}.1.{wb}"] = torch.cat(
                n1[0:3] + n2[0:3] + n1[3:6] + n2[3:6])
            for which, sat in (("norm_q", "query"), ("norm_k", "key")):
                t = sd.pop(p + f"attn1.{which}.{wb}", None)
                if t is not None:
                    out[f"mixins.adaln_layer.{sat}_layernorm_list.{i}.{wb}"] = t
    simple = {"norm_final": "transformer.final_layernorm",
              "time_embedding.linear_1": "time_embed.0", "time_embedding.linear_2": "time_embed.2",
              "ofs_embedding.linear_1": "ofs_embed.0", "ofs_embedding.linear_2": "ofs_embed.2",
              "patch_embed.proj": "mixins.patch_embed.proj",
              "patch_embed.text_proj": "mixins.patch_embed.text_proj",
              "norm_out.norm": "mixins.final_layer.norm_final",
              "proj_out": "mixins.final_layer.linear",
              "norm_out.linear": "mixins.final_layer.adaLN_modulation.1"}
    for key in list(sd.keys()):
        if key == "patch_embed.pos_embedding":
            out["mixins.pos_embed.pos_embedding"] = sd.pop(key)
            continue
        stem, wb = key.rsplit(".", 1)
        out[simple[stem] + "." + wb] = sd.pop(key)
    out = {PREFIX + k: v for k, v in out.items() if v is not None}
    # What SAT keeps beside them: 2B's fixed table, the rotary tables.
    if not cfg.get("use_learned_positional_embeddings") and not cfg.get(
            "use_rotary_positional_embeddings"):
        out[PREFIX + "mixins.pos_embed.pos_embedding"] = torch.randn(1, 7, model.config.num_attention_heads * model.config.attention_head_dim)
    if cfg.get("use_rotary_positional_embeddings"):
        out[PREFIX + "mixins.pos_embed.freqs_sin"] = torch.randn(10, 8)
        out[PREFIX + "mixins.pos_embed.freqs_cos"] = torch.randn(10, 8)
    return out


def to_sat_vae(vae):
    """The VAE's tensors in SAT's names (the decoder's up blocks numbered from the top), with the
    training loss's tensors beside them as 3d-vae.pt holds them."""
    levels = len(vae.config.up_block_types)
    sat = {}
    for key, value in vae.state_dict().items():
        new = key
        for a, b in (("encoder.mid_block.resnets.0", "encoder.mid.block_1"),
                     ("encoder.mid_block.resnets.1", "encoder.mid.block_2"),
                     ("decoder.mid_block.resnets.0", "decoder.mid.block_1"),
                     ("decoder.mid_block.resnets.1", "decoder.mid.block_2"),
                     ("resnets.", "block."), ("down_blocks.", "down."),
                     ("downsamplers.0", "downsample"), ("upsamplers.0", "upsample"),
                     ("conv_shortcut", "nin_shortcut")):
            new = new.replace(a, b)
        if new.startswith("decoder.up_blocks."):
            parts = new.split(".")
            parts[1], parts[2] = "up", str(levels - 1 - int(parts[2]))
            new = ".".join(parts)
        sat[new] = value.clone()
    sat["loss.logvar"] = torch.zeros(())
    sat["loss.perceptual_loss.net.slice1.0.weight"] = torch.randn(4, 3, 3, 3)
    return sat


def with_sat_lora(sat, rank, g):
    """SAT's LoRA layers (lora2.LoraLinear): `original` weights and matrix_A / matrix_B."""
    out = {}
    for key, value in sat.items():
        hit = next((n for n in ("attention.query_key_value", "attention.dense")
                    if key.endswith(n + ".weight") or key.endswith(n + ".bias")), None)
        if hit is None:
            out[key] = value
            continue
        layer, wb = key.rsplit(".", 1)
        out[f"{layer}.original.{wb}"] = value
        if wb == "weight":
            parts = 3 if hit.endswith("query_key_value") else 1
            rows, cols = value.shape
            for i in range(parts):
                out[f"{layer}.matrix_A.{i}"] = torch.randn(rank, cols, generator=g) * 0.3
                out[f"{layer}.matrix_B.{i}"] = torch.randn(rows // parts, rank, generator=g) * 0.3
    return out


def merged_sat_lora(sat, alpha):
    """SAT's merge_linear_lora of every LoRA layer: W + (A_i^T B_i^T · alpha / r, cat)^T."""
    out = dict(sat)
    for key in [k for k in sat if k.endswith(".original.weight")]:
        layer = key[:-len(".original.weight")]
        parts = [i for i in range(3) if f"{layer}.matrix_A.{i}" in sat]
        rank = sat[f"{layer}.matrix_A.0"].shape[0]
        scaling = alpha / rank
        new = torch.cat([sat[f"{layer}.matrix_A.{i}"].T.float() @ sat[f"{layer}.matrix_B.{i}"].T.float()
                         * scaling for i in parts], -1)
        out[f"{layer}.weight"] = sat[key] + new.T.to(sat[key].dtype)
        out[f"{layer}.bias"] = sat[f"{layer}.original.bias"]
        for k in [key, f"{layer}.original.bias"] + [f"{layer}.matrix_{m}.{i}" for m in "AB"
                                                    for i in parts]:
            out.pop(k)
    return out


def deepspeed_file(weights, path, iteration):
    """What DeepSpeed's save_checkpoint writes for SAT: the weights beside the run's objects."""
    np.random.seed(iteration)
    random.seed(iteration)
    torch.save({
        "module": weights,
        "buffer_names": [],
        "optimizer": None,
        "param_shapes": [collections.OrderedDict((k, v.shape) for k, v in weights.items())],
        "frozen_param_shapes": None,
        "shared_params": {},
        "lr_scheduler": None,
        "sparse_tensor_module_names": set(),
        "skipped_steps": 0,
        "global_steps": iteration,
        "global_samples": iteration * 8,
        "dp_world_size": 1,
        "mp_world_size": 1,
        "ds_config": {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}},
        "ds_version": "0.14.4",
        "iteration": iteration,
        "args": argparse.Namespace(lr=1e-3, mode="finetune", experiment_name="lora-disney",
                                   save_interval=1000, base=["configs/cogvideox_2b_lora.yaml"]),
        "np_rng_state": np.random.get_state(),
        "rng_state": random.getstate(),
        "torch_rng_state": torch.get_rng_state(),
    }, path)


def generate(out):
    root = out / "cogvideox_sat"
    root.mkdir(parents=True, exist_ok=True)
    index = {"transformers": [], "vaes": []}
    g = torch.Generator().manual_seed(11)
    cases = [(name, cfg, None) for name, cfg, *_ in ref_transformers.COGVIDEOX_CASES]
    cases += [("cogvideox_sincos_lora", ref_transformers.COGVIDEOX_CASES[0][1], 1.0),
              ("cogvideox_rotary_lora_alpha8", ref_transformers.COGVIDEOX_CASES[2][1], 8.0)]
    for name, cfg, alpha in cases:
        torch.manual_seed(1)
        model = CogVideoXTransformer3DModel(**cfg)
        ref_transformers.randomise(model)
        if model.config.use_learned_positional_embeddings:
            with torch.no_grad():
                model.patch_embed.pos_embedding.add_(
                    torch.randn_like(model.patch_embed.pos_embedding) * 0.1)
        sat = to_sat_transformer(model, cfg)
        if alpha is not None:
            sat = with_sat_lora(sat, 3, g)
            expected = diffusers_convert_transformer(merged_sat_lora(sat, alpha))
        else:
            expected = diffusers_convert_transformer(sat)
        if not cfg.get("use_learned_positional_embeddings"):
            expected.pop("patch_embed.pos_embedding", None)  # the fixed table is recomputed
        check = CogVideoXTransformer3DModel(**cfg)
        check.load_state_dict(expected, strict=True)
        if alpha is None:
            own = model.state_dict()
            assert all(torch.equal(own[k], v) for k, v in expected.items()), name
        else:
            model.load_state_dict(expected, strict=True)  # the merged model is the reference
        model.save_pretrained(root / name)
        deepspeed_file(sat, root / f"{name}.pt", 1000)
        index["transformers"].append({"name": name, "lora_alpha": alpha,
                                      "sat_tensors": len(sat)})

    # The VAE: 4 levels, as diffusers' script renumbers them.
    torch.manual_seed(2)
    vae_cfg = ref_cogvideox_vae.tiny(4, block_out_channels=[4, 8, 8, 8], layers_per_block=1,
                                     latent_channels=2, norm_num_groups=2,
                                     temporal_compression_ratio=4, sample_height=16,
                                     sample_width=16)
    vae = AutoencoderKLCogVideoX(**vae_cfg)
    ref_cogvideox_vae.randomise(vae)
    sat = to_sat_vae(vae)
    expected = diffusers_convert_vae(sat)
    AutoencoderKLCogVideoX(**vae_cfg).load_state_dict(expected, strict=True)
    own = vae.state_dict()
    assert all(torch.equal(own[k], v) for k, v in expected.items())
    vae.save_pretrained(root / "vae_4_levels")
    torch.save({"state_dict": sat, "epoch": 3, "global_step": 3000,
                "hyper_parameters": argparse.Namespace(lr=1e-4)}, root / "vae_4_levels.pt")
    index["vaes"].append({"name": "vae_4_levels", "sat_tensors": len(sat)})
    (root / "index.json").write_text(json.dumps(index, indent=1))


if __name__ == "__main__":
    import sys
    generate(pathlib.Path(sys.argv[1]))
