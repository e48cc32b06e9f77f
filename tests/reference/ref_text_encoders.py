"""CLIP text encoders: transformers' CLIPTextModel / CLIPTextModelWithProjection on random tiny
configurations (layer counts, heads, activations, projection widths, the old eos_token_id = 2
pooling, a padding mask), saved as the folders users have (single file, sharded, fp16 variant,
the text_model. prefix of older files). For each: every hidden state, the pooled output,
text_embeds, and the gradient of every parameter and of the token-embedding table for a fixed
loss, in float64 from the saved float32 (or float16) weights. Also the published configurations'
parameter names, shapes and counts (built on the meta device).
"""
import json
import pathlib

import torch
from safetensors.torch import load_file, save_file

CASES = [
    # name, config, batch, length, mask, layout
    ("tiny_quick_gelu", dict(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                             num_attention_heads=4, max_position_embeddings=16, projection_dim=8,
                             hidden_act="quick_gelu", eos_token_id=98, bos_token_id=97, pad_token_id=1),
     2, 16, False, "single", False),
    ("tiny_gelu_projection", dict(vocab_size=120, hidden_size=24, intermediate_size=48,
                                  num_hidden_layers=3, num_attention_heads=3,
                                  max_position_embeddings=12, projection_dim=20, hidden_act="gelu",
                                  eos_token_id=119, bos_token_id=118, pad_token_id=0,
                                  layer_norm_eps=1e-6),
     3, 10, False, "sharded", True),
    ("tiny_legacy_eos", dict(vocab_size=64, hidden_size=16, intermediate_size=40, num_hidden_layers=1,
                             num_attention_heads=2, max_position_embeddings=9, projection_dim=16,
                             hidden_act="quick_gelu", eos_token_id=2, bos_token_id=0, pad_token_id=1),
     2, 9, False, "prefixed", False),
    ("tiny_masked_fp16", dict(vocab_size=80, hidden_size=40, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=5, max_position_embeddings=20, projection_dim=12,
                              hidden_act="gelu_new", eos_token_id=79, bos_token_id=78, pad_token_id=79),
     2, 14, True, "fp16", True),
]

PUBLISHED = {
    # SD 1.x and SDXL's first encoder: OpenAI CLIP ViT-L/14.
    "clip_vit_l14": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                         num_attention_heads=12, projection_dim=768, hidden_act="quick_gelu"),
    # SD 2.x: OpenCLIP ViT-H/14 (23 layers: the last is dropped).
    "openclip_vit_h14": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=23,
                             num_attention_heads=16, projection_dim=512, hidden_act="gelu"),
    # SDXL's second encoder: OpenCLIP ViT-bigG/14 with its projection.
    "openclip_vit_bigg14": dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
                                num_attention_heads=20, projection_dim=1280, hidden_act="gelu"),
}


def ids_for(cfg, b, l, gen):
    ids = torch.randint(3, cfg["vocab_size"] - 3, (b, l), generator=gen)
    ids[:, 0] = cfg["bos_token_id"]
    eos = cfg["eos_token_id"]
    for i in range(b):
        end = l - 1 - i  # the end token at different places, padding after it
        ids[i, end] = eos if eos != 2 else cfg["vocab_size"] - 1
        ids[i, end + 1:] = cfg["pad_token_id"]
    return ids


def generate(out: pathlib.Path):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection
    from transformers.utils import logging
    logging.set_verbosity_error()
    root = out / "text_encoders"
    root.mkdir(parents=True, exist_ok=True)
    golden = {"cases": [], "published": {}}
    for n, (name, cfg, b, l, masked, layout, projection) in enumerate(CASES):
        torch.manual_seed(100 + n)
        config = CLIPTextConfig(**cfg, attn_implementation="sdpa")  # eager runs softmax in float32
        cls = CLIPTextModelWithProjection if projection else CLIPTextModel
        model = cls(config)
        with torch.no_grad():  # biases and norms away from their init, so every path is tested
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        folder = root / name
        if layout == "fp16":
            model.half().save_pretrained(folder, variant="fp16")
            model.float()
            model.load_state_dict({k: v.half().float() for k, v in model.state_dict().items()})
        elif layout == "sharded":
            model.save_pretrained(folder, max_shard_size="20KB")
        else:
            model.save_pretrained(folder)
        if layout == "prefixed":  # as the files in the wild: text_model. + position_ids
            sd = load_file(folder / "model.safetensors")
            sd = {("text_model." + k if not k.startswith("text_") else k): v for k, v in sd.items()}
            sd["text_model.embeddings.position_ids"] = torch.arange(cfg["max_position_embeddings"])[None]
            save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})

        model = model.double()
        gen = torch.Generator().manual_seed(7 + n)
        ids = ids_for(cfg, b, l, gen)
        mask = None
        if masked:
            mask = torch.ones(b, l, dtype=torch.long)
            mask[0, -3:] = 0
        kwargs = dict(input_ids=ids, output_hidden_states=True)
        if mask is not None:
            kwargs["attention_mask"] = mask
        out_ = model(**kwargs)
        w_last = torch.randn(out_.last_hidden_state.shape, generator=gen, dtype=torch.float64)
        loss = (out_.last_hidden_state * w_last).sum()
        io = {"input_ids": ids, "w_last": w_last,
              "last_hidden_state": out_.last_hidden_state.detach()}
        if projection:
            w_embeds = torch.randn(out_.text_embeds.shape, generator=gen, dtype=torch.float64)
            loss = loss + (out_.text_embeds * w_embeds).sum()
            io["w_embeds"] = w_embeds
            io["text_embeds"] = out_.text_embeds.detach()
        else:
            w_pooled = torch.randn(out_.pooler_output.shape, generator=gen, dtype=torch.float64)
            loss = loss + (out_.pooler_output * w_pooled).sum()
            io["w_pooled"] = w_pooled
            io["pooler_output"] = out_.pooler_output.detach()
        w_hidden = torch.randn(out_.hidden_states[-2].shape, generator=gen, dtype=torch.float64)
        loss = loss + (out_.hidden_states[-2] * w_hidden).sum()  # SDXL's penultimate layer
        io["w_hidden"] = w_hidden
        if mask is not None:
            io["attention_mask"] = mask
        for i, h in enumerate(out_.hidden_states):
            io[f"hidden_states.{i}"] = h.detach()
        loss.backward()
        prefix = "" if projection else "text_model."
        for k, p in model.named_parameters():
            io["grad." + prefix + k] = p.grad.detach().clone()
        save_file({k: v.contiguous() for k, v in io.items()}, root / f"{name}.io.safetensors")
        golden["cases"].append({"name": name, "projection": projection, "masked": masked,
                                "variant": "fp16" if layout == "fp16" else None,
                                "layers": cfg["num_hidden_layers"]})

    for name, cfg in PUBLISHED.items():
        for projection in (False, True):
            with torch.device("meta"):
                config = CLIPTextConfig(**cfg)
                model = (CLIPTextModelWithProjection if projection else CLIPTextModel)(config)
            prefix = "" if projection else "text_model."
            shapes = {prefix + k: list(v.shape) for k, v in model.state_dict().items()}
            key = name + ("_with_projection" if projection else "")
            golden["published"][key] = {
                "config": config.to_dict() | {"architectures": [type(model).__name__]},
                "shapes": shapes,
                "parameters": sum(p.numel() for p in model.parameters())}
    (out / "text_encoders.json").write_text(json.dumps(golden, indent=1, default=str))
