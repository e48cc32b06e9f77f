"""Test data for the text-to-image programs, made here, never downloaded: a tiny Stable Diffusion
1.x and a tiny SDXL pipeline with random weights, saved by diffusers and transformers (save_pretrained, the SD
vocabulary from the tokenizer folder ref_clip_tokenizer.py writes), and a captioned image folder
of Fashion-MNIST items as JPEG, PNG and WebP at assorted sizes and EXIF orientations, captions in
metadata.jsonl ("a photo of a sneaker"), plus one damaged file the programs must skip.

    make_text_to_image_data.py OUT GOLDEN_DIR FASHION_MNIST_DIR
"""
import gzip
import json
import pathlib
import sys

import numpy as np
import torch
from PIL import Image

CLASSES = {7: "sneaker", 8: "bag", 1: "trouser"}


def fashion_mnist(folder: pathlib.Path, count: int):
    with gzip.open(folder / "train-images-idx3-ubyte.gz") as f:
        images = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 28, 28)
    with gzip.open(folder / "train-labels-idx1-ubyte.gz") as f:
        labels = np.frombuffer(f.read(), np.uint8, offset=8)
    picked = []
    for label in CLASSES:
        idx = np.nonzero(labels == label)[0][:count]
        picked += [(images[i], int(label)) for i in idx]
    return picked


def exif_with_orientation(orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return exif.tobytes()


def write_images(root: pathlib.Path, fmnist: pathlib.Path):
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    sizes = [(32, 32), (40, 40), (48, 32), (32, 48), (36, 36), (64, 64)]
    for n, (pixels, label) in enumerate(fashion_mnist(fmnist, 8)):
        img = Image.fromarray(255 - pixels).convert("RGB")  # dark items on white, as photos
        w, h = sizes[n % len(sizes)]
        img = img.resize((w, h), Image.BICUBIC)
        kind = ["jpg", "png", "webp"][n % 3]
        name = f"{CLASSES[label]}_{n:02d}.{kind}"
        if kind == "jpg" and n % 4 == 0:
            # Stored rotated; EXIF orientation 6 turns it back upright.
            img.transpose(Image.Transpose.ROTATE_90).save(root / name, quality=95,
                                                           exif=exif_with_orientation(6))
        elif kind == "jpg":
            img.save(root / name, quality=95)
        elif kind == "png":
            img.save(root / name)
        else:
            img.save(root / name, lossless=True)
        rows.append({"file_name": name, "text": f"a photo of a {CLASSES[label]}",
                     "label": CLASSES[label]})
    (root / "broken.jpg").write_bytes((root / rows[0]["file_name"]).read_bytes()[:200])
    with open(root / "metadata.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def write_pipeline(root: pathlib.Path, golden: pathlib.Path, seed=0, text_width=32, text_mlp=37,
                   text_heads=4, channels=(16, 32), vae_groups=4, unet_groups=8, heads=4):
    from diffusers import (AutoencoderKL, DDIMScheduler, StableDiffusionPipeline,
                           UNet2DConditionModel)
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer
    torch.manual_seed(seed)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=49408, max_position_embeddings=77, bos_token_id=49406, eos_token_id=49407,
        pad_token_id=1, hidden_size=text_width, intermediate_size=text_mlp, num_hidden_layers=2,
        num_attention_heads=text_heads, projection_dim=text_width, hidden_act="quick_gelu")).eval()
    tokenizer = CLIPTokenizer.from_pretrained(str(golden / "clip_tokenizer" / "sd15"))
    vae_channels = [8, 16] if vae_groups == 4 else list(channels)
    vae = AutoencoderKL(block_out_channels=vae_channels, in_channels=3, out_channels=3,
                        down_block_types=["DownEncoderBlock2D"] * 2,
                        up_block_types=["UpDecoderBlock2D"] * 2, latent_channels=4,
                        norm_num_groups=vae_groups, sample_size=32)
    unet = UNet2DConditionModel(block_out_channels=channels, layers_per_block=1, sample_size=16,
                                in_channels=4, out_channels=4,
                                down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
                                cross_attention_dim=text_width, attention_head_dim=heads,
                                norm_num_groups=unet_groups)
    scheduler = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                              clip_sample=False, set_alpha_to_one=False, steps_offset=1)
    pipe = StableDiffusionPipeline(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                                   unet=unet, scheduler=scheduler, safety_checker=None,
                                   feature_extractor=None, requires_safety_checker=False)
    pipe.save_pretrained(root)


def write_pipeline_by_convention(root: pathlib.Path, golden: pathlib.Path):
    """A tiny SD 1.x pipeline whose sizes keep SD 1.x's conventions (32 groups per norm, 8 heads per
    attention, 64 channels per CLIP head), which a single file's keys cannot tell: its single file
    is read with configs told from the keys alone."""
    write_pipeline(root, golden, seed=2, text_width=64, text_mlp=96, text_heads=1,
                   channels=(32, 64), vae_groups=32, unet_groups=32, heads=8)
    # OpenAI's BPE merges file, as open_clip ships it (gzipped): the tokenizer a single file lacks.
    import gzip
    merges = (golden / "clip_tokenizer" / "sd15" / "merges.txt").read_bytes()
    (root.parent / "bpe_simple_vocab_16e6.txt.gz").write_bytes(gzip.compress(merges))


def write_pipeline_xl(root: pathlib.Path, golden: pathlib.Path):
    from diffusers import (AutoencoderKL, EulerDiscreteScheduler, StableDiffusionXLPipeline,
                           UNet2DConditionModel)
    from transformers import (CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection,
                              CLIPTokenizer)
    torch.manual_seed(1)
    common = dict(vocab_size=49408, max_position_embeddings=77, bos_token_id=49406,
                  eos_token_id=49407, pad_token_id=1, num_hidden_layers=2)
    te1 = CLIPTextModel(CLIPTextConfig(hidden_size=32, intermediate_size=37, num_attention_heads=4,
                                       projection_dim=32, hidden_act="quick_gelu", **common))
    te2 = CLIPTextModelWithProjection(CLIPTextConfig(hidden_size=40, intermediate_size=48,
                                                     num_attention_heads=5, projection_dim=24,
                                                     hidden_act="gelu", **common))
    tok = CLIPTokenizer.from_pretrained(str(golden / "clip_tokenizer" / "sd15"))
    tok2 = CLIPTokenizer.from_pretrained(str(golden / "clip_tokenizer" / "sd2"))  # pads with "!"
    vae = AutoencoderKL(block_out_channels=[8, 16], in_channels=3, out_channels=3,
                        down_block_types=["DownEncoderBlock2D"] * 2,
                        up_block_types=["UpDecoderBlock2D"] * 2, latent_channels=4,
                        norm_num_groups=4, sample_size=32, scaling_factor=0.13025)
    unet = UNet2DConditionModel(block_out_channels=(16, 32), layers_per_block=1, sample_size=16,
                                in_channels=4, out_channels=4,
                                down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                                up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
                                cross_attention_dim=72, attention_head_dim=4, norm_num_groups=8,
                                addition_embed_type="text_time", addition_time_embed_dim=8,
                                projection_class_embeddings_input_dim=6 * 8 + 24)
    scheduler = EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012,
                                       beta_schedule="scaled_linear", steps_offset=1,
                                       timestep_spacing="leading")
    pipe = StableDiffusionXLPipeline(vae=vae, text_encoder=te1, text_encoder_2=te2, tokenizer=tok,
                                     tokenizer_2=tok2, unet=unet, scheduler=scheduler,
                                     force_zeros_for_empty_prompt=True)
    pipe.save_pretrained(root)


def main():
    out, golden, fmnist = map(pathlib.Path, sys.argv[1:4])
    from diffusers.utils import logging as dlogging
    from transformers.utils import logging
    logging.set_verbosity_error()
    dlogging.set_verbosity_error()
    write_pipeline(out / "sd15", golden)
    write_pipeline_xl(out / "sdxl", golden)
    write_pipeline_by_convention(out / "sd15_conventional", golden)
    write_images(out / "images", fmnist)


if __name__ == "__main__":
    main()
