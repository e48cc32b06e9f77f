#!/usr/bin/env bash
# The UNet fine-tuning example end to end on diffusers' own tiny UNet and VAE folders (made by
# tests/reference/ref_models.py with save_pretrained): bad folders and flags are typed errors, a
# short v-prediction run with min-SNR writes the LoRA in both layouts and the sample grid, and
# diffusers' lora_state_dict reads both files onto the UNet's attention projections.
#
# With the unit-test binary (TESTS), the same UNet and VAE as one single file (the web UI's layout,
# written by that binary's single-file test) train to the same LoRA as the folders.
#
#   finetune_unet.sh PROGRAM PYTHON GOLDEN_DIR WORKDIR [DATA_DIR] [TESTS]
set -uo pipefail
bin=$1 py=$2 golden=$3 work=$4 data=${5:-/usr/share/datasets/fashion-mnist} tests_bin=${6:-}
rm -rf "$work" && mkdir -p "$work"
# shellcheck source=common.sh
source "$(dirname "$0")/common.sh"
unet=$golden/models/unet_conv_proj vae=$golden/models/vae_two_levels

cat >"$work/scheduler_config.json" <<'JSON'
{"_class_name": "DDPMScheduler", "num_train_timesteps": 1000, "beta_start": 0.00085,
 "beta_end": 0.012, "beta_schedule": "scaled_linear", "prediction_type": "v_prediction",
 "clip_sample": false, "steps_offset": 1}
JSON
tiny=(--data-dir "$data" --classes 2 --images 8 --batch 4 --sample-steps 3 --samples-per-class 3
      --seed 5)

expect_rc 0 help -- "$bin" --help
grep_in "$work/help.out" "--learning_rate"
expect_rc 2 no-folder -- "$bin" "${tiny[@]}" --resolution 16 --unet "$work/nowhere" --vae "$vae" --out "$work/bad"
grep_in "$work/no-folder.err" "not a folder"
expect_rc 2 swapped -- "$bin" "${tiny[@]}" --resolution 16 --unet "$vae" --vae "$unet" --out "$work/bad"
grep_in "$work/swapped.err" "holds a"
expect_rc 2 resolution -- "$bin" "${tiny[@]}" --resolution 15 --unet "$unet" --vae "$vae" --out "$work/bad"
grep_in "$work/resolution.err" "--resolution"
expect_rc 2 prediction -- "$bin" "${tiny[@]}" --resolution 16 --prediction-type flow --unet "$unet" --vae "$vae" --out "$work/bad"
grep_in "$work/prediction.err" "prediction_type"

if [ -n "$tests_bin" ]; then
  DIFFTRAIN_MODELS_OUT="$work/single" DIFFTRAIN_GOLDEN_DIR="$golden" "$tests_bin" \
    --gtest_filter='SingleFile.Sd1ComponentsRoundTrip*' >"$work/single-make.out" 2>&1 ||
    fail "writing the single file"
  mkdir -p "$work/single_config" && cp -r "$unet" "$work/single_config/unet" && cp -r "$vae" "$work/single_config/vae"
  expect_rc 0 folder-short -- "$bin" "${tiny[@]}" --resolution 16 --unet "$unet" --vae "$vae" --steps 4 \
    --out "$work/folder-short"
  expect_rc 0 single -- "$bin" "${tiny[@]}" --resolution 16 --unet "$work/single/sd1_single.safetensors" \
    --single_file_config "$work/single_config" --steps 4 --out "$work/single-run"
  "$py" - "$work/folder-short" "$work/single-run" >"$work/single-compare.out" 2>&1 <<'PY' || { fail "the single-file run's LoRA is not the folder run's"; cat "$work/single-compare.out"; }
import sys
from safetensors.torch import load_file
a, b = (load_file(f"{d}/pytorch_lora_weights.safetensors") for d in sys.argv[1:3])
assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a), "the LoRA differ"
print(f"single file and folders: the same {len(a)} LoRA tensors")
PY
  expect_rc 2 config-without-file -- "$bin" "${tiny[@]}" --resolution 16 --unet "$unet" --vae "$vae" \
    --single_file_config "$work/single_config" --out "$work/bad"
  grep_in "$work/config-without-file.err" "goes with a single file"
fi

expect_rc 0 full -- "$bin" "${tiny[@]}" --resolution 16 --unet "$unet" --vae "$vae" --steps 30 --snr-gamma 5 --alpha 12 \
  --scheduler-config "$work/scheduler_config.json" --out "$work/run"
for f in pytorch_lora_weights.safetensors lora_kohya.safetensors samples.png results.json; do
  [ -s "$work/run/$f" ] || fail "the run did not write $f"
done
grep_in "$work/run/results.json" '"prediction_type": "v_prediction"'
grep_in "$work/full.out" "LoRA on 32 layers"
"$py" - "$work/run" "$unet" >"$work/python.out" 2>&1 <<'PY' || { fail "Python check"; cat "$work/python.out"; }
import json, math, pathlib, sys
import torch
from diffusers import UNet2DConditionModel
from diffusers.utils import logging as diffusers_logging
diffusers_logging.set_verbosity_error()
from diffusers.loaders.lora_pipeline import StableDiffusionLoraLoaderMixin as Loader
from safetensors.torch import load_file
run, unet_dir = pathlib.Path(sys.argv[1]), sys.argv[2]
results = json.loads((run / "results.json").read_text())
assert math.isfinite(results["first_loss"]) and math.isfinite(results["last_loss"]), results
unet = UNet2DConditionModel.from_pretrained(unet_dir)
linear = {n for n, m in unet.named_modules() if isinstance(m, torch.nn.Linear)}
for name in ("pytorch_lora_weights.safetensors", "lora_kohya.safetensors"):
    sd, alphas = Loader.lora_state_dict(load_file(run / name))
    modules = set()
    for key in sd:
        key = key[len("unet."):]
        if ".processor." in key:
            module, rest = key.split(".processor.")
            proj = rest.split("_lora.")[0]
            modules.add(f"{module}.{'to_out.0' if proj == 'to_out' else proj}")
        else:
            modules.add(key.rsplit(".lora_", 1)[0])
    assert len(modules) == 32 and modules <= linear, sorted(modules - linear)[:5]
    print(f"{name}: {len(sd)} tensors on {len(modules)} of diffusers' Linear layers")
# Rank 4 at alpha 12: diffusers' load_lora_weights gives one UNet from either file (the PEFT
# file's scale from its adapter metadata, the kohya file's from its alpha tensors).
from diffusers.loaders.lora_pipeline import StableDiffusionLoraLoaderMixin
class Pipeline(StableDiffusionLoraLoaderMixin):
    hf_device_map = None
    def __init__(self, unet):
        self.unet, self.text_encoder = unet, None
    @property
    def components(self):
        return {"unet": self.unet}
torch.manual_seed(0)
cfg = unet.config
x = torch.randn(2, cfg.in_channels, 8, 8)
ctx = torch.randn(2, 5, cfg.cross_attention_dim if isinstance(cfg.cross_attention_dim, int) else cfg.cross_attention_dim[0])
outs = {}
for name in ("pytorch_lora_weights.safetensors", "lora_kohya.safetensors"):
    u = UNet2DConditionModel.from_pretrained(unet_dir).eval()
    Pipeline(u).load_lora_weights(str(run), weight_name=name)
    with torch.no_grad():
        outs[name] = u(x, torch.tensor([10, 500]), ctx).sample
with torch.no_grad():
    plain = UNet2DConditionModel.from_pretrained(unet_dir).eval()(x, torch.tensor([10, 500]), ctx).sample
a, b = outs.values()
worst, effect = (a - b).abs().max().item(), (a - plain).abs().max().item()
assert effect > 1e-4 and worst <= 1e-5 * max(1.0, effect), (worst, effect)
print(f"rank 4, alpha 12: the PEFT and the kohya file give one UNet ({worst:.1e} apart; the LoRA's effect {effect:.2e})")
PY
cat "$work/python.out"
[ "$failures" -eq 0 ] && echo "finetune_unet end to end: ok" || exit 1
