"""Golden values for difftrain's models: diffusers' own UNet2DConditionModel and AutoencoderKL.

For a sweep of small configurations (2-3 levels, linear and conv projections, several head counts,
class-conditional variants, scale-shift resnets, odd sizes, SDXL's added text/time conditions,
encoder attention masks, sharded, fp16-variant and torch.save (.bin) folders, a tiled and sliced
VAE) this saves each model with diffusers' save_pretrained, runs it on seeded inputs and writes the inputs,
the outputs and the gradient of sum(out * w) for every parameter, in float64-free float32 as the
C++ side computes. For the published Stable Diffusion 1.5 / 2.1 UNet and VAE configurations it
instantiates the models on the meta device and writes every parameter's name and shape.
"""
import json
import pathlib

import torch
from diffusers import AutoencoderKL, UNet2DConditionModel
from diffusers.utils import logging as diffusers_logging
from safetensors.torch import save_file

diffusers_logging.set_verbosity_error()  # no advice to install accelerate in the test log

SD15_UNET = {
    "act_fn": "silu", "attention_head_dim": 8, "block_out_channels": [320, 640, 1280, 1280],
    "center_input_sample": False, "cross_attention_dim": 768,
    "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D",
                         "DownBlock2D"],
    "downsample_padding": 1, "flip_sin_to_cos": True, "freq_shift": 0, "in_channels": 4,
    "layers_per_block": 2, "mid_block_scale_factor": 1, "norm_eps": 1e-05, "norm_num_groups": 32,
    "out_channels": 4, "sample_size": 64,
    "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D",
                       "CrossAttnUpBlock2D"],
}
SD21_UNET = dict(SD15_UNET, attention_head_dim=[5, 10, 20, 20], cross_attention_dim=1024,
                 use_linear_projection=True, sample_size=96, upcast_attention=True,
                 dual_cross_attention=False, num_class_embeds=None, only_cross_attention=False,
                 resnet_time_scale_shift="default", class_embed_type=None)
# stabilityai/stable-diffusion-xl-base-1.0's unet/config.json (the fields difftrain reads).
SDXL_UNET = dict(SD15_UNET, attention_head_dim=[5, 10, 20], block_out_channels=[320, 640, 1280],
                 cross_attention_dim=2048,
                 down_block_types=["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
                 up_block_types=["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
                 transformer_layers_per_block=[1, 2, 10], use_linear_projection=True,
                 addition_embed_type="text_time", addition_time_embed_dim=256,
                 projection_class_embeddings_input_dim=2816, sample_size=128)
SD_VAE = {
    "act_fn": "silu", "block_out_channels": [128, 256, 512, 512],
    "down_block_types": ["DownEncoderBlock2D"] * 4, "in_channels": 3, "latent_channels": 4,
    "layers_per_block": 2, "norm_num_groups": 32, "out_channels": 3, "sample_size": 512,
    "up_block_types": ["UpDecoderBlock2D"] * 4, "scaling_factor": 0.18215,
}

TINY = dict(block_out_channels=[32, 64], layers_per_block=1, cross_attention_dim=32,
            down_block_types=["CrossAttnDownBlock2D", "DownBlock2D"],
            up_block_types=["UpBlock2D", "CrossAttnUpBlock2D"], norm_num_groups=8, sample_size=8)

# (name, config, sample size (H, W), context length, save options, activation)
UNET_CASES = [
    ("unet_conv_proj", dict(TINY, attention_head_dim=[2, 4]), (8, 8), 5, {}),
    ("unet_linear_3_levels", dict(
        block_out_channels=[16, 32, 32], layers_per_block=[1, 2, 1], norm_num_groups=8,
        cross_attention_dim=24, attention_head_dim=[1, 2, 4], use_linear_projection=True,
        down_block_types=["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
        up_block_types=["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
        transformer_layers_per_block=[1, 2, 1], only_cross_attention=[True, False, False],
        resnet_time_scale_shift="scale_shift", num_class_embeds=10), (10, 12), 3,
     {"max_shard_size": "500KB"}),
    ("unet_timestep_classes", dict(
        TINY, attention_head_dim=4, class_embed_type="timestep", flip_sin_to_cos=False,
        freq_shift=1, mid_block_type="UNetMidBlock2D", time_embedding_act_fn="silu",
        class_embeddings_concat=True, conv_in_kernel=1, conv_out_kernel=5, encoder_hid_dim=20,
        mid_block_scale_factor=1.4, use_linear_projection=True, act_fn="mish",
        time_embedding_dim=48), (8, 8), 4, {"variant": "fp16"}),
    ("unet_projection_no_mid", dict(
        TINY, attention_head_dim=[4, 8], mid_block_type=None, class_embed_type="projection",
        projection_class_embeddings_input_dim=16, time_cond_proj_dim=8, timestep_post_act="silu",
        center_input_sample=True, layers_per_block=[1, 2], downsample_padding=0,
        cross_attention_dim=[32, 32]), (8, 8), 6, {}),
    # SDXL's layout in small: no attention at the top level, deeper transformers below, linear
    # projections, text_time added conditions; saved as sharded torch.save (.bin) files.
    ("unet_sdxl_text_time_bin", dict(
        block_out_channels=[32, 64], layers_per_block=2, norm_num_groups=8, cross_attention_dim=32,
        down_block_types=["DownBlock2D", "CrossAttnDownBlock2D"],
        up_block_types=["CrossAttnUpBlock2D", "UpBlock2D"], transformer_layers_per_block=[1, 2],
        attention_head_dim=[2, 4], use_linear_projection=True, addition_embed_type="text_time",
        addition_time_embed_dim=8, projection_class_embeddings_input_dim=16 + 6 * 8,
        sample_size=8), (8, 8), 5, {"bin": True, "max_shard_size": "3MB"}),
]
# Cases whose calls also carry an encoder attention mask (one row partly, one fully masked).
MASKED = {"unet_linear_3_levels", "unet_sdxl_text_time_bin"}

VAE_CASES = [
    ("vae_two_levels", dict(block_out_channels=[32, 64], norm_num_groups=8, latent_channels=4,
                            down_block_types=["DownEncoderBlock2D"] * 2,
                            up_block_types=["UpDecoderBlock2D"] * 2, sample_size=16), (16, 16), {}),
    ("vae_three_levels_plain", dict(
        block_out_channels=[16, 32, 32], norm_num_groups=16, latent_channels=3, layers_per_block=2,
        down_block_types=["DownEncoderBlock2D"] * 3, up_block_types=["UpDecoderBlock2D"] * 3,
        mid_block_add_attention=False, use_quant_conv=False, use_post_quant_conv=False,
        in_channels=1, out_channels=1, scaling_factor=0.5, shift_factor=0.1), (12, 16), {}),
]


def shapes(model):
    return {n: list(p.shape) for n, p in model.state_dict().items()}


def save(model, folder, opts):
    kwargs = {"safe_serialization": not opts.get("bin", False)}
    if "max_shard_size" in opts:
        kwargs["max_shard_size"] = opts["max_shard_size"]
    if "variant" in opts:
        kwargs["variant"] = opts["variant"]
        model = model.to(torch.float16)
    model.save_pretrained(folder, **kwargs)
    loaded = type(model).from_pretrained(folder, variant=opts.get("variant"),
                                         torch_dtype=torch.float32,
                                         use_safetensors=not opts.get("bin", False))
    return loaded


def grads_of(model, out, g):
    w = torch.randn(out.shape, generator=g)
    (out * w).sum().backward()
    return w, {f"grad.{n}": p.grad.clone() for n, p in model.named_parameters()}


def generate(out):
    root = out / "models"
    root.mkdir(parents=True, exist_ok=True)
    index = {"unet": [], "vae": []}
    for name, config, (h, w), ctx_len, opts in UNET_CASES:
        torch.manual_seed(0)
        model = UNet2DConditionModel(**config)
        # Randomise every parameter (diffusers zero-inits nothing here, but make norms non-trivial).
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        model = save(model, root / name, opts).train()
        g = torch.Generator().manual_seed(1)
        b = 2
        cfg = model.config
        inputs = {"sample": torch.randn(b, cfg.in_channels, h, w, generator=g),
                  "timestep": torch.tensor([3.0, 871.0])}
        d = cfg.encoder_hid_dim or (cfg.cross_attention_dim if isinstance(cfg.cross_attention_dim, int)
                                    else cfg.cross_attention_dim[0])
        inputs["encoder_hidden_states"] = torch.randn(b, ctx_len, d, generator=g)
        kwargs = {}
        if cfg.num_class_embeds and not cfg.class_embed_type:
            inputs["class_labels"] = torch.tensor([3, 9])
        elif cfg.class_embed_type == "timestep":
            inputs["class_labels"] = torch.tensor([5, 700])
        elif cfg.class_embed_type == "projection":
            inputs["class_labels"] = torch.randn(b, cfg.projection_class_embeddings_input_dim, generator=g)
        if cfg.time_cond_proj_dim:
            inputs["timestep_cond"] = torch.randn(b, cfg.time_cond_proj_dim, generator=g)
        if name in MASKED:
            mask = torch.ones(b, ctx_len)
            mask[0, 1::2] = 0
            mask[1] = 0
            inputs["encoder_attention_mask"] = mask
        for k in ("class_labels", "timestep_cond", "encoder_attention_mask"):
            if k in inputs:
                kwargs[k] = inputs[k]
        if cfg.addition_embed_type == "text_time":
            inputs["text_embeds"] = torch.randn(b, 16, generator=g)
            inputs["time_ids"] = torch.tensor([[64.0, 64.0, 0.0, 0.0, 64.0, 64.0],
                                               [96.0, 80.0, 8.0, 4.0, 64.0, 48.0]])
            kwargs["added_cond_kwargs"] = {"text_embeds": inputs["text_embeds"],
                                           "time_ids": inputs["time_ids"]}
        y = model(inputs["sample"], inputs["timestep"], inputs["encoder_hidden_states"], **kwargs).sample
        wgt, grads = grads_of(model, y, g)
        tensors = {f"input.{k}": v for k, v in inputs.items()}
        tensors.update({"output": y.detach(), "weight": wgt}, **grads)
        save_file({k: v.contiguous() for k, v in tensors.items()}, root / f"{name}.io.safetensors")
        assert opts.get("bin", False) == any(f.suffix == ".bin" for f in (root / name).iterdir())
        index["unet"].append({"name": name, "variant": opts.get("variant"),
                              "act_fn": cfg.act_fn, "parameters": sum(p.numel() for p in model.parameters())})

    for name, config, (h, w), opts in VAE_CASES:
        torch.manual_seed(0)
        model = AutoencoderKL(**config)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        model = save(model, root / name, opts).train()
        g = torch.Generator().manual_seed(2)
        x = torch.randn(2, model.config.in_channels, h, w, generator=g)
        posterior = model.encode(x).latent_dist
        z = torch.randn(posterior.mean.shape, generator=g)
        decoded = model.decode(z).sample
        recon = model(x).sample
        loss_w = torch.randn(recon.shape, generator=g)
        mean_w = torch.randn(posterior.mean.shape, generator=g)
        ((recon * loss_w).sum() + (posterior.mean * mean_w).sum() + posterior.logvar.sum()
         + (decoded * loss_w).sum()).backward()
        tensors = {"input.x": x, "input.z": z, "mean": posterior.mean.detach(),
                   "logvar": posterior.logvar.detach(), "decoded": decoded.detach(),
                   "recon": recon.detach(), "loss_w": loss_w, "mean_w": mean_w}
        tensors.update({f"grad.{n}": p.grad.clone() for n, p in model.named_parameters()})
        save_file({k: v.contiguous() for k, v in tensors.items()}, root / f"{name}.io.safetensors")
        index["vae"].append({"name": name, "parameters": sum(p.numel() for p in model.parameters())})

    # diffusers' enable_tiling / enable_slicing: 16-pixel tiles (8 latents) over 40 x 28 images
    # (20 x 14 latents), overlapping by a quarter, one image at a time.
    torch.manual_seed(0)
    model = AutoencoderKL(**dict(VAE_CASES[0][1], sample_size=16))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(root / "vae_tiled")
    model.train()
    model.enable_tiling()
    model.enable_slicing()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 40, 28, generator=g)
    posterior = model.encode(x).latent_dist
    z = torch.randn(2, 4, 20, 14, generator=g)
    decoded = model.decode(z).sample
    dec_w = torch.randn(decoded.shape, generator=g)
    mean_w = torch.randn(posterior.mean.shape, generator=g)
    ((decoded * dec_w).sum() + (posterior.mean * mean_w).sum() + posterior.logvar.sum()).backward()
    tensors = {"input.x": x, "input.z": z, "mean": posterior.mean.detach(),
               "logvar": posterior.logvar.detach(), "decoded": decoded.detach(), "decoded_w": dec_w,
               "mean_w": mean_w}
    tensors.update({f"grad.{n}": p.grad.clone() for n, p in model.named_parameters()})
    save_file({k: v.contiguous() for k, v in tensors.items()}, root / "vae_tiled.io.safetensors")
    index["vae_tiled"] = {"name": "vae_tiled", "sample_tile": 16, "latent_tile": 8}

    full = {}
    with torch.device("meta"):
        for key, cls, cfg in (("sd15_unet", UNet2DConditionModel, SD15_UNET),
                              ("sd21_unet", UNet2DConditionModel, SD21_UNET),
                              ("sdxl_unet", UNet2DConditionModel, SDXL_UNET),
                              ("sd_vae", AutoencoderKL, SD_VAE)):
            model = cls(**cfg)
            full[key] = {"config": cfg, "shapes": shapes(model),
                         "parameters": sum(p.numel() for p in model.parameters())}
    index["full_size"] = full
    (out / "models.json").write_text(json.dumps(index))
