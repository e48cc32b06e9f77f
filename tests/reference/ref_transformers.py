"""Golden values for difftrain's diffusion transformers: diffusers' own DiTTransformer2DModel,
PixArtTransformer2DModel and SD3Transformer2DModel.

For a sweep of tiny random configurations (head counts and widths, patch sizes 1, 2 and 4, learned
sigma, attention with and without biases, every feed-forward activation diffusers' DiT accepts,
affine and plain norms, inputs at and away from the configured sample size) this saves each model
with save_pretrained (one case as the legacy `Transformer2DModel` folder the hub's DiT checkpoints
are), runs it on seeded inputs and writes the inputs, the output and the gradient of sum(out * w)
for every parameter. PixArt cases add a caption projection or raw text, a text mask (one row
partly, one fully masked), resolution and aspect-ratio conditions and an interpolation scale. SD3
cases add SD3.5's qk RMS norm and dual-attention blocks, position-table crops of non-square
inputs and a single (context-pre-only) block. CogVideoX cases cover the fixed 3-D table at and away
from the configured size, rotary embeddings as diffusers' pipeline computes them (given to the
model), the I2V model's learned table and CogVideoX 1.5's frame patches and ofs embedding. The
published DiT-XL/2, PixArt-α, SD3-medium, SD3.5-medium and CogVideoX (2B, 5B, 5B-I2V, 1.5-5B and
its I2V) configurations are instantiated on the meta device for their parameter names, shapes and
counts.

The model runs in eval mode: in training mode diffusers drops class labels at random inside the
model (LabelEmbedding's classifier-free-guidance dropout), which no two implementations can draw
alike; difftrain's test checks that dropout's rate on its own.
"""
import json
import pathlib

import torch
from types import SimpleNamespace

from diffusers import (CogVideoXTransformer3DModel, DiTTransformer2DModel, PixArtTransformer2DModel,
                       SD3Transformer2DModel)
from diffusers.pipelines.cogvideo.pipeline_cogvideox import CogVideoXPipeline
from diffusers.utils import logging as diffusers_logging
from safetensors.torch import save_file

diffusers_logging.set_verbosity_error()

# facebook/DiT-XL-2-256's transformer/config.json (a legacy Transformer2DModel folder), and -512.
DIT_XL_2_256 = {
    "_class_name": "Transformer2DModel", "activation_fn": "gelu-approximate", "attention_bias": True,
    "attention_head_dim": 72, "cross_attention_dim": None, "dropout": 0.0, "in_channels": 4,
    "norm_elementwise_affine": False, "norm_num_groups": 32, "norm_type": "ada_norm_zero",
    "num_attention_heads": 16, "num_embeds_ada_norm": 1000, "num_layers": 28,
    "num_vector_embeds": None, "only_cross_attention": False, "out_channels": 8, "patch_size": 2,
    "sample_size": 32, "upcast_attention": False, "use_linear_projection": False,
}
DIT_XL_2_512 = dict(DIT_XL_2_256, sample_size=64)
# PixArt-alpha/PixArt-XL-2-1024-MS's transformer/config.json (legacy class), and -512x512.
PIXART_XL_2_1024 = {
    "_class_name": "Transformer2DModel", "activation_fn": "gelu-approximate", "attention_bias": True,
    "attention_head_dim": 72, "caption_channels": 4096, "cross_attention_dim": 1152, "dropout": 0.0,
    "in_channels": 4, "norm_elementwise_affine": False, "norm_eps": 1e-06, "norm_num_groups": 32,
    "norm_type": "ada_norm_single", "num_attention_heads": 16, "num_embeds_ada_norm": 1000,
    "num_layers": 28, "num_vector_embeds": None, "only_cross_attention": False, "out_channels": 8,
    "patch_size": 2, "sample_size": 128, "upcast_attention": False, "use_linear_projection": False,
}
PIXART_XL_2_512 = dict(PIXART_XL_2_1024, sample_size=64)

# stabilityai/stable-diffusion-3-medium-diffusers and -3.5-medium transformer/config.json.
SD3_MEDIUM = {
    "sample_size": 128, "patch_size": 2, "in_channels": 16, "num_layers": 24,
    "attention_head_dim": 64, "num_attention_heads": 24, "joint_attention_dim": 4096,
    "caption_projection_dim": 1536, "pooled_projection_dim": 2048, "out_channels": 16,
    "pos_embed_max_size": 192,
}
SD35_MEDIUM = dict(SD3_MEDIUM, pos_embed_max_size=384, qk_norm="rms_norm",
                   dual_attention_layers=list(range(13)))

# (name, config, input (H, W), text length)
SD3_CASES = [
    ("sd3_tiny", dict(sample_size=8, patch_size=2, in_channels=4, num_layers=2,
                      attention_head_dim=8, num_attention_heads=2, joint_attention_dim=12,
                      caption_projection_dim=16, pooled_projection_dim=10, out_channels=4,
                      pos_embed_max_size=8), (8, 8), 5),
    # SD3.5's options: qk RMS norm, a dual-attention block, a crop of a non-square input.
    ("sd35_qk_norm_dual", dict(sample_size=6, patch_size=2, in_channels=4, num_layers=3,
                               attention_head_dim=4, num_attention_heads=3, joint_attention_dim=6,
                               caption_projection_dim=12, pooled_projection_dim=5, out_channels=8,
                               pos_embed_max_size=10, qk_norm="rms_norm",
                               dual_attention_layers=[0, 2]), (10, 6), 4),
    # Patch 1, one head, one block (context-pre-only), out_channels null.
    ("sd3_single_block", dict(sample_size=4, patch_size=1, in_channels=3, num_layers=1,
                              attention_head_dim=8, num_attention_heads=1, joint_attention_dim=8,
                              caption_projection_dim=8, pooled_projection_dim=4, out_channels=None,
                              pos_embed_max_size=6), (6, 4), 3),
]

# (name, config, input size, text length, text width, legacy folder)
PIXART_CASES = [
    ("pixart_caption_projection", dict(num_attention_heads=2, attention_head_dim=8, in_channels=4,
                                       out_channels=8, num_layers=2, sample_size=8, patch_size=2,
                                       cross_attention_dim=16, caption_channels=12), 8, 5, 12, False),
    # Resolution and aspect-ratio conditions (width 24: thirds), raw text of width 10, an
    # interpolation scale, exact GELU, no attention biases, affine norms, larger inputs, legacy.
    ("pixart_conditions_legacy", dict(num_attention_heads=2, attention_head_dim=12, in_channels=4,
                                      out_channels=4, num_layers=2, sample_size=8, patch_size=2,
                                      cross_attention_dim=10, use_additional_conditions=True,
                                      interpolation_scale=2, activation_fn="gelu",
                                      attention_bias=False, norm_elementwise_affine=True),
     12, 4, 10, True),
    # Patch 1, three heads of 4, gated GELU, a caption projection from width 7.
    ("pixart_patch1_geglu", dict(num_attention_heads=3, attention_head_dim=4, in_channels=2,
                                 out_channels=None, num_layers=1, sample_size=6, patch_size=1,
                                 cross_attention_dim=12, caption_channels=7, activation_fn="geglu"),
     6, 3, 7, False),
]

# THUDM/CogVideoX-2b and -5b transformer/config.json, and the I2V and 1.5 variants (diffusers'
# conversion script's settings).
COGVIDEOX_2B = {
    "activation_fn": "gelu-approximate", "attention_bias": True, "attention_head_dim": 64,
    "dropout": 0.0, "flip_sin_to_cos": True, "freq_shift": 0, "in_channels": 16,
    "max_text_seq_length": 226, "norm_elementwise_affine": True, "norm_eps": 1e-05,
    "num_attention_heads": 30, "num_layers": 30, "out_channels": 16, "patch_size": 2,
    "sample_frames": 49, "sample_height": 60, "sample_width": 90,
    "spatial_interpolation_scale": 1.875, "temporal_compression_ratio": 4,
    "temporal_interpolation_scale": 1.0, "text_embed_dim": 4096, "time_embed_dim": 512,
    "timestep_activation_fn": "silu", "use_rotary_positional_embeddings": False,
}
COGVIDEOX_5B = dict(COGVIDEOX_2B, num_attention_heads=48, num_layers=42,
                    use_rotary_positional_embeddings=True)
COGVIDEOX_5B_I2V = dict(COGVIDEOX_5B, in_channels=32, use_learned_positional_embeddings=True)
COGVIDEOX15_5B = dict(COGVIDEOX_5B, patch_size_t=2, patch_bias=False, sample_height=300,
                      sample_width=300, sample_frames=81)
COGVIDEOX15_5B_I2V = dict(COGVIDEOX15_5B, in_channels=32, ofs_embed_dim=512)

# (name, config, latent input (F, H, W), text length, ofs)
COGVIDEOX_CASES = [
    # CogVideoX-2B's kind: the fixed 3-D sine-cosine table, at the configured size.
    ("cogvideox_sincos", dict(num_attention_heads=2, attention_head_dim=16, in_channels=4,
                              out_channels=4, time_embed_dim=12, text_embed_dim=10, num_layers=2,
                              sample_width=8, sample_height=6, sample_frames=9, patch_size=2,
                              max_text_seq_length=5), (3, 6, 8), 5, None),
    # The table recomputed for another size; exact GELU, no attention biases, plain norms, shifted
    # and unflipped timestep features, other interpolation scales.
    ("cogvideox_sincos_resized", dict(num_attention_heads=1, attention_head_dim=32, in_channels=3,
                                      out_channels=5, time_embed_dim=8, text_embed_dim=6,
                                      num_layers=1, sample_width=6, sample_height=6,
                                      sample_frames=5, patch_size=1, max_text_seq_length=3,
                                      activation_fn="gelu", attention_bias=False,
                                      norm_elementwise_affine=False, flip_sin_to_cos=False,
                                      freq_shift=1, spatial_interpolation_scale=1.5,
                                      temporal_interpolation_scale=2.0), (4, 3, 5), 3, None),
    # CogVideoX-5B's kind: rotary embeddings over a grid cropped from the base grid (3x5 of 4x5),
    # text of any length, gated GELU.
    ("cogvideox_rotary", dict(num_attention_heads=3, attention_head_dim=16, in_channels=4,
                              out_channels=4, time_embed_dim=12, text_embed_dim=6, num_layers=2,
                              sample_width=10, sample_height=8, sample_frames=13, patch_size=2,
                              max_text_seq_length=7, use_rotary_positional_embeddings=True,
                              activation_fn="geglu"), (3, 6, 10), 4, None),
    # CogVideoX-5B-I2V's kind: rotary embeddings and the learned (saved) table.
    ("cogvideox_rotary_learned", dict(num_attention_heads=2, attention_head_dim=16, in_channels=6,
                                      out_channels=3, time_embed_dim=10, text_embed_dim=5,
                                      num_layers=2, sample_width=4, sample_height=4,
                                      sample_frames=5, patch_size=2, max_text_seq_length=4,
                                      use_rotary_positional_embeddings=True,
                                      use_learned_positional_embeddings=True), (2, 4, 4), 4, None),
    # CogVideoX 1.5 I2V's kind: patches across frame pairs (a linear patch embedding without the
    # convolution's bias), sliced rotary positions, the ofs embedding.
    ("cogvideox15_ofs", dict(num_attention_heads=2, attention_head_dim=16, in_channels=3,
                             out_channels=6, time_embed_dim=16, ofs_embed_dim=16, text_embed_dim=7,
                             num_layers=1, sample_width=8, sample_height=6, sample_frames=9,
                             patch_size=2, patch_size_t=2, patch_bias=False,
                             use_rotary_positional_embeddings=True), (4, 4, 6), 3, 2.0),
]

# (name, config, input size, save as the legacy Transformer2DModel class)
DIT_CASES = [
    ("dit_tiny", dict(num_attention_heads=2, attention_head_dim=8, in_channels=4, num_layers=2,
                      sample_size=8, patch_size=2, num_embeds_ada_norm=10), 8, False),
    # Learned sigma (out = 2 · in), no attention biases, exact GELU, an input larger than the
    # configured sample size (the position table is recomputed, as diffusers does), legacy folder.
    ("dit_learned_sigma_legacy", dict(num_attention_heads=3, attention_head_dim=4, in_channels=4,
                                      out_channels=8, num_layers=3, sample_size=6, patch_size=2,
                                      attention_bias=False, activation_fn="gelu",
                                      num_embeds_ada_norm=7, norm_eps=1e-6), 10, True),
    # Patch 4 on 3 channels, one head of 12, "geglu-approximate" (diffusers' ApproximateGELU,
    # x·σ(1.702·x), not gated), affine norm3, upcast attention.
    ("dit_patch4_quick_gelu", dict(num_attention_heads=1, attention_head_dim=12, in_channels=3,
                                   out_channels=6, num_layers=1, sample_size=16, patch_size=4,
                                   activation_fn="geglu-approximate", num_embeds_ada_norm=5,
                                   norm_elementwise_affine=True, upcast_attention=True), 16, False),
    # Patch 1 (every latent pixel a token), five heads of 4, exact GEGLU, an odd input size.
    ("dit_patch1_geglu", dict(num_attention_heads=5, attention_head_dim=4, in_channels=2,
                              num_layers=2, sample_size=5, patch_size=1, activation_fn="geglu",
                              num_embeds_ada_norm=3), 5, False),
]


def randomise(model):
    """adaLN-Zero starts every gate and the output at zero; move all weights off their init."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)


def save_legacy(model, folder, dit=True):
    """Rewrites the saved config as the hub's DiT and PixArt folders have it (Transformer2DModel)."""
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    cfg["_class_name"] = "Transformer2DModel"
    cfg.update(num_vector_embeds=None, only_cross_attention=False, use_linear_projection=False)
    if dit:
        cfg["cross_attention_dim"] = None
    path.write_text(json.dumps(cfg, indent=2))


def generate(out):
    root = out / "transformers"
    root.mkdir(parents=True, exist_ok=True)
    # CogVideoX 1.0's fixed position table as diffusers computes it (float64: float32 positions,
    # float64 frequencies), for two grids and interpolation scales.
    from diffusers.models.embeddings import get_3d_sincos_pos_embed
    tables = {}
    for dim, frames, h, w, ss, ts in ((64, 4, 3, 5, 1.875, 1.0), (96, 13, 6, 9, 1.0, 2.0)):
        t = get_3d_sincos_pos_embed(dim, (w, h), frames, ss, ts, output_type="pt")
        tables[f"table_{dim}_{frames}_{h}_{w}_{ss}_{ts}"] = t.flatten(0, 1).contiguous()
    assert all(t.dtype == torch.float64 for t in tables.values())
    save_file(tables, root / "cogvideox_sincos_tables.safetensors")
    index = {"dit": []}
    for name, config, size, legacy in DIT_CASES:
        torch.manual_seed(0)
        model = DiTTransformer2DModel(**config)
        randomise(model)
        model.save_pretrained(root / name)
        if legacy:
            save_legacy(model, root / name)
        # Read back through diffusers' own loader (the legacy class name is remapped there).
        model = DiTTransformer2DModel.from_pretrained(root / name).eval()
        g = torch.Generator().manual_seed(1)
        b = 2
        cfg = model.config
        inputs = {
            "sample": torch.randn(b, cfg.in_channels, size, size, generator=g),
            "timestep": torch.tensor([3, 871]),
            # The last label is the null class (index num_embeds_ada_norm) classifier-free
            # guidance samples with.
            "class_labels": torch.tensor([1, cfg.num_embeds_ada_norm]),
        }
        y = model(inputs["sample"], timestep=inputs["timestep"],
                  class_labels=inputs["class_labels"]).sample
        w = torch.randn(y.shape, generator=g)
        (y * w).sum().backward()
        tensors = {f"input.{k}": v for k, v in inputs.items()}
        tensors.update({"output": y.detach(), "weight": w})
        tensors.update({f"grad.{n}": p.grad.clone() for n, p in model.named_parameters()})
        save_file({k: v.contiguous() for k, v in tensors.items()}, root / f"{name}.io.safetensors")
        index["dit"].append({"name": name, "legacy": legacy,
                             "parameters": sum(p.numel() for p in model.parameters())})

    index["pixart"] = []
    for name, config, size, length, width, legacy in PIXART_CASES:
        torch.manual_seed(0)
        model = PixArtTransformer2DModel(**config)
        randomise(model)
        model.save_pretrained(root / name)
        if legacy:
            save_legacy(model, root / name, dit=False)
        model = PixArtTransformer2DModel.from_pretrained(root / name).train()
        g = torch.Generator().manual_seed(2)
        b = 2
        cfg = model.config
        mask = torch.ones(b, length)
        mask[0, 1::2] = 0
        mask[1] = 0
        inputs = {"sample": torch.randn(b, cfg.in_channels, size, size, generator=g),
                  "timestep": torch.tensor([7, 640]),
                  "encoder_hidden_states": torch.randn(b, length, width, generator=g),
                  "encoder_attention_mask": mask}
        added = None
        if model.use_additional_conditions:
            inputs["resolution"] = torch.tensor([[96.0, 64.0], [80.0, 80.0]])
            inputs["aspect_ratio"] = torch.tensor([[1.5], [1.0]])
            added = {"resolution": inputs["resolution"], "aspect_ratio": inputs["aspect_ratio"]}
        y = model(inputs["sample"], encoder_hidden_states=inputs["encoder_hidden_states"],
                  timestep=inputs["timestep"], added_cond_kwargs=added,
                  encoder_attention_mask=mask).sample
        w = torch.randn(y.shape, generator=g)
        (y * w).sum().backward()
        tensors = {f"input.{k}": v for k, v in inputs.items()}
        tensors.update({"output": y.detach(), "weight": w})
        tensors.update({f"grad.{n}": p.grad.clone() for n, p in model.named_parameters()})
        save_file({k: v.contiguous() for k, v in tensors.items()}, root / f"{name}.io.safetensors")
        index["pixart"].append({"name": name, "legacy": legacy,
                                "parameters": sum(p.numel() for p in model.parameters())})

    index["sd3"] = []
    for name, config, (h, w), length in SD3_CASES:
        torch.manual_seed(0)
        model = SD3Transformer2DModel(**config)
        randomise(model)
        model.save_pretrained(root / name)
        model = SD3Transformer2DModel.from_pretrained(root / name).train()
        g = torch.Generator().manual_seed(3)
        b = 2
        cfg = model.config
        inputs = {"sample": torch.randn(b, cfg.in_channels, h, w, generator=g),
                  "timestep": torch.tensor([12.5, 980.0]),
                  "encoder_hidden_states": torch.randn(b, length, cfg.joint_attention_dim, generator=g),
                  "pooled_projections": torch.randn(b, cfg.pooled_projection_dim, generator=g)}
        y = model(inputs["sample"], encoder_hidden_states=inputs["encoder_hidden_states"],
                  pooled_projections=inputs["pooled_projections"],
                  timestep=inputs["timestep"]).sample
        wgt = torch.randn(y.shape, generator=g)
        (y * wgt).sum().backward()
        tensors = {f"input.{k}": v for k, v in inputs.items()}
        tensors.update({"output": y.detach(), "weight": wgt})
        tensors.update({f"grad.{n}": p.grad.clone() for n, p in model.named_parameters()})
        save_file({k: v.contiguous() for k, v in tensors.items()}, root / f"{name}.io.safetensors")
        index["sd3"].append({"name": name,
                             "parameters": sum(p.numel() for p in model.parameters())})

    index["cogvideox"] = []
    for name, config, (f, h, w), length, ofs in COGVIDEOX_CASES:
        torch.manual_seed(0)
        model = CogVideoXTransformer3DModel(**config)
        randomise(model)
        if model.config.use_learned_positional_embeddings:
            with torch.no_grad():  # the learned table is saved: move it off its sine-cosine init
                model.patch_embed.pos_embedding.add_(
                    torch.randn_like(model.patch_embed.pos_embedding) * 0.1)
        model.save_pretrained(root / name)
        model = CogVideoXTransformer3DModel.from_pretrained(root / name).train()
        g = torch.Generator().manual_seed(4)
        b = 2
        cfg = model.config
        inputs = {"hidden_states": torch.randn(b, f, cfg.in_channels, h, w, generator=g),
                  "timestep": torch.tensor([17, 903]),
                  "encoder_hidden_states": torch.randn(b, length, cfg.text_embed_dim, generator=g)}
        rotary = None
        if cfg.use_rotary_positional_embeddings:
            # What diffusers' pipeline passes (vae_scale_factor_spatial 8: its pixel size).
            pipe = SimpleNamespace(vae_scale_factor_spatial=8, transformer=model)
            rotary = CogVideoXPipeline._prepare_rotary_positional_embeddings(
                pipe, h * 8, w * 8, f, torch.device("cpu"))
            inputs["rotary_cos"], inputs["rotary_sin"] = rotary
        if ofs is not None:
            inputs["ofs"] = torch.full((1,), ofs)
        y = model(inputs["hidden_states"], encoder_hidden_states=inputs["encoder_hidden_states"],
                  timestep=inputs["timestep"], ofs=inputs.get("ofs"),
                  image_rotary_emb=rotary).sample
        wgt = torch.randn(y.shape, generator=g)
        (y * wgt).sum().backward()
        tensors = {f"input.{k}": v for k, v in inputs.items()}
        tensors.update({"output": y.detach(), "weight": wgt})
        tensors.update({f"grad.{n}": p.grad.clone() for n, p in model.named_parameters()})
        save_file({k: v.contiguous() for k, v in tensors.items()}, root / f"{name}.io.safetensors")
        index["cogvideox"].append({"name": name,
                                   "parameters": sum(p.numel() for p in model.parameters())})

    full = {}
    with torch.device("meta"):
        for key, cfg in (("dit_xl_2_256", DIT_XL_2_256), ("dit_xl_2_512", DIT_XL_2_512)):
            args = {k: v for k, v in cfg.items()
                    if not k.startswith("_") and k not in ("cross_attention_dim", "num_vector_embeds",
                                                           "only_cross_attention",
                                                           "use_linear_projection")}
            model = DiTTransformer2DModel(**args)
            full[key] = {"config": cfg,
                         "shapes": {n: list(p.shape) for n, p in model.state_dict().items()},
                         "parameters": sum(p.numel() for p in model.parameters())}
        for key, cfg in (("pixart_xl_2_1024", PIXART_XL_2_1024), ("pixart_xl_2_512", PIXART_XL_2_512)):
            args = {k: v for k, v in cfg.items()
                    if not k.startswith("_") and k not in ("num_vector_embeds", "only_cross_attention",
                                                           "use_linear_projection")}
            model = PixArtTransformer2DModel(**args)
            full[key] = {"config": cfg,
                         "shapes": {n: list(p.shape) for n, p in model.state_dict().items()},
                         "parameters": sum(p.numel() for p in model.parameters())}
        # SD3's full models hold two billion parameters: the test builds their first two blocks
        # (and the last, context-pre-only one) and compares every name and shape; the full counts
        # are diffusers'.
        for key, cfg in (("sd3_medium", SD3_MEDIUM), ("sd35_medium", SD35_MEDIUM)):
            full_count = sum(p.numel() for p in SD3Transformer2DModel(**cfg).parameters())
            small = dict(cfg, num_layers=3)
            if "dual_attention_layers" in small:
                small["dual_attention_layers"] = [0, 1]
            model = SD3Transformer2DModel(**small)
            full[key] = {"config": small, "full_parameters": full_count,
                         "shapes": {n: list(p.shape) for n, p in model.state_dict().items()},
                         "parameters": sum(p.numel() for p in model.parameters())}
        # CogVideoX's: the first block of each, the full counts diffusers'.
        for key, cfg in (("cogvideox_2b", COGVIDEOX_2B), ("cogvideox_5b", COGVIDEOX_5B),
                         ("cogvideox_5b_i2v", COGVIDEOX_5B_I2V), ("cogvideox15_5b", COGVIDEOX15_5B),
                         ("cogvideox15_5b_i2v", COGVIDEOX15_5B_I2V)):
            full_count = sum(p.numel() for p in CogVideoXTransformer3DModel(**cfg).parameters())
            small = dict(cfg, num_layers=1)
            model = CogVideoXTransformer3DModel(**small)
            full[key] = {"config": small, "full_parameters": full_count,
                         "shapes": {n: list(p.shape) for n, p in model.state_dict().items()},
                         "parameters": sum(p.numel() for p in model.parameters())}
    index["full_size"] = full
    (out / "transformers.json").write_text(json.dumps(index))


if __name__ == "__main__":
    import sys
    generate(pathlib.Path(sys.argv[1]))
