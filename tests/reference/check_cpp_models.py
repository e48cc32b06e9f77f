"""A UNet and a VAE folder written by difftrain load in diffusers' from_pretrained and give the
outputs difftrain computed. Usage: check_cpp_models.py TEST_BINARY GOLDEN_DIR"""
import os
import pathlib
import subprocess
import sys
import tempfile

import torch
from diffusers import AutoencoderKL, UNet2DConditionModel
from diffusers.utils import logging as diffusers_logging
from safetensors.torch import load_file


def main(binary, golden_dir):
    diffusers_logging.set_verbosity_error()
    out = pathlib.Path(tempfile.mkdtemp())
    env = dict(os.environ, DIFFTRAIN_MODELS_OUT=str(out), DIFFTRAIN_GOLDEN_DIR=golden_dir)
    subprocess.run([binary, "--gtest_filter=Models.SavedFoldersRoundTrip"], check=True, env=env)
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


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
