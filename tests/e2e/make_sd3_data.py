"""Test data for finetune_transformer, made here, never downloaded: a tiny Stable Diffusion 3
pipeline with random weights (diffusers' StableDiffusion3Pipeline.save_pretrained: an
SD3Transformer2DModel with SD3.5's qk norm and a dual-attention block, an AutoencoderKL with a
shift factor, two CLIPTextModelWithProjection with the SD vocabulary, a T5 encoder of the trained
T5 tokenizer, FlowMatchEulerDiscreteScheduler with shift 3), the same pipeline without T5, one whose
sizes keep SD3's conventions (a single file of it is read with configs told from its keys), the
tokenizers as files (CLIP's BPE merges, T5's spiece.model) and the captioned image folder of
make_text_to_image_data.py.

    make_sd3_data.py OUT GOLDEN_DIR FASHION_MNIST_DIR
"""
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import make_text_to_image_data as t2i  # noqa: E402


def write_pipeline(root: pathlib.Path, golden: pathlib.Path, with_t5: bool,
                   conventional: bool = False):
    """conventional: sizes that keep SD3's conventions (64 channels a head in the MMDiT, CLIP and
    T5; 32 groups in the VAE), which a single file's keys cannot tell: its single file is read
    with configs told from the keys alone."""
    from diffusers import (AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel,
                           StableDiffusion3Pipeline)
    from transformers import (CLIPTextConfig, CLIPTextModelWithProjection, CLIPTokenizer, T5Config,
                              T5EncoderModel, T5TokenizerFast)
    torch.manual_seed(0)
    common = dict(vocab_size=49408, max_position_embeddings=77, bos_token_id=49406,
                  eos_token_id=49407, pad_token_id=1)
    w1, w2, heads = (64, 64, 1) if conventional else (16, 24, 2)
    t5_width = 128 if conventional else 48  # at least the CLIP widths together
    te1 = CLIPTextModelWithProjection(CLIPTextConfig(
        hidden_size=w1, intermediate_size=24, num_hidden_layers=2, num_attention_heads=heads,
        projection_dim=8, hidden_act="quick_gelu", **common)).eval()
    te2 = CLIPTextModelWithProjection(CLIPTextConfig(
        hidden_size=w2, intermediate_size=32, num_hidden_layers=2, num_attention_heads=heads,
        projection_dim=12, hidden_act="gelu", **common)).eval()
    tok1 = CLIPTokenizer.from_pretrained(str(golden / "clip_tokenizer" / "sd15"))
    tok2 = CLIPTokenizer.from_pretrained(str(golden / "clip_tokenizer" / "sd2"))
    tok3 = T5TokenizerFast.from_pretrained(str(golden / "t5_tokenizer" / "t5_both"))
    te3 = T5EncoderModel(T5Config(vocab_size=len(tok3), d_model=t5_width, d_kv=64 if conventional else 8,
                                  d_ff=32, num_layers=2, num_heads=heads,
                                  feed_forward_proj="gated-gelu", dropout_rate=0.0)).eval()
    # (SD3's VAE scale and shift where the keys tell nothing else)
    vae = AutoencoderKL(block_out_channels=[32, 32] if conventional else [8, 16], in_channels=3,
                        out_channels=3, down_block_types=["DownEncoderBlock2D"] * 2,
                        up_block_types=["UpDecoderBlock2D"] * 2, latent_channels=4,
                        norm_num_groups=32 if conventional else 4, sample_size=32,
                        scaling_factor=1.5305 if conventional else 1.5,
                        shift_factor=0.0609 if conventional else 0.06)
    transformer = SD3Transformer2DModel(
        sample_size=16, patch_size=2, in_channels=4, num_layers=2,
        attention_head_dim=64 if conventional else 8, num_attention_heads=heads,
        joint_attention_dim=t5_width, caption_projection_dim=64 if conventional else 16,
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
    write_pipeline(out / "sd3_conventional", golden, True, conventional=True)
    # What a single file's user has instead of tokenizer folders: OpenAI's BPE merges file, as
    # open_clip ships it (gzipped), and T5's SentencePiece model.
    import gzip
    import shutil
    merges = (golden / "clip_tokenizer" / "sd15" / "merges.txt").read_bytes()
    (out / "bpe_simple_vocab_16e6.txt.gz").write_bytes(gzip.compress(merges))
    shutil.copy(golden / "t5_tokenizer" / "t5_both" / "spiece.model", out / "spiece.model")
    t2i.write_images(out / "images", fmnist)


if __name__ == "__main__":
    main()
