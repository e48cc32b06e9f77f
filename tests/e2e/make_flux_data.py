"""Test data for finetune_transformer's Flux family, made here, never downloaded: a tiny Flux.1-dev
pipeline with random weights (diffusers' FluxPipeline.save_pretrained: a FluxTransformer2DModel
of 3 double- and 4 single-stream blocks with the guidance embedding, an AutoencoderKL with Flux's
scale and shift, CLIPTextModel with the SD vocabulary, a T5 encoder of the trained T5 tokenizer,
FlowMatchEulerDiscreteScheduler with dev's dynamic shifting), the same as schnell (no guidance
embedding) and the captioned image folder of make_text_to_image_data.py.

    make_flux_data.py OUT GOLDEN_DIR FASHION_MNIST_DIR
"""
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import make_text_to_image_data as t2i  # noqa: E402


def write_pipeline(root: pathlib.Path, golden: pathlib.Path, dev: bool):
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer, T5Config, T5EncoderModel, T5TokenizerFast
    torch.manual_seed(1 if dev else 2)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        hidden_size=24, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        vocab_size=49408, max_position_embeddings=77, bos_token_id=49406, eos_token_id=49407,
        pad_token_id=1, hidden_act="quick_gelu")).eval()
    tokenizer = CLIPTokenizer.from_pretrained(str(golden / "clip_tokenizer" / "sd15"))
    tokenizer_2 = T5TokenizerFast.from_pretrained(str(golden / "t5_tokenizer" / "t5_both"))
    text_encoder_2 = T5EncoderModel(T5Config(
        vocab_size=len(tokenizer_2), d_model=20, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
        feed_forward_proj="gated-gelu", dropout_rate=0.0)).eval()
    vae = AutoencoderKL(block_out_channels=[8, 16], in_channels=3, out_channels=3,
                        down_block_types=["DownEncoderBlock2D"] * 2,
                        up_block_types=["UpDecoderBlock2D"] * 2, latent_channels=4,
                        norm_num_groups=4, sample_size=32, scaling_factor=0.3611,
                        shift_factor=0.1159)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=3, num_single_layers=4, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=20, pooled_projection_dim=24,
        guidance_embeds=dev, axes_dims_rope=(4, 6, 6))
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0 if dev else 1.0, use_dynamic_shifting=dev, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096)
    FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                 text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2,
                 transformer=transformer).save_pretrained(root)


def main():
    out, golden, fmnist = map(pathlib.Path, sys.argv[1:4])
    from diffusers.utils import logging as dlogging
    from transformers.utils import logging
    logging.set_verbosity_error()
    dlogging.set_verbosity_error()
    write_pipeline(out / "flux_dev", golden, True)
    write_pipeline(out / "flux_schnell", golden, False)
    t2i.write_images(out / "images", fmnist)


if __name__ == "__main__":
    main()
