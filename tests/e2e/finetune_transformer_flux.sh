#!/usr/bin/env bash
# finetune_transformer end to end on tiny Flux.1 pipelines (dev with the guidance embedding,
# schnell without) that make_flux_data.py writes: mistakes are refused before any work; a LoRA at
# alpha ≠ rank on diffusers' targets trains (its loss falls) and diffusers' FluxPipeline, given
# difftrain's file and the same starting noise, draws the validation image difftrain drew; the same
# in kohya's Flux layout (lora_unet_double_blocks_...) through diffusers' kohya converter; kohya's
# memory options (fp8 base weights, block swapping, checkpointed blocks) end with the LoRA of the
# run without swapping to the bit, also when stopped and resumed; schnell fully fine-tuned writes
# a pipeline folder that FluxPipeline loads and draws the same image from; dev fully fine-tuned
# as one file in Black Forest Labs' layout, which diffusers' converter reads, and trained again
# from it.
#
#   finetune_transformer_flux.sh PROGRAM PYTHON GOLDEN_DIR WORKDIR [FASHION_MNIST_DIR]
set -uo pipefail
bin=$1 py=$2 golden=$3 work=$4 fmnist=${5:-/usr/share/datasets/fashion-mnist}
rm -rf "$work" && mkdir -p "$work"
# shellcheck source=common.sh
source "$(dirname "$0")/common.sh"
here=$(dirname "$0")
"$py" "$here/make_flux_data.py" "$work/data" "$golden" "$fmnist" >"$work/make.out" 2>&1 ||
  { cat "$work/make.out"; echo "FAIL: making the test data"; exit 1; }
dev=$work/data/flux_dev schnell=$work/data/flux_schnell
base=(--pretrained_model_name_or_path "$dev" --train_data_dir "$work/data/images" --resolution 32
      --train_batch_size 4 --seed 3 --num_inference_steps 3 --num_validation_images 1
      --dataloader_num_workers 2 --threads 1 --center_crop)

# Mistakes, each refused with a typed error naming it, before training.
expect_rc 2 swap-too-many -- "$bin" "${base[@]}" --use_lora --blocks_to_swap 3 --output_dir "$work/bad"
grep_in "$work/swap-too-many.err" "at most 2"
expect_rc 2 swap-full -- "$bin" "${base[@]}" --blocks_to_swap 2 --output_dir "$work/bad"
grep_in "$work/swap-full.err" "--blocks_to_swap"
expect_rc 2 fp8-full -- "$bin" "${base[@]}" --fp8_base --output_dir "$work/bad"
grep_in "$work/fp8-full.err" "--fp8_base"
expect_rc 2 precondition -- "$bin" "${base[@]}" --use_lora --precondition_outputs 1 --output_dir "$work/bad"
grep_in "$work/precondition.err" "--precondition_outputs"
expect_rc 2 format -- "$bin" "${base[@]}" --use_lora --lora_format comfy --output_dir "$work/bad"
grep_in "$work/format.err" "--lora_format"
expect_rc 2 layers -- "$bin" "${base[@]}" --use_lora --lora_layers "attn.nowhere" --output_dir "$work/bad"
grep_in "$work/layers.err" "--lora_layers"
expect_rc 2 schnell-tokens -- "$bin" "${base[@]}" --pretrained_model_name_or_path "$schnell" \
  --max_sequence_length 512 --output_dir "$work/bad"
grep_in "$work/schnell-tokens.err" "256"
[ -e "$work/bad" ] && fail "a refused run left an output folder"

# LoRA on diffusers' targets at alpha 8, rank 4; in kohya's layout on the double blocks (diffusers'
# kohya converter reads single blocks of Flux.1's full width only) at alpha 2.
prompt=(--validation_prompt "a photo of a sneaker")
expect_rc 0 lora -- "$bin" "${base[@]}" --use_lora --rank 4 --lora_alpha 8 --learning_rate 2e-3 \
  --max_train_steps 16 "${prompt[@]}" --output_dir "$work/lora"
expect_rc 0 kohya -- "$bin" "${base[@]}" --use_lora --rank 4 --lora_alpha 2 --learning_rate 2e-3 \
  --max_train_steps 8 --lora_format kohya "${prompt[@]}" --output_dir "$work/kohya" --lora_layers \
  "attn.add_q_proj,attn.add_k_proj,attn.add_v_proj,attn.to_add_out,ff.net.0.proj,ff.net.2,ff_context.net.0.proj,ff_context.net.2,transformer_blocks.1.attn.to_q,transformer_blocks.1.attn.to_k,transformer_blocks.1.attn.to_v,transformer_blocks.1.attn.to_out.0"
grep_in "$work/kohya/results.json" '"kohya": "flux_lora.safetensors"'

# fp8 base weights with checkpointed blocks; the same with 2 blocks swapped (1 double, 2 single),
# straight through and stopped at step 4 and resumed: the same LoRA, to the bit.
mem=("${base[@]}" --use_lora --rank 4 --learning_rate 2e-3 --max_train_steps 6 --checkpointing_steps 2
     --gradient_checkpointing --fp8_base)
expect_rc 0 fp8 -- "$bin" "${mem[@]}" --output_dir "$work/fp8"
expect_rc 0 swap -- "$bin" "${mem[@]}" --blocks_to_swap 2 --output_dir "$work/swap"
expect_rc 130 swap-stopped -- "$bin" "${mem[@]}" --blocks_to_swap 2 --output_dir "$work/swap-resumed" --stop_at 4
expect_rc 0 swap-resumed -- "$bin" "${mem[@]}" --blocks_to_swap 2 --output_dir "$work/swap-resumed" \
  --resume_from_checkpoint latest
for run in swap swap-resumed; do
  cmp -s "$work/fp8/pytorch_lora_weights.safetensors" "$work/$run/pytorch_lora_weights.safetensors" ||
    fail "$run ended with another LoRA than the run without swapping"
done
grep_in "$work/swap/results.json" '"swapped_blocks": 3'
grep_in "$work/fp8/results.json" '"fp8_base": true'

# schnell, fully fine-tuned: a pipeline folder.
expect_rc 0 schnell-full -- "$bin" "${base[@]}" --pretrained_model_name_or_path "$schnell" \
  --learning_rate 5e-4 --max_train_steps 6 --gradient_checkpointing "${prompt[@]}" \
  --output_dir "$work/schnell-full"
grep_in "$work/schnell-full/results.json" '"flux": "schnell"'

# dev fully fine-tuned as one file in Black Forest Labs' layout (ComfyUI's diffusion model), then
# trained again from that file (its configs from --single_file_config), written back as one.
expect_rc 0 file -- "$bin" "${base[@]}" --learning_rate 5e-4 --max_train_steps 4 "${prompt[@]}" \
  --save_format single_file --output_dir "$work/file"
grep_in "$work/file/results.json" '"single_file": "flux_transformer.safetensors"'
expect_rc 0 from-file -- "$bin" "${base[@]}" --pretrained_model_name_or_path "$work/file/flux_transformer.safetensors" \
  --single_file_config "$dev" --learning_rate 5e-4 --max_train_steps 2 --output_dir "$work/from-file"
grep_in "$work/from-file/results.json" '"single_file": "flux_transformer.safetensors"'
expect_rc 2 file-alone -- "$bin" "${base[@]}" --pretrained_model_name_or_path "$work/file/flux_transformer.safetensors" \
  --output_dir "$work/bad2"
grep_in "$work/file-alone.err" "--single_file_config"
expect_rc 2 file-lora -- "$bin" "${base[@]}" --use_lora --save_format single_file --output_dir "$work/bad2"
grep_in "$work/file-lora.err" "--save_format single_file"

"$py" - "$work" >"$work/python.out" 2>&1 <<'PY' || { cat "$work/python.out"; fail "Python check"; }
import json, math, pathlib, sys
import numpy as np, torch
from PIL import Image
from diffusers import FluxPipeline
from diffusers.utils import logging as dlogging
dlogging.set_verbosity_error()
work = pathlib.Path(sys.argv[1])
r = json.loads((work / "lora" / "results.json").read_text())
assert r["finished"] and r["last_loss"] < r["first_loss"], r
assert (r["guidance_scale"], r["max_sequence_length"], r["weighting_scheme"]) == (3.5, 512, "none"), r
print(f"LoRA: loss {r['first_loss']:.4f} -> {r['last_loss']:.4f}")

def generate(pipe, tokens):
    # The noise difftrain's validation starts from: a CPU generator seeded with --seed + 7.
    noise = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(3 + 7))
    latents = FluxPipeline._pack_latents(noise, 1, 4, 16, 16)
    return pipe("a photo of a sneaker", num_inference_steps=3, guidance_scale=3.5, height=32,
                width=32, latents=latents, output_type="np", max_sequence_length=tokens).images[0]

def validation_image(run):
    image = np.asarray(Image.open(work / run / "validation" / "image-0.png").convert("RGB"))
    pad = (image.shape[0] - 32) // 2  # the grid's border
    return image[pad:pad + 32, pad:pad + 32].astype(np.int64)

for run, weight in (("lora", "pytorch_lora_weights.safetensors"), ("kohya", "flux_lora.safetensors")):
    pipe = FluxPipeline.from_pretrained(str(work / "data" / "flux_dev"))
    plain = generate(pipe, 512)
    pipe.load_lora_weights(str(work / run), weight_name=weight)
    adapted = generate(pipe, 512)
    effect = float(np.abs(adapted - plain).max())
    assert effect > 1e-3, f"{run}: the LoRA changes nothing ({effect})"
    diff = np.abs(validation_image(run) - np.round(adapted * 255).astype(np.int64)).max()
    print(f"{run}: FluxPipeline with difftrain's {weight} vs difftrain's validation image: "
          f"max difference {diff}/255 (the LoRA moves the image by {effect * 255:.1f}/255)")
    assert diff <= 1, diff
if True:
    fresh = FluxPipeline.from_pretrained(str(work / "data" / "flux_schnell"))
    full = FluxPipeline.from_pretrained(str(work / "schnell-full"))
    trained = dict(full.transformer.named_parameters())
    moved = sum(not torch.equal(p, trained[n]) for n, p in fresh.transformer.named_parameters())
    assert moved > 0, "the full fine-tuning changed no weight"
    diff = np.abs(validation_image("schnell-full") - np.round(generate(full, 256) * 255).astype(np.int64)).max()
    print(f"schnell, full fine-tuning: {moved} tensors changed; the image differs by at most {diff}/255")
    assert diff <= 1, diff
# diffusers' own Flux converter (its widths set to the tiny model's: it assumes Flux.1's 3072)
# reads difftrain's single file, and FluxPipeline with it draws difftrain's validation image.
import inspect
from diffusers import FluxTransformer2DModel
import diffusers.loaders.single_file_utils as sfu
from safetensors.torch import load_file
config = FluxTransformer2DModel.load_config(str(work / "data" / "flux_dev" / "transformer"))
width = config["num_attention_heads"] * config["attention_head_dim"]
source = inspect.getsource(sfu.convert_flux_transformer_checkpoint_to_diffusers)
assert "inner_dim = 3072" in source
space = {}
exec(source.replace("inner_dim = 3072", f"inner_dim = {width}"), sfu.__dict__, space)
converted = space["convert_flux_transformer_checkpoint_to_diffusers"](
    load_file(work / "file" / "flux_transformer.safetensors"))
transformer = FluxTransformer2DModel.from_config(config)
transformer.load_state_dict(converted, strict=True)
pipe = FluxPipeline.from_pretrained(str(work / "data" / "flux_dev"), transformer=transformer)
diff = np.abs(validation_image("file") - np.round(generate(pipe, 512) * 255).astype(np.int64)).max()
print(f"single file: diffusers' converter reads it; FluxPipeline's image differs by {diff}/255")
assert diff <= 1, diff
PY
cat "$work/python.out"
for run in lora kohya schnell-full; do
  [ -s "$work/$run/validation.png" ] || fail "$run wrote no validation.png"
  ls "$work/$run/tensorboard"/events.out.tfevents.* >/dev/null 2>&1 || fail "$run wrote no event file"
done
[ "$failures" -eq 0 ] && echo "finetune_transformer Flux end to end: ok" || exit 1
