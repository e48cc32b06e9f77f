"""Golden values for difftrain's FluxTransformer2DModel: diffusers' own model on a sweep of tiny
configurations (double- and single-stream block counts including none of one kind, head counts and
widths, the three rotary axes split several ways, guidance embeddings on and off, another output
width, odd latent grids, text lengths from 1, batches of 1-3). Each is saved with save_pretrained,
every parameter perturbed (so the zero-initialised nothing hides a path), and run on seeded inputs
with the position ids FluxPipeline makes (_prepare_latent_image_ids; text ids zero); the inputs,
the output and the gradients of sum(out * w) for every parameter and input are written.
For Flux.1 dev's and schnell's published configs the model is built on the meta device and every
parameter's name and shape written.

Writes models/flux_<i>/ (the folders), models/flux_<i>.io.safetensors and flux.json.
"""
import json

import torch
from diffusers import FluxPipeline, FluxTransformer2DModel
from diffusers.utils import logging as diffusers_logging
from safetensors.torch import save_file

diffusers_logging.set_verbosity_error()

# (config, latent grid (h, w) in packed 2×2 patches, text length, batch)
CASES = [
    (dict(num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
          in_channels=8, joint_attention_dim=12, pooled_projection_dim=10, guidance_embeds=True,
          axes_dims_rope=(4, 6, 6)), (3, 5), 7, 2),
    (dict(num_layers=2, num_single_layers=0, attention_head_dim=8, num_attention_heads=1,
          in_channels=4, joint_attention_dim=8, pooled_projection_dim=6, guidance_embeds=False,
          axes_dims_rope=(2, 2, 4)), (2, 3), 1, 1),
    (dict(num_layers=0, num_single_layers=2, attention_head_dim=12, num_attention_heads=3,
          in_channels=8, out_channels=6, joint_attention_dim=10, pooled_projection_dim=8,
          guidance_embeds=True, axes_dims_rope=(4, 4, 4)), (4, 4), 5, 2),
    (dict(num_layers=1, num_single_layers=2, attention_head_dim=8, num_attention_heads=2,
          in_channels=4, joint_attention_dim=6, pooled_projection_dim=4, guidance_embeds=False,
          axes_dims_rope=(2, 4, 2)), (5, 1), 3, 3),
]

DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38,
           attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
           pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56))
SCHNELL = dict(DEV, guidance_embeds=False)


def generate(out):
    root = out / "models"
    root.mkdir(parents=True, exist_ok=True)
    index = {"cases": [], "tables": {}}
    for i, (config, (h, w), text_len, batch) in enumerate(CASES):
        torch.manual_seed(10 + i)
        model = FluxTransformer2DModel(**config)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        name = f"flux_{i}"
        model.save_pretrained(root / name)
        model.train()
        c = model.config
        n = h * w
        hidden = torch.randn(batch, n, c.in_channels, requires_grad=True)
        encoder = torch.randn(batch, text_len, c.joint_attention_dim, requires_grad=True)
        pooled = torch.randn(batch, c.pooled_projection_dim, requires_grad=True)
        timestep = torch.rand(batch)
        guidance = torch.full((batch,), 3.5) if c.guidance_embeds else None
        img_ids = FluxPipeline._prepare_latent_image_ids(batch, h, w, "cpu", torch.float32)
        txt_ids = torch.zeros(text_len, 3)
        y = model(hidden_states=hidden, encoder_hidden_states=encoder, pooled_projections=pooled,
                  timestep=timestep, img_ids=img_ids, txt_ids=txt_ids, guidance=guidance).sample
        cot = torch.randn_like(y)
        (y * cot).sum().backward()
        t = {"input.hidden_states": hidden.detach(), "input.encoder_hidden_states": encoder.detach(),
             "input.pooled_projections": pooled.detach(), "input.timestep": timestep,
             "input.img_ids": img_ids, "input.txt_ids": txt_ids, "output": y.detach(),
             "cotangent": cot, "grad.input.hidden_states": hidden.grad,
             "grad.input.encoder_hidden_states": encoder.grad,
             "grad.input.pooled_projections": pooled.grad}
        if guidance is not None:
            t["input.guidance"] = guidance
        for pname, p in model.named_parameters():
            # A path the output does not depend on (the last double block's text stream when no
            # single block follows) has no gradient: zeros.
            t["grad." + pname] = p.grad if p.grad is not None else torch.zeros_like(p)
        save_file({k: v.contiguous() for k, v in t.items()}, root / f"{name}.io.safetensors")
        index["cases"].append({"name": name, "grid": [h, w], "text_length": text_len,
                               "batch": batch})
    for label, config in (("dev", DEV), ("schnell", SCHNELL)):
        with torch.device("meta"):
            model = FluxTransformer2DModel(**config)
        index["tables"][label] = {"config": {k: list(v) if isinstance(v, tuple) else v
                                             for k, v in config.items()},
                                  "parameters": [[n, list(p.shape)]
                                                 for n, p in model.named_parameters()]}
    # The pipeline's pieces: packing and unpacking, the position ids, the dynamic shift's mu.
    torch.manual_seed(3)
    pieces = {}
    for k, (b, c, h, w) in enumerate(((2, 16, 6, 10), (1, 4, 2, 2), (3, 8, 4, 14))):
        lat = torch.randn(b, c, h, w)
        packed = FluxPipeline._pack_latents(lat, b, c, h, w)
        pieces[f"pack.{k}.latents"] = lat
        pieces[f"pack.{k}.packed"] = packed
        pieces[f"pack.{k}.unpacked"] = FluxPipeline._unpack_latents(packed, h * 8, w * 8, 8)
        pieces[f"ids.{k}"] = FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, "cpu",
                                                                     torch.float32)
    save_file({k: v.contiguous().clone() for k, v in pieces.items()}, out / "flux_pipeline.safetensors")
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift
    index["mu"] = [[n, calculate_shift(n)] for n in (1, 64, 256, 1000, 1024, 4096, 8192)]
    index["mu_custom"] = [[n, calculate_shift(n, 128, 2048, 0.3, 1.5)] for n in (16, 4096)]
    (out / "flux.json").write_text(json.dumps(index))


if __name__ == "__main__":
    import pathlib
    import sys
    generate(pathlib.Path(sys.argv[1]))
