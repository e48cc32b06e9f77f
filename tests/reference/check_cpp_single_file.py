"""An SD 1.x single file difftrain wrote (float32 and fp16) loads with diffusers'
StableDiffusionPipeline.from_single_file, given the pipeline's configs as a folder (diffusers'
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
    subprocess.run([binary, "--gtest_filter=SingleFile.Sd1ComponentsRoundTrip*"], check=True, env=env)
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
    for file, dtype in (("sd1_single.safetensors", None), ("sd1_single_fp16.safetensors", torch.float16)):
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
    shutil.rmtree(out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
