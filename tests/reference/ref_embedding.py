"""Textual-inversion embedding files as the web UI and diffusers write them (seed 001), and the web
UI's checksum of each vector set, restated: the web UI's .pt, a diffusers concept file
(learned_embeds.bin: one token -> one vector), an SDXL safetensors pair, and edge cases for the
checksum (negative values, values that truncate to zero)."""
import json

import torch
from safetensors.torch import save_file


def checksum(vec):
    def const_hash(a):
        r = 0
        for v in a:
            r = (r * 281 ^ int(v) * 997) & 0xFFFFFFFF
        return r
    return f'{const_hash(vec.reshape(-1) * 100) & 0xffff:04x}'


def generate(out):
    g = torch.Generator().manual_seed(17)
    vec = torch.randn(4, 32, generator=g)
    torch.save({"string_to_token": {"*": 265}, "string_to_param": {"*": vec}, "name": "my-style",
                "step": 2500, "sd_checkpoint": "7460a6fa", "sd_checkpoint_name": "sd-v1-4"},
               str(out / "embedding_webui.pt"))
    concept = torch.randn(32, generator=g)
    torch.save({"<cat-toy>": concept}, str(out / "embedding_concept.bin"))
    save_file({"clip_l": torch.randn(2, 16, generator=g), "clip_g": torch.randn(2, 24, generator=g)},
              str(out / "embedding_sdxl.safetensors"))
    cases = {"webui": vec, "concept": concept.unsqueeze(0),
             "negative": torch.tensor([[-0.5, -0.0049, 0.0099, 3.7, -12.34, 0.01]]),
             "large": torch.randn(16, 768, generator=g) * 3}
    torch.save(cases["large"], str(out / "embedding_large_vec.pt"))
    json.dump({"checksums": {k: checksum(v) for k, v in cases.items() if k != "large"} | {"large": checksum(cases["large"])},
               "negative": cases["negative"].flatten().tolist()},
              open(out / "embedding.json", "w"), indent=1)
