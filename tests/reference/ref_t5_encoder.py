"""T5 encoders: transformers' T5EncoderModel on random tiny configurations (T5 v1.1's gated-gelu,
the original T5's relu, gated-silu; 1 to 3 layers; attention widths other than d_model; bucket
counts and maximum distances that the sequence lengths exceed, so the logarithmic buckets and
their clamp are used; a padding mask), saved as the folders users have (single file, shards, an
fp16 variant, the token table under encoder.embed_tokens as some files name it). For each: every
hidden state and the gradient of every parameter for a fixed loss, in float64 from the saved
weights. Also the published configurations' parameter names, shapes and counts (meta device):
T5 v1.1 small / base / XXL (the XXL encoder is SD3's and Flux's text_encoder_3 / text_encoder_2).
"""
import json
import pathlib

import torch
from safetensors.torch import load_file, save_file

CASES = [
    # name, config, batch, length, mask, layout
    ("gated_gelu", dict(vocab_size=60, d_model=32, d_kv=8, d_ff=40, num_layers=2, num_heads=4,
                        relative_attention_num_buckets=8, relative_attention_max_distance=20,
                        feed_forward_proj="gated-gelu"), 2, 12, True, "single"),
    ("relu_narrow", dict(vocab_size=45, d_model=24, d_kv=6, d_ff=37, num_layers=3, num_heads=3,
                         relative_attention_num_buckets=32, relative_attention_max_distance=16,
                         feed_forward_proj="relu", layer_norm_epsilon=1e-5),
     2, 40, False, "sharded"),
    ("gated_silu_fp16", dict(vocab_size=33, d_model=20, d_kv=16, d_ff=28, num_layers=1,
                             num_heads=2, relative_attention_num_buckets=6,
                             relative_attention_max_distance=10, feed_forward_proj="gated-silu"),
     3, 25, True, "fp16"),
    ("gated_gelu_embed_tokens", dict(vocab_size=70, d_model=30, d_kv=5, d_ff=44, num_layers=2,
                                     num_heads=5, relative_attention_num_buckets=12,
                                     relative_attention_max_distance=64,
                                     feed_forward_proj="gated-gelu"), 2, 9, False, "embed_tokens"),
]

PUBLISHED = {
    "t5_v1_1_small": dict(d_model=512, d_kv=64, d_ff=1024, num_layers=8, num_heads=6),
    "t5_v1_1_base": dict(d_model=768, d_kv=64, d_ff=2048, num_layers=12, num_heads=12),
    "t5_v1_1_xxl": dict(d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64),
}


def generate(out: pathlib.Path):
    from transformers import T5Config, T5EncoderModel
    from transformers.utils import logging
    logging.set_verbosity_error()
    root = out / "t5_encoders"
    root.mkdir(parents=True, exist_ok=True)
    golden = {"cases": [], "published": {}}
    for n, (name, cfg, b, l, masked, layout) in enumerate(CASES):
        torch.manual_seed(300 + n)
        config = T5Config(**cfg, dropout_rate=0.0, attn_implementation="eager")
        model = T5EncoderModel(config)
        with torch.no_grad():  # norms and the bias table away from their init
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
        if layout == "embed_tokens":  # the token table under the encoder's name only
            sd = load_file(folder / "model.safetensors")
            sd["encoder.embed_tokens.weight"] = sd.pop("shared.weight")
            save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})

        model = model.double()
        model.train()  # dropout 0: the same as eval, with gradients
        gen = torch.Generator().manual_seed(17 + n)
        ids = torch.randint(0, cfg["vocab_size"], (b, l), generator=gen)
        mask = None
        if masked:
            mask = torch.ones(b, l, dtype=torch.long)
            mask[0, -4:] = 0
            mask[-1, l // 2:] = 0
        out_ = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        io = {"input_ids": ids}
        if mask is not None:
            io["attention_mask"] = mask
        loss = 0
        for i, h in enumerate(out_.hidden_states):
            io[f"hidden_states.{i}"] = h.detach().clone()
            w = torch.randn(h.shape, generator=gen, dtype=torch.float64)
            io[f"w.{i}"] = w
            loss = loss + (h * w).sum()
        io["last_hidden_state"] = out_.last_hidden_state.detach()
        loss.backward()
        for k, p in model.named_parameters():
            io["grad." + k] = p.grad.detach().clone()
        save_file({k: v.contiguous() for k, v in io.items()}, root / f"{name}.io.safetensors")
        golden["cases"].append({"name": name, "masked": masked, "layers": cfg["num_layers"],
                                "hidden_states": len(out_.hidden_states),
                                "variant": "fp16" if layout == "fp16" else None})

    for name, cfg in PUBLISHED.items():
        with torch.device("meta"):
            config = T5Config(**cfg, vocab_size=32128, feed_forward_proj="gated-gelu",
                              relative_attention_num_buckets=32, relative_attention_max_distance=128)
            config.architectures = ["T5EncoderModel"]
            model = T5EncoderModel(config)
        golden["published"][name] = {
            "config": config.to_dict(),
            "shapes": {k: list(v.shape) for k, v in model.named_parameters()},
            "parameters": sum(p.numel() for p in model.parameters())}
    (out / "t5_encoders.json").write_text(json.dumps(golden, indent=1, default=str))
