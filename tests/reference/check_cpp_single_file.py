"""SD 1.x single files difftrain wrote (float32 and fp16), an SD 2.x one (OpenCLIP's text
tower), an SDXL one (both text encoders) and SD3 / 3.5 ones (the MMDiT) load with diffusers' StableDiffusionPipeline.from_single_file, given the pipeline's configs as a folder (diffusers'
`config=`), and its UNet, VAE and text encoder hold every tensor of the diffusers models difftrain
wrote it from (the fp16 file: their fp16 rounding). Usage: check_cpp_single_file.py TEST_BINARY GOLDEN_DIR"""
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import torch
from diffusers import AutoencoderKL, PNDMScheduler, StableDiffusionPipeline, UNet2DConditionModel
from diffusers.utils import logging as diffusers_logging
from transformers import CLIPTextModel


def main(binary, golden_dir):
    diffusers_logging.set_verbosity_error()
    golden = pathlib.Path(golden_dir)
    out = pathlib.Path(tempfile.mkdtemp())
    env = dict(os.environ, DIFFTRAIN_MODELS_OUT=str(out), DIFFTRAIN_GOLDEN_DIR=golden_dir)
    subprocess.run([binary, "--gtest_filter=SingleFile.Sd1ComponentsRoundTrip*:SingleFile.Sdxl*:SingleFile.FullSize*:SingleFileSd3.Models*"],
                   check=True, env=env)
    check_full_size_names(out / "ldm_names.json")
    # The pipeline's configs, as a folder: what diffusers takes as `config=` for a single file.
    parts = {"unet": golden / "models" / "unet_conv_proj", "vae": golden / "models" / "vae_two_levels",
             "text_encoder": golden / "encode_prompt" / "text_encoder",
             "tokenizer": golden / "clip_tokenizer" / "sd15"}
    config = out / "config"
    for name, src in parts.items():
        shutil.copytree(src, config / name)
    PNDMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear").save_config(
        config / "scheduler")
    (config / "model_index.json").write_text(json.dumps({
        "_class_name": "StableDiffusionPipeline", "_diffusers_version": "0.42.1",
        "unet": ["diffusers", "UNet2DConditionModel"], "vae": ["diffusers", "AutoencoderKL"],
        "text_encoder": ["transformers", "CLIPTextModel"], "tokenizer": ["transformers", "CLIPTokenizer"],
        "scheduler": ["diffusers", "PNDMScheduler"], "safety_checker": [None, None],
        "feature_extractor": [None, None], "image_encoder": [None, None],
        "requires_safety_checker": False}))
    originals = {"unet": UNet2DConditionModel.from_pretrained(parts["unet"]),
                 "vae": AutoencoderKL.from_pretrained(parts["vae"]),
                 "text_encoder": CLIPTextModel.from_pretrained(parts["text_encoder"])}
    for file, dtype in (("sd1_single.safetensors", None), ("sd1_single_fp16.safetensors", torch.float16),
                        ("sd2_single.safetensors", None)):
        pipe = StableDiffusionPipeline.from_single_file(
            str(out / file), config=str(config), local_files_only=True, safety_checker=None,
            requires_safety_checker=False)
        for name, original in originals.items():
            got = getattr(pipe, name).state_dict()
            want = original.state_dict()
            names = [k for k in want if not k.endswith("position_ids")]
            assert all(k in got for k in names), (file, name, [k for k in names if k not in got][:3])
            for k in names:
                w = want[k] if dtype is None else want[k].to(dtype).to(want[k].dtype)
                assert torch.equal(got[k].to(w.dtype), w), (file, name, k)
            print(f"{file}: from_single_file's {name} holds difftrain's {len(names)} tensors")
    check_sdxl(out, golden)
    check_sd3(out, golden)
    shutil.rmtree(out)


def check_sd3(out, golden):
    """The SD3 / 3.5 files: diffusers' own converter (convert_sd3_transformer_checkpoint_to_diffusers)
    on the file's MMDiT gives every tensor of the reference transformer to the bit and nothing else,
    and SD3Transformer2DModel.from_single_file loads the file."""
    from diffusers import SD3Transformer2DModel
    from diffusers.loaders.single_file_utils import convert_sd3_transformer_checkpoint_to_diffusers
    from safetensors.torch import load_file
    for name in ("sd3_tiny", "sd3_single_block", "sd35_qk_norm_dual"):
        file = out / f"{name}_single.safetensors"
        folder = golden / "transformers" / name
        want = load_file(folder / "diffusion_pytorch_model.safetensors")
        checkpoint = {k: v for k, v in load_file(file).items() if k.startswith("model.diffusion_model.")}
        converted = convert_sd3_transformer_checkpoint_to_diffusers(dict(checkpoint))
        assert set(converted) == set(want), (name, sorted(set(converted) ^ set(want))[:5])
        for k, v in converted.items():
            assert torch.equal(v, want[k]), (name, k)
        model = SD3Transformer2DModel.from_single_file(str(file), config=str(folder), local_files_only=True)
        got = model.state_dict()
        for k, v in want.items():
            assert torch.equal(got[k], v), (name, "from_single_file", k)
        print(f"{name}: diffusers' SD3 converter and from_single_file give the reference's "
              f"{len(want)} tensors from difftrain's file")


def check_sdxl(out, golden):
    """The SDXL file (CLIP ViT-L under conditioner.embedders.0, OpenCLIP ViT-bigG's tower under
    conditioner.embedders.1) loads with StableDiffusionXLPipeline.from_single_file and holds every
    tensor of the four models."""
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline
    from transformers import CLIPTextModelWithProjection
    parts = {"unet": golden / "models" / "unet_sdxl_text_time_bin", "vae": golden / "models" / "vae_two_levels",
             "text_encoder": golden / "encode_prompt" / "text_encoder",
             "text_encoder_2": golden / "encode_prompt" / "text_encoder_2",
             "tokenizer": golden / "clip_tokenizer" / "sd15", "tokenizer_2": golden / "clip_tokenizer" / "sd2"}
    config = out / "config_xl"
    for name, src in parts.items():
        shutil.copytree(src, config / name)
    EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear").save_config(
        config / "scheduler")
    (config / "model_index.json").write_text(json.dumps({
        "_class_name": "StableDiffusionXLPipeline", "_diffusers_version": "0.42.1",
        "unet": ["diffusers", "UNet2DConditionModel"], "vae": ["diffusers", "AutoencoderKL"],
        "text_encoder": ["transformers", "CLIPTextModel"],
        "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
        "tokenizer": ["transformers", "CLIPTokenizer"], "tokenizer_2": ["transformers", "CLIPTokenizer"],
        "scheduler": ["diffusers", "EulerDiscreteScheduler"], "image_encoder": [None, None],
        "feature_extractor": [None, None], "force_zeros_for_empty_prompt": True}))
    # (that UNet's folder is a sharded pickle, as older diffusers wrote them: its shards merged)
    index = json.loads((parts["unet"] / "diffusion_pytorch_model.bin.index.json").read_text())
    unet_state = {}
    for shard in sorted(set(index["weight_map"].values())):
        unet_state.update(torch.load(parts["unet"] / shard, weights_only=True))
    originals = {"unet": unet_state,
                 "vae": AutoencoderKL.from_pretrained(parts["vae"]),
                 "text_encoder": CLIPTextModel.from_pretrained(parts["text_encoder"]),
                 "text_encoder_2": CLIPTextModelWithProjection.from_pretrained(parts["text_encoder_2"])}
    pipe = StableDiffusionXLPipeline.from_single_file(str(out / "sdxl_single.safetensors"), config=str(config),
                                                      local_files_only=True)
    for name, original in originals.items():
        got = getattr(pipe, name).state_dict()
        want = original if isinstance(original, dict) else original.state_dict()
        names = [k for k in want if not k.endswith("position_ids")]
        assert all(k in got for k in names), (name, [k for k in names if k not in got][:3])
        assert len(got) == len([k for k in got if not k.endswith("position_ids")]) and len(names) == len(got), \
            (name, len(names), len(got))
        for k in names:
            assert torch.equal(got[k].to(want[k].dtype), want[k]), ("sdxl", name, k)
        print(f"sdxl_single.safetensors: from_single_file's {name} holds difftrain's {len(names)} tensors")


def check_full_size_names(path):
    """diffusers' own converters, run on the original names difftrain gives the full-size SD 1.5, 2.1
    and XL UNets, the SD VAE and SD3 / 3.5 medium's MMDiT (meta tensors of their shapes), give back
    every diffusers tensor with its shape and nothing else."""
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint, convert_ldm_vae_checkpoint
    tables = json.loads(path.read_text())
    for key, convert, prefix in (("sd15_unet", convert_ldm_unet_checkpoint, "model.diffusion_model."),
                                 ("sd21_unet", convert_ldm_unet_checkpoint, "model.diffusion_model."),
                                 ("sdxl_unet", convert_ldm_unet_checkpoint, "model.diffusion_model."),
                                 ("sd_vae", convert_ldm_vae_checkpoint, "first_stage_model.")):
        t = tables[key]
        checkpoint = {}
        for name, ldm in t["names"].items():
            shape = list(t["shapes"][name])
            if key == "sd_vae" and "mid.attn_1." in ldm and ldm.endswith(("q.weight", "k.weight", "v.weight",
                                                                           "proj_out.weight")):
                shape = shape + [1, 1]  # the original's 1x1 convolutions
            checkpoint[prefix + ldm] = torch.empty(shape, device="meta")
        converted = convert(checkpoint, t["config"])
        assert set(converted) == set(t["shapes"]), (key, sorted(set(converted) ^ set(t["shapes"]))[:5])
        for name, tensor in converted.items():
            assert list(tensor.shape) == list(t["shapes"][name]), (key, name, tensor.shape)
        print(f"{key}: diffusers' converter maps difftrain's {len(checkpoint)} original names back to "
              f"every diffusers tensor")
    from diffusers.loaders.single_file_utils import convert_sd3_transformer_checkpoint_to_diffusers
    for key in ("sd3_medium", "sd35_medium"):
        t = tables[key]
        checkpoint = {"model.diffusion_model." + name: torch.empty(shape, device="meta")
                      for name, shape in t["original"].items()}
        converted = convert_sd3_transformer_checkpoint_to_diffusers(dict(checkpoint))
        assert set(converted) == set(t["shapes"]), (key, sorted(set(converted) ^ set(t["shapes"]))[:5])
        for name, tensor in converted.items():
            assert list(tensor.shape) == list(t["shapes"][name]), (key, name, tensor.shape)
        print(f"{key}: diffusers' SD3 converter maps difftrain's {len(checkpoint)} original names "
              f"(three blocks at full width) back to every diffusers tensor")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
