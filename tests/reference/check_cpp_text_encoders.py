"""CLIP text-encoder folders written by difftrain (CLIPTextModel, and CLIPTextModelWithProjection
as an fp16 variant) load in transformers' from_pretrained with no missing or unexpected weights
and give the outputs difftrain computed. Usage: check_cpp_text_encoders.py TEST_BINARY GOLDEN_DIR"""
import os
import pathlib
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file
from transformers import CLIPTextModel, CLIPTextModelWithProjection
from transformers.utils import logging


def main(binary, golden_dir):
    logging.set_verbosity_error()
    out = pathlib.Path(tempfile.mkdtemp())
    env = dict(os.environ, DIFFTRAIN_TEXT_OUT=str(out), DIFFTRAIN_GOLDEN_DIR=golden_dir)
    subprocess.run([binary, "--gtest_filter=ClipTextModel.SavedFoldersRoundTrip"], check=True,
                   env=env)
    t = load_file(out / "outputs.safetensors")
    for name, cls, variant, key in (("tiny_quick_gelu", CLIPTextModel, None, "pooler_output"),
                                    ("tiny_gelu_projection", CLIPTextModelWithProjection, "fp16",
                                     "text_embeds")):
        model, info = cls.from_pretrained(out / name, variant=variant, output_loading_info=True,
                                          dtype=torch.float32)
        bad = {k: v for k, v in info.items() if v}
        assert not bad, (name, bad)
        with torch.no_grad():
            o = model.eval()(t[name + ".input_ids"])
        for what, got in (("last_hidden_state", o.last_hidden_state), (key, getattr(o, key))):
            want = t[f"{name}.{what}"]
            err = (got - want).abs().max().item() / max(1.0, want.abs().max().item())
            assert err < 1e-5, (name, what, err)
            print(f"{name} {what}: transformers on difftrain's folder, max scaled error {err:.2e}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
