"""A UNet, a VAE, a DiT and a CogVideoX transformer and VAE folder, and SD3 and CogVideoX LoRA files, written
by difftrain load in diffusers (from_pretrained, load_lora_weights) and give the outputs difftrain
computed. Usage: check_cpp_models.py TEST_BINARY GOLDEN_DIR"""
import os
import pathlib
import subprocess
import sys
import tempfile

import torch
from diffusers import (AutoencoderKL, AutoencoderKLCogVideoX, CogVideoXTransformer3DModel, DiTTransformer2DModel,
                       SD3Transformer2DModel, UNet2DConditionModel)
from diffusers.loaders import CogVideoXLoraLoaderMixin, SD3LoraLoaderMixin
from diffusers.utils import logging as diffusers_logging
from safetensors.torch import load_file


def main(binary, golden_dir):
    diffusers_logging.set_verbosity_error()
    out = pathlib.Path(tempfile.mkdtemp())
    env = dict(os.environ, DIFFTRAIN_MODELS_OUT=str(out), DIFFTRAIN_GOLDEN_DIR=golden_dir)
    subprocess.run([binary, "--gtest_filter=Models.SavedFoldersRoundTrip:Models.UNetLora*:Transformers.SavedDiT*:Transformers.CogVideoXLora*:"
                    "Transformers.TransformerLoraFiles*:CogVideoXVae.SavedFolder*"],
                   check=True, env=env)
    t = load_file(out / "outputs.safetensors")
    unet = UNet2DConditionModel.from_pretrained(out / "unet").eval()
    vae = AutoencoderKL.from_pretrained(out / "vae").eval()
    with torch.no_grad():
        y = unet(t["sample"], t["timestep"], t["encoder_hidden_states"]).sample
        mean = vae.encode(t["x"]).latent_dist.mean
        recon = vae(t["x"]).sample
    for name, got, want in (("unet", y, t["unet"]), ("vae mean", mean, t["vae_mean"]),
                            ("vae recon", recon, t["vae_recon"])):
        err = (got - want).abs().max().item() / max(1.0, want.abs().max().item())
        assert err < 1e-5, (name, err)
        print(f"{name}: diffusers on difftrain's folder, max scaled error {err:.2e}")
    check_sdxl(out, pathlib.Path(golden_dir))
    check_lora(out, pathlib.Path(golden_dir))
    check_dit(out)
    check_cogvideox(out)
    check_cogvideox_vae(out)
    check_transformer_loras(out, pathlib.Path(golden_dir))


def check_dit(out):
    """A DiT folder difftrain saved, run by diffusers on the inputs difftrain ran it on."""
    t = load_file(out / "outputs_dit.safetensors")
    dit = DiTTransformer2DModel.from_pretrained(out / "dit").eval()
    with torch.no_grad():
        y = dit(t["sample"], timestep=t["timestep"], class_labels=t["class_labels"]).sample
    err = (y - t["output"]).abs().max().item() / max(1.0, t["output"].abs().max().item())
    assert err < 1e-5, ("dit", err)
    print(f"DiT: diffusers on difftrain's folder, max scaled error {err:.2e}")


def check_cogvideox(out):
    """A CogVideoX transformer folder (rotary embeddings and the saved learned table) difftrain
    saved, run by diffusers with the rotary tables difftrain computed."""
    t = load_file(out / "outputs_cogvideox.safetensors")
    model = CogVideoXTransformer3DModel.from_pretrained(out / "cogvideox").eval()
    with torch.no_grad():
        y = model(t["hidden_states"], encoder_hidden_states=t["encoder_hidden_states"],
                  timestep=t["timestep"], image_rotary_emb=(t["rotary_cos"], t["rotary_sin"])).sample
    err = (y - t["output"]).abs().max().item() / max(1.0, t["output"].abs().max().item())
    assert err < 1e-5, ("cogvideox", err)
    print(f"CogVideoX: diffusers on difftrain's folder, max scaled error {err:.2e}")


def check_cogvideox_vae(out):
    """A CogVideoX VAE folder difftrain saved: diffusers' posterior mean and reconstruction of a
    9-frame video (two frame batches, causal convolutions carrying frames between them)."""
    t = load_file(out / "outputs_cogvideox_vae.safetensors")
    vae = AutoencoderKLCogVideoX.from_pretrained(out / "cogvideox_vae").eval()
    with torch.no_grad():
        mean = vae.encode(t["x"]).latent_dist.mean
        recon = vae(t["x"]).sample
    for name, got, want in (("mean", mean, t["mean"]), ("recon", recon, t["recon"])):
        err = (got - want).abs().max().item() / max(1.0, want.abs().max().item())
        assert err < 1e-5, ("cogvideox vae " + name, err)
        print(f"CogVideoX VAE {name}: diffusers on difftrain's folder, max scaled error {err:.2e}")


def check_transformer_loras(out, golden):
    """LoRA files difftrain wrote for an SD3 and a CogVideoX transformer (PEFT keys under
    "transformer.", rank 2 with alpha 6 in the adapter metadata), read by diffusers' own
    load_lora_weights through PEFT onto its transformers: difftrain's adapted outputs."""
    transformers = golden / "transformers"
    cases = (("sd3", SD3LoraLoaderMixin, SD3Transformer2DModel, "sd3_tiny",
              lambda m, t: m(t["sample"], encoder_hidden_states=t["encoder_hidden_states"],
                             pooled_projections=t["pooled_projections"],
                             timestep=t["timestep"]).sample),
             ("cogvideox", CogVideoXLoraLoaderMixin, CogVideoXTransformer3DModel, "cogvideox_sincos",
              lambda m, t: m(t["hidden_states"], encoder_hidden_states=t["encoder_hidden_states"],
                             timestep=t["timestep"]).sample))
    for name, loader, cls, folder, run in cases:
        class Pipeline(loader):  # what load_lora_weights needs of a pipeline
            hf_device_map = None

            def __init__(self, transformer):
                self.transformer = transformer
                self.text_encoder = self.text_encoder_2 = None

            @property
            def components(self):
                return {"transformer": self.transformer}

        model = cls.from_pretrained(transformers / folder).eval()
        Pipeline(model).load_lora_weights(str(out / f"{name}_lora.safetensors"))
        config = model.peft_config["default_0"]
        assert (config.r, config.lora_alpha) == (2, 6.0), (name, config.r, config.lora_alpha)
        t = load_file(out / f"outputs_{name}_lora.safetensors")
        with torch.no_grad():
            y = run(model, t)
        err = (y - t["output"]).abs().max().item() / max(1.0, t["output"].abs().max().item())
        assert err < 1e-5, (name + " lora", err)
        print(f"{name} LoRA read by diffusers' load_lora_weights (PEFT, r 2, alpha 6): "
              f"max scaled error {err:.2e}")


def check_sdxl(out, golden):
    """SDXL's added conditions and an encoder attention mask, on a folder difftrain wrote."""
    io = load_file(golden / "models" / "unet_sdxl_text_time_bin.io.safetensors")
    want = load_file(out / "outputs_sdxl.safetensors")["unet"]
    unet = UNet2DConditionModel.from_pretrained(out / "unet_sdxl").eval()
    with torch.no_grad():
        y = unet(io["input.sample"], io["input.timestep"], io["input.encoder_hidden_states"],
                 encoder_attention_mask=io["input.encoder_attention_mask"],
                 added_cond_kwargs={"text_embeds": io["input.text_embeds"],
                                    "time_ids": io["input.time_ids"]}).sample
    err = (y - want).abs().max().item() / max(1.0, want.abs().max().item())
    assert err < 1e-5, ("sdxl", err)
    print(f"SDXL-layout UNet with added conditions and a mask: max scaled error {err:.2e}")


def merged(unet, state_dict, alphas):
    """Applies a LoRA in diffusers' own key form (what its lora_state_dict returns) to a copy of the
    UNet's weights with PEFT's formula W + (alpha / rank) * B @ A; every key must name a Linear."""
    weights = {k: v.clone() for k, v in unet.state_dict().items()}
    pairs = {}
    for key, value in state_dict.items():
        assert key.startswith("unet."), key
        key = key[len("unet."):]
        if ".processor." in key:  # kohya files come back in the attention-processor naming
            module, rest = key.split(".processor.")
            proj, part = rest.split("_lora.")
            proj = "to_out.0" if proj == "to_out" else proj
            side = "A" if part.startswith("down") else "B"
            alpha = alphas.get("unet." + key + ".alpha")
            pairs.setdefault(f"{module}.{proj}", {})[side] = value
            if alpha is not None:
                pairs[f"{module}.{proj}"]["alpha"] = alpha
        else:
            module, side = key.rsplit(".lora_", 1)
            pairs.setdefault(module, {})[side[0]] = value
    for module, p in pairs.items():
        w = weights[module + ".weight"]
        rank = p["A"].shape[0]
        scale = p.get("alpha", 8.0) / rank  # PEFT keeps alpha in its adapter config: 8 here
        weights[module + ".weight"] = w + scale * p["B"] @ p["A"]
    return weights, len(pairs)


def check_lora(out, golden):
    from diffusers.loaders.lora_pipeline import StableDiffusionLoraLoaderMixin as Loader

    io = load_file(golden / "models" / "unet_conv_proj.io.safetensors")
    want = load_file(out / "lora_output.safetensors")["output"]
    for layout in ("peft", "kohya"):
        state_dict, alphas = Loader.lora_state_dict(load_file(out / f"lora_{layout}.safetensors"))
        unet = UNet2DConditionModel.from_pretrained(golden / "models" / "unet_conv_proj").eval()
        weights, n = merged(unet, state_dict, alphas or {})
        unet.load_state_dict(weights)
        with torch.no_grad():
            y = unet(io["input.sample"], io["input.timestep"], io["input.encoder_hidden_states"]).sample
        err = (y - want).abs().max().item() / max(1.0, want.abs().max().item())
        assert err < 1e-5, (layout, err)
        print(f"LoRA ({layout}, {n} layers) read by diffusers' lora_state_dict: max scaled error {err:.2e}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
