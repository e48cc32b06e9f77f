"""A state written by difftrain's Ema<WarmupDecay> loads into diffusers' EMAModel.

Runs the C++ test that replays the golden trajectory (it saves its EMA to the path given in
DIFFTRAIN_EMA_STATE_OUT), loads that file with torch.load(weights_only=True), hands it to
EMAModel.load_state_dict (shadows in the model's parameter order) and checks the shadows against
diffusers' own run. Usage: check_cpp_ema_state.py TEST_BINARY GOLDEN_DIR
"""
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import torch
from diffusers.training_utils import EMAModel

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from ref_ema import make_model  # noqa: E402


def main(binary, golden_dir):
    out = pathlib.Path(tempfile.mkdtemp()) / "ema_from_cpp.pt"
    env = dict(os.environ, DIFFTRAIN_EMA_STATE_OUT=str(out))
    subprocess.run([binary, "--gtest_filter=Ema.StateSavesByNameAndLoadsBack"], check=True, env=env)
    saved = torch.load(out, weights_only=True)
    assert saved["format"] == "difftrain.ema" and saved["version"] == 1, saved.keys()
    model = make_model()
    names = [n for n, _ in model.named_parameters()]
    ema = EMAModel(model.parameters())
    state = dict(saved["state"])
    state.pop("rule", None)
    state["shadow_params"] = [saved["shadow_params"][n] for n in names]
    ema.load_state_dict(state)
    assert ema.optimization_step == 200 and ema.use_ema_warmup is True, ema.state_dict().keys()
    want = json.loads((pathlib.Path(golden_dir) / "ema.json").read_text())["results"]["diffusers_warmup"]
    worst = 0.0
    for n, s in zip(names, ema.shadow_params):
        ref = torch.tensor(want[n], dtype=torch.float64)
        worst = max(worst, (s.double().flatten() - ref).abs().max().item())
    assert worst < 1e-6, worst
    print(f"diffusers EMAModel loaded difftrain's state: {len(names)} shadows, max |diff| {worst:.2e}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
