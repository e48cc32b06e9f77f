"""Test data for finetune_transformer, made here, never downloaded: a tiny Stable Diffusion 3
pipeline with random weights (diffusers' StableDiffusion3Pipeline.save_pretrained: an
SD3Transformer2DModel with SD3.5's qk norm and a dual-attention block, an AutoencoderKL with a
shift factor, two CLIPTextModelWithProjection with the SD vocabulary, a T5 encoder of the trained
T5 tokenizer, FlowMatchEulerDiscreteScheduler with shift 3), the same pipeline without T5, and the
captioned image folder of make_text_to_image_data.py.

    make_sd3_data.py OUT GOLDEN_DIR FASHION_MNIST_DIR
"""
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import make_text_to_image_data as t2i  # noqa: E402


def write_pipeline(root: pathlib.Path, golden: pathlib.Path, with_t5: bool):
    from diffusers import (AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel,
                           StableDiffusion3Pipeline)
    from transformers import (CLIPTextConfig, CLIPTextModelWithProjection, CLIPTokenizer, T5Config,
                              T5EncoderModel, T5TokenizerFast)
    torch.manual_seed(0)
    common = dict(vocab_size=49408, max_position_embeddings=77, bos_token_id=49406,
                  eos_token_id=49407, pad_token_id=1)
    te1 = CLIPTextModelWithProjection(CLIPTextConfig(
        hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        projection_dim=8, hidden_act="quick_gelu", **common)).eval()
    te2 = CLIPTextModelWithProjection(CLIPTextConfig(
        hidden_size=24, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        projection_dim=12, hidden_act="gelu", **common)).eval()
    tok1 = CLIPTokenizer.from_pretrained(str(golden / "clip_tokenizer" / "sd15"))
    tok2 = CLIPTokenizer.from_pretrained(str(golden / "clip_tokenizer" / "sd2"))
    tok3 = T5TokenizerFast.from_pretrained(str(golden / "t5_tokenizer" / "t5_both"))
    te3 = T5EncoderModel(T5Config(vocab_size=len(tok3), d_model=48, d_kv=8, d_ff=32, num_layers=2,
                                  num_heads=2, feed_forward_proj="gated-gelu",
                                  dropout_rate=0.0)).eval()
    vae = AutoencoderKL(block_out_channels=[8, 16], in_channels=3, out_channels=3,
                        down_block_types=["DownEncoderBlock2D"] * 2,
                        up_block_types=["UpDecoderBlock2D"] * 2, latent_channels=4,
                        norm_num_groups=4, sample_size=32, scaling_factor=1.5, shift_factor=0.06)
    transformer = SD3Transformer2DModel(
        sample_size=16, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=48, caption_projection_dim=16,
        pooled_projection_dim=20, out_channels=4, pos_embed_max_size=32, qk_norm="rms_norm",
        dual_attention_layers=(0,))
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=scheduler, vae=vae, text_encoder=te1, tokenizer=tok1,
        text_encoder_2=te2, tokenizer_2=tok2, text_encoder_3=te3 if with_t5 else None,
        tokenizer_3=tok3 if with_t5 else None)
    pipe.save_pretrained(root)


def main():
    out, golden, fmnist = map(pathlib.Path, sys.argv[1:4])
    from diffusers.utils import logging as dlogging
    from transformers.utils import logging
    logging.set_verbosity_error()
    dlogging.set_verbosity_error()
    write_pipeline(out / "sd3", golden, True)
    write_pipeline(out / "sd3_no_t5", golden, False)
    t2i.write_images(out / "images", fmnist)


if __name__ == "__main__":
    main()
