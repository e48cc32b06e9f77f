"""A UNet, a VAE, a DiT and a CogVideoX transformer and VAE folder, Stable Diffusion LoRA files over a
sweep of rank and alpha, and SD3 and CogVideoX LoRA files, written by difftrain load in diffusers
(from_pretrained, load_lora_weights) and give the outputs difftrain computed; its LoHa and LoKr
files give them through lycoris-lora's parser and PEFT's adapters. Usage: check_cpp_models.py TEST_BINARY GOLDEN_DIR"""
import json
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
    subprocess.run([binary, "--gtest_filter=Models.SavedFoldersRoundTrip:Models.UNetLora*:Models.UNetLohaAndLokr*:Transformers.SavedDiT*:Transformers.CogVideoXLora*:"
                    "Transformers.TransformerLoraFiles*:CogVideoXVae.SavedFolder*:ModelConfigs.*:Flux.LoraFiles*"],
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
    check_weight_deltas(out, pathlib.Path(golden_dir))
    check_dora_locon(out, pathlib.Path(golden_dir))
    check_flux_loras(out, pathlib.Path(golden_dir))
    check_configs(out)


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


def check_lora(out, golden):
    """The LoRA files difftrain's Stable Diffusion programs write (adapters::
    save_stable_diffusion_lora_files), over a sweep of rank and alpha: diffusers' own
    load_lora_weights, on the PEFT file and on the kohya file, gives the UNet and text-encoder
    outputs difftrain computed with the trained branches. A PEFT file without its adapter metadata
    would load at alpha = rank and fail every case but alpha = rank."""
    from diffusers.loaders.lora_pipeline import StableDiffusionLoraLoaderMixin, StableDiffusionXLLoraLoaderMixin
    from transformers import CLIPTextModel, CLIPTextModelWithProjection
    from transformers.utils import logging as transformers_logging
    transformers_logging.set_verbosity_error()
    io = load_file(golden / "models" / "unet_conv_proj.io.safetensors")
    cases = json.loads((out / "lora_cases.json").read_text())
    assert len(cases) >= 6, cases
    for case in cases:
        folder = out / case["name"]
        want = load_file(folder / "outputs.safetensors")
        loader = StableDiffusionXLLoraLoaderMixin if case["sdxl"] else StableDiffusionLoraLoaderMixin

        class Pipeline(loader):  # what load_lora_weights needs of a pipeline
            hf_device_map = None

            def __init__(self, **modules):
                self.__dict__.update(modules)

            @property
            def components(self):
                return {k: v for k, v in self.__dict__.items() if isinstance(v, torch.nn.Module)}

        for name in ("pytorch_lora_weights.safetensors", "lora_kohya.safetensors"):
            if case["name"] == "lora_mixed" and name == "lora_kohya.safetensors":
                # diffusers reads kohya files named after diffusers' modules through its old
                # attention-processor names and drops alphas that differ by module (PEFT warns
                # that its alpha_pattern keys match nothing); the web UI and ComfyUI read them by
                # module. The file carries each module's alpha: 6 on attn1, 1 on attn2.
                alphas = {k: float(v) for k, v in load_file(folder / name).items() if k.endswith(".alpha")}
                assert alphas and all(v == (6.0 if "_attn1_" in k else 1.0) for k, v in alphas.items()), alphas
                continue
            modules = dict(
                unet=UNet2DConditionModel.from_pretrained(golden / "models" / "unet_conv_proj").eval(),
                text_encoder=CLIPTextModel.from_pretrained(golden / "text_encoders" / "tiny_quick_gelu").eval())
            if case["sdxl"]:
                modules["text_encoder_2"] = CLIPTextModelWithProjection.from_pretrained(
                    golden / "text_encoders" / "tiny_gelu_projection").eval()
            Pipeline(**modules).load_lora_weights(str(folder), weight_name=name)
            with torch.no_grad():
                got = {"unet": modules["unet"](io["input.sample"], io["input.timestep"],
                                               io["input.encoder_hidden_states"]).sample,
                       "text_encoder": modules["text_encoder"](want["input_ids"]).last_hidden_state}
                if case["sdxl"]:
                    got["text_encoder_2"] = modules["text_encoder_2"](want["input_ids"]).last_hidden_state
            for part, y in got.items():
                err = (y - want[part]).abs().max().item() / max(1.0, want[part].abs().max().item())
                assert err < 1e-5, (case["name"], name, part, err)
        files = "the PEFT file" if case["name"] == "lora_mixed" else "the PEFT and the kohya file"
        print(f"LoRA {case['name']}: diffusers' load_lora_weights on {files} gives difftrain's UNet "
              f"and text-encoder outputs")


def check_weight_deltas(out, golden):
    """LoHa and LoKr files difftrain wrote (Models.UNetLohaAndLokrFilesReadBackAndApplyElsewhere):
    LyCORIS' parser applies the LyCORIS file, and PEFT's LoHaConfig / LoKrConfig take
    the PEFT file, on diffusers' UNet: difftrain's adapted output."""
    from lycoris import create_lycoris_from_weights
    from peft import LoHaConfig, LoKrConfig, set_peft_model_state_dict
    cases = json.loads((out / "delta_cases.json").read_text())
    io = load_file(golden / "models" / "unet_conv_proj.io.safetensors")
    args = (io["input.sample"], io["input.timestep"], io["input.encoder_hidden_states"])
    for case in cases:
        folder = out / f"delta_{case['name']}"
        want = load_file(folder / "output.safetensors")["unet"]
        unet = UNet2DConditionModel.from_pretrained(golden / "models" / "unet_conv_proj").eval()
        # LyCORIS' own parser of a file's modules (get_module / make_module), on the UNet's
        # names: its kohya prefix lora_unet_ is its wrapper's lycoris_.
        sd = {k.replace("lora_unet_", "lycoris_", 1): v
              for k, v in load_file(folder / "lycoris.safetensors").items()}
        assert sd and all(k.startswith("lycoris_") for k in sd)
        network, _ = create_lycoris_from_weights(1.0, "", unet, weights_sd=sd)
        assert len(network.loras) == len({k.split(".")[0] for k in sd}), len(network.loras)
        network.apply_to()
        with torch.no_grad():
            got = unet(*args).sample
        err = float((got - want).abs().max())
        assert err < 1e-5, (case["name"], "lycoris", err)
        unet = UNet2DConditionModel.from_pretrained(golden / "models" / "unet_conv_proj").eval()
        targets = ["to_q", "to_k", "to_v", "to_out.0"]
        if case["kind"] == "loha":
            config = LoHaConfig(r=case["rank"], alpha=case["alpha"], target_modules=targets)
        else:
            config = LoKrConfig(r=case["rank"], alpha=case["alpha"], target_modules=targets,
                                decompose_both=case["decompose_both"])
        unet.add_adapter(config)
        result = set_peft_model_state_dict(unet, load_file(folder / "peft.safetensors"))
        assert not result.unexpected_keys, result.unexpected_keys
        with torch.no_grad():
            got2 = unet(*args).sample
        err2 = float((got2 - want).abs().max())
        assert err2 < 1e-5, (case["name"], "peft", err2)
        print(f"{case['name']}: LyCORIS' parser {err:.1e}, PEFT {err2:.1e} from difftrain's UNet output")

def check_dora_locon(out, golden):
    """A DoRA + LoCon UNet LoRA difftrain wrote (Models.UNetLoraDoraAndLoconFilesApply...):
    diffusers' LoRA loader (load_lora_into_unet with the file's adapter metadata) applies the PEFT
    file and lycoris-lora's parser the kohya file to diffusers' UNet, each giving difftrain's
    output."""
    from diffusers import StableDiffusionPipeline
    from lycoris import create_lycoris_from_weights
    folder = out / "dora_locon"
    want = load_file(folder / "output.safetensors")["unet"]
    io = load_file(golden / "models" / "unet_conv_proj.io.safetensors")
    args = (io["input.sample"], io["input.timestep"], io["input.encoder_hidden_states"])
    unet = UNet2DConditionModel.from_pretrained(golden / "models" / "unet_conv_proj").eval()
    state, alphas, metadata = StableDiffusionPipeline.lora_state_dict(
        str(folder / "pytorch_lora_weights.safetensors"), return_lora_metadata=True)
    StableDiffusionPipeline.load_lora_into_unet(state, alphas, unet=unet, metadata=metadata)
    assert unet.peft_config["default_0"].use_dora
    with torch.no_grad():
        got = unet(*args).sample
    err = float((got - want).abs().max())
    assert err < 1e-5, ("dora diffusers", err)
    unet = UNet2DConditionModel.from_pretrained(golden / "models" / "unet_conv_proj").eval()
    sd = {k.replace("lora_unet_", "lycoris_", 1): v
          for k, v in load_file(folder / "lora_kohya.safetensors").items()}
    network, _ = create_lycoris_from_weights(1.0, "", unet, weights_sd=sd)
    assert len(network.loras) == len({k.split(".")[0] for k in sd}), len(network.loras)
    network.apply_to()
    with torch.no_grad():
        got2 = unet(*args).sample
    err2 = float((got2 - want).abs().max())
    assert err2 < 1e-5, ("dora lycoris", err2)
    print(f"DoRA + LoCon: diffusers' loader {err:.1e}, LyCORIS' parser {err2:.1e} from difftrain's UNet output")


def check_flux_loras(out, golden):
    """Flux LoRA files difftrain wrote (Flux.LoraFilesInDiffusersAndKohyasLayouts) in diffusers'
    layout and in kohya's Flux layout (fused qkv / linear1): FluxPipeline's lora_state_dict (its
    kohya converter for the second) and load_lora_into_transformer give diffusers' transformer
    difftrain's output. diffusers' kohya converter assumes Flux.1's full single-block widths, so
    kohya files are read there for a model of double blocks only."""
    from diffusers import FluxPipeline, FluxTransformer2DModel
    for variant in ("targets", "all_blocks", "double_blocks"):
        folder = out / f"flux_lora_{variant}"
        case = json.loads((folder / "case.json").read_text())
        io = load_file(golden / "models" / f"{case['model']}.io.safetensors")
        want = load_file(folder / "output.safetensors")["transformer"]
        names = ["pytorch_lora_weights.safetensors"]
        if case["kohya_in_diffusers"]:
            names.append("lora_kohya.safetensors")
        for name in names:
            model = FluxTransformer2DModel.from_pretrained(golden / "models" / case["model"]).eval()
            state, alphas, metadata = FluxPipeline.lora_state_dict(
                str(folder / name), return_alphas=True, return_lora_metadata=True)
            FluxPipeline.load_lora_into_transformer(state, network_alphas=alphas, transformer=model,
                                                    metadata=metadata)
            with torch.no_grad():
                got = model(hidden_states=io["input.hidden_states"],
                            encoder_hidden_states=io["input.encoder_hidden_states"],
                            pooled_projections=io["input.pooled_projections"],
                            timestep=io["input.timestep"], img_ids=io["input.img_ids"],
                            txt_ids=io["input.txt_ids"], guidance=io.get("input.guidance")).sample
            err = float((got - want).abs().max()) / max(1.0, float(want.abs().max()))
            assert err < 1e-5, (variant, name, err)
            print(f"Flux LoRA ({variant}, {name}): diffusers gives difftrain's output ({err:.1e})")


def check_configs(out):
    """Every model folder difftrain loaded, fine-tuned and saved (ModelConfigs.*) reads in diffusers
    or transformers into the config of the folder it came from, value for value and type for type
    (4 is not 4.0: pipelines compute sizes with some fields). ControlNetModel.from_unet, as
    diffusers' train_controlnet.py starts, builds and runs on a fine-tuned UNet and on a UNet built
    in code."""
    import diffusers
    import transformers
    from diffusers import ControlNetModel

    def load(folder):
        j = json.loads((pathlib.Path(folder) / "config.json").read_text())
        weights = [f.name for f in pathlib.Path(folder).iterdir() if f.name != "config.json"]
        kwargs = dict(variant="fp16" if weights and all(".fp16." in n for n in weights) else None,
                      use_safetensors=any(n.endswith(".safetensors") for n in weights))
        if "_class_name" in j:
            return getattr(diffusers, j["_class_name"]).from_pretrained(folder, **kwargs)
        return getattr(transformers, j["architectures"][0]).from_pretrained(folder, **kwargs)

    def typed(config):
        d = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        skip = {"_name_or_path", "_diffusers_version", "transformers_version", "_use_default_values", "dtype"}
        return json.dumps({k: v for k, v in d.items() if k not in skip}, sort_keys=True, default=str)

    listing = json.loads((out / "configs.json").read_text())
    for entry in listing:
        original, saved = load(entry["original"]), load(entry["saved"])
        assert typed(saved.config) == typed(original.config), (entry, typed(saved.config), typed(original.config))
        if entry["saved"].endswith(("unet_conv_proj", "unet_sdxl_text_time_bin")):
            ControlNetModel.from_unet(saved)  # a TypeError when a scalar came back as a list
    print(f"{len(listing)} fine-tuned folders: diffusers and transformers read each one's config as its base's")
    unet = diffusers.UNet2DConditionModel.from_pretrained(out / "unet_built_in_code").eval()
    assert isinstance(unet.config.layers_per_block, int) and isinstance(unet.config.cross_attention_dim, int)
    controlnet = ControlNetModel.from_unet(unet, conditioning_channels=3).eval()
    with torch.no_grad():
        down, mid = controlnet(torch.randn(1, 4, 8, 8), torch.tensor([10]), torch.randn(1, 5, 12),
                               controlnet_cond=torch.randn(1, 3, 64, 64), return_dict=False)
        y = unet(torch.randn(1, 4, 8, 8), torch.tensor([10]), torch.randn(1, 5, 12),
                 down_block_additional_residuals=down, mid_block_additional_residual=mid).sample
    assert torch.isfinite(y).all()
    print("ControlNetModel.from_unet builds on a UNet difftrain built in code and the pair runs")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
