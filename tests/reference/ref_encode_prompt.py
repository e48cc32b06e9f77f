"""diffusers' encode_prompt for SD 1.x/2.x (StableDiffusionPipeline) and SDXL
(StableDiffusionXLPipeline), on tiny random pipelines with the SD vocabulary (the tokenizer folders
ref_clip_tokenizer.py writes): prompts short and past 77 tokens, classifier-free guidance with an
empty, a given or (SDXL) a zeroed negative prompt, clip_skip, num_images_per_prompt, SD 2's "!"
padding, SDXL's prompt_2. The text encoders are saved as transformers folders for the C++ test."""
import json
import pathlib

import torch
from safetensors.torch import save_file

LONG = ("a highly detailed painting of a castle on a hill at sunset, dramatic clouds, golden light, "
        "tiny figures walking along a winding road, a river in the valley below, birds in the sky, "
        "autumn trees with red and orange leaves, mist rising from the water, a stone bridge, "
        "mountains in the distance covered with snow, by a famous old master, museum quality")


def tiny_parts():
    from diffusers import AutoencoderKL, DDIMScheduler, UNet2DConditionModel
    vae = AutoencoderKL(block_out_channels=[4, 8], in_channels=3, out_channels=3,
                        down_block_types=["DownEncoderBlock2D"] * 2,
                        up_block_types=["UpDecoderBlock2D"] * 2, latent_channels=4, norm_num_groups=2)
    return vae, DDIMScheduler(), UNet2DConditionModel


def generate(out: pathlib.Path):
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline
    from diffusers.utils import logging as dlogging
    from transformers import (CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection,
                              CLIPTokenizer)
    from transformers.utils import logging
    logging.set_verbosity_error()
    dlogging.set_verbosity_error()
    root = out / "encode_prompt"
    root.mkdir(parents=True, exist_ok=True)
    tokdir = out / "clip_tokenizer"
    common = dict(vocab_size=49408, max_position_embeddings=77, bos_token_id=49406,
                  eos_token_id=49407, pad_token_id=1)
    torch.manual_seed(0)
    te1 = CLIPTextModel(CLIPTextConfig(hidden_size=32, intermediate_size=37, num_hidden_layers=3,
                                       num_attention_heads=4, projection_dim=32,
                                       hidden_act="quick_gelu", **common)).eval()
    te2 = CLIPTextModelWithProjection(CLIPTextConfig(hidden_size=40, intermediate_size=48,
                                                     num_hidden_layers=3, num_attention_heads=5,
                                                     projection_dim=24, hidden_act="gelu",
                                                     **common)).eval()
    # diffusers 0.42.1 reaches the final LayerNorm for clip_skip as text_encoder.text_model.
    # final_layer_norm, transformers 4's layout; transformers 5's CLIPTextModel has no text_model
    # attribute (an AttributeError there). The alias below, outside the module tree, lets
    # diffusers' formula run as it does with transformers 4.
    object.__setattr__(te1, "text_model", te1)
    te1.save_pretrained(root / "text_encoder")
    te2.save_pretrained(root / "text_encoder_2")
    tok = CLIPTokenizer.from_pretrained(str(tokdir / "sd15"))
    tok2 = CLIPTokenizer.from_pretrained(str(tokdir / "sd2"))  # pads with "!", as SDXL's second
    vae, scheduler, Unet = tiny_parts()
    unet = Unet(block_out_channels=(4, 8), layers_per_block=1, sample_size=8, in_channels=4,
                out_channels=4, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=32,
                norm_num_groups=2)
    sd = StableDiffusionPipeline(vae=vae, text_encoder=te1, tokenizer=tok, unet=unet,
                                 scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                 requires_safety_checker=False)
    sd2 = StableDiffusionPipeline(vae=vae, text_encoder=te1, tokenizer=tok2, unet=unet,
                                  scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                  requires_safety_checker=False)
    xl_unet = Unet(block_out_channels=(4, 8), layers_per_block=1, sample_size=8, in_channels=4,
                   out_channels=4, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                   up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=72,
                   norm_num_groups=2, addition_embed_type="text_time", addition_time_embed_dim=8,
                   projection_class_embeddings_input_dim=6 * 8 + 24)
    xl = StableDiffusionXLPipeline(vae=vae, text_encoder=te1, text_encoder_2=te2, tokenizer=tok,
                                   tokenizer_2=tok2, unet=xl_unet, scheduler=scheduler,
                                   force_zeros_for_empty_prompt=True)
    xl_no_zeros = StableDiffusionXLPipeline(vae=vae, text_encoder=te1, text_encoder_2=te2,
                                            tokenizer=tok, tokenizer_2=tok2, unet=xl_unet,
                                            scheduler=scheduler, force_zeros_for_empty_prompt=False)
    prompts = ["a photo of a cat", LONG]
    cases = [
        ("sd_plain", "sd", dict()),
        ("sd_negative", "sd", dict(negative_prompt=["blurry", "low quality, (bad)"])),
        ("sd_clip_skip_1", "sd", dict(clip_skip=1)),
        ("sd_clip_skip_2_images_2", "sd", dict(clip_skip=2, num_images_per_prompt=2)),
        ("sd_no_guidance", "sd", dict(do_classifier_free_guidance=False)),
        ("sd2_pad", "sd2", dict(negative_prompt=["ugly", "ugly"])),
        ("xl_zero_negative", "xl", dict()),
        ("xl_negative_prompt_2", "xl", dict(negative_prompt=["blurry", "dark"],
                                            prompt_2=["an oil painting", "a watercolor"])),
        ("xl_empty_negative", "xl_no_zeros", dict(clip_skip=1, num_images_per_prompt=2)),
    ]
    pipes = {"sd": sd, "sd2": sd2, "xl": xl, "xl_no_zeros": xl_no_zeros}
    tensors, meta = {}, []
    with torch.no_grad():
        for name, pipe_name, kw in cases:
            pipe = pipes[pipe_name]
            kw = dict(kw)
            cfg = kw.pop("do_classifier_free_guidance", True)
            n = kw.pop("num_images_per_prompt", 1)
            if pipe_name.startswith("xl"):
                pe, npe, pooled, npooled = pipe.encode_prompt(prompts, device="cpu",
                                                              num_images_per_prompt=n,
                                                              do_classifier_free_guidance=cfg, **kw)
                tensors[name + ".pooled_prompt_embeds"] = pooled.contiguous()
                tensors[name + ".negative_pooled_prompt_embeds"] = npooled.contiguous()
            else:
                pe, npe = pipe.encode_prompt(prompts, device="cpu", num_images_per_prompt=n,
                                             do_classifier_free_guidance=cfg, **kw)
            tensors[name + ".prompt_embeds"] = pe.contiguous()
            if npe is not None:
                tensors[name + ".negative_prompt_embeds"] = npe.contiguous()
            meta.append({"name": name, "pipeline": pipe_name, "guidance": cfg,
                         "num_images_per_prompt": n, **kw})
    # diffusers' load_textual_inversion: "<cat-toy>" and "<cat-toy>_1" added to the tokenizer,
    # two rows to the token table, then a prompt naming it.
    gen = torch.Generator().manual_seed(3)
    vectors = torch.randn(2, 32, generator=gen)
    sd.load_textual_inversion(vectors, token="<cat-toy>")
    ti_prompts = ["a photo of <cat-toy> on a beach", "<Cat-Toy>, oil painting"]
    with torch.no_grad():
        pe, _ = sd.encode_prompt(ti_prompts, device="cpu", num_images_per_prompt=1,
                                 do_classifier_free_guidance=False)
    tensors["ti.vectors"] = vectors
    tensors["ti.prompt_embeds"] = pe.contiguous()
    tensors["ti.input_ids"] = torch.tensor(
        sd.tokenizer(sd.maybe_convert_prompt(ti_prompts, sd.tokenizer), padding="max_length",
                     max_length=77, truncation=True)["input_ids"])
    meta_ti = {"prompts": ti_prompts, "table_rows": sd.text_encoder.get_input_embeddings().weight.shape[0],
               "token_ids": sd.tokenizer.convert_tokens_to_ids(["<cat-toy>", "<cat-toy>_1"])}
    save_file(tensors, root / "outputs.safetensors")
    (out / "encode_prompt.json").write_text(json.dumps({"prompts": prompts, "cases": meta,
                                                        "textual_inversion": meta_ti}, indent=1))
