"""Test data for finetune_transformer's video options, made here, never downloaded: three tiny
CogVideoX pipelines with random weights written by diffusers' save_pretrained, and clips as
H.264 MP4 files in the SAT fine-tuning guide's layout (videos/ + labels/).

    cog15       CogVideoXPipeline, CogVideoX 1.5's transformer (patch_size_t 2, 3-D rotary
                positions sliced from the base grid), DDIM;
    cog15_i2v   CogVideoXImageToVideoPipeline of 1.5 (twice the latent channels in, the ofs
                embedding, a VAE with invert_scale_latents), DPM;
    cog_i2v     CogVideoXImageToVideoPipeline of 1.0 (5B-I2V's learned position table beside
                rotary positions), DDIM;
    clips/      four clips at 10 fps, a Fashion-MNIST item sliding left or right: two of 24
                frames at 48×40 (wider than the 32×32 trained, so SAT's crop matters) and two of
                14 frames at 32×40 (taller), so video buckets have two shapes to sort them into;
    first.png   a 32×32 first frame for the image-to-video validation.

    make_cogvideox_video_data.py OUT GOLDEN_DIR FASHION_MNIST_DIR
"""
import pathlib
import sys

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import make_cogvideox_data as cog  # noqa: E402
import make_text_to_image_data as t2i  # noqa: E402


def write_pipeline(root, golden, seed, *, i2v, v15, dpm, learned=False):
    from diffusers import (CogVideoXDDIMScheduler, CogVideoXDPMScheduler,
                           CogVideoXImageToVideoPipeline, CogVideoXPipeline,
                           CogVideoXTransformer3DModel)
    torch.manual_seed(seed)
    tokenizer, text_encoder, vae = cog.tiny_text_and_vae(golden, 0.7, v15 and i2v)
    extra = {}
    if v15:
        extra = dict(patch_size_t=2, patch_bias=False)
        if i2v:
            extra["ofs_embed_dim"] = 16
    transformer = CogVideoXTransformer3DModel(
        num_attention_heads=2, attention_head_dim=16, in_channels=8 if i2v else 4, out_channels=4,
        time_embed_dim=16, text_embed_dim=32, num_layers=2, sample_width=8, sample_height=8,
        sample_frames=9, patch_size=2, temporal_compression_ratio=4, max_text_seq_length=16,
        use_rotary_positional_embeddings=True, use_learned_positional_embeddings=learned, **extra)
    common = dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                  clip_sample=False, prediction_type="v_prediction", rescale_betas_zero_snr=True,
                  set_alpha_to_one=True, steps_offset=0, timestep_spacing="trailing",
                  snr_shift_scale=1.0)
    scheduler = CogVideoXDPMScheduler(**common) if dpm else CogVideoXDDIMScheduler(**common)
    kind = CogVideoXImageToVideoPipeline if i2v else CogVideoXPipeline
    kind(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
         scheduler=scheduler).save_pretrained(root)


def frame(image, k, t, width=48):
    """Frame t of clip k: the item sliding right (even k) or left (odd k) over a tinted canvas."""
    canvas = np.zeros((40, width), np.uint8)
    step = t // 2
    room = width - 28
    x = min(max(step if k % 2 == 0 else room - step, 0), room)
    canvas[6:34, x:x + 28] = image
    return np.stack([canvas, canvas // 2 + 40, 255 - canvas], -1)


def write_clips(root: pathlib.Path, fmnist: pathlib.Path):
    import av
    (root / "videos").mkdir(parents=True)
    (root / "labels").mkdir()
    for k, (image, label) in enumerate(t2i.fashion_mnist(fmnist, 2)[:4]):
        width, frames = (48, 24) if k < 2 else (32, 14)
        with av.open(str(root / "videos" / f"{k}.mp4"), "w") as out:
            s = out.add_stream("libx264", rate=10)
            s.width, s.height, s.pix_fmt = width, 40, "yuv420p"
            s.options = {"crf": "12"}
            for t in range(frames):
                f = av.VideoFrame.from_ndarray(frame(image, k, t, width), format="rgb24")
                for p in s.encode(f):
                    out.mux(p)
            for p in s.encode():
                out.mux(p)
        direction = "right" if k % 2 == 0 else "left"
        (root / "labels" / f"{k}.txt").write_text(
            f"a {t2i.CLASSES[label]} sliding to the {direction}\n")
    first = frame(t2i.fashion_mnist(fmnist, 1)[0][0], 0, 0)[4:36, 8:40]
    Image.fromarray(np.ascontiguousarray(first)).save(root.parent / "first.png")


def main():
    out, golden, fmnist = map(pathlib.Path, sys.argv[1:4])
    from diffusers.utils import logging as dlogging
    from transformers.utils import logging
    logging.set_verbosity_error()
    dlogging.set_verbosity_error()
    write_pipeline(out / "cog15", golden, 5, i2v=False, v15=True, dpm=False)
    write_pipeline(out / "cog15_i2v", golden, 6, i2v=True, v15=True, dpm=True)
    write_pipeline(out / "cog_i2v", golden, 7, i2v=True, v15=False, dpm=False, learned=True)
    write_clips(out / "clips", fmnist)


if __name__ == "__main__":
    main()
