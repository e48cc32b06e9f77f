#!/usr/bin/env bash
# train_text_to_image end to end on a tiny SD 1.x pipeline and a captioned image folder that
# make_text_to_image_data.py writes (diffusers' and transformers' save_pretrained, Fashion-MNIST
# items as JPEG/PNG/WebP with EXIF orientations, a damaged file): mistakes are refused before any
# work; LoRA on the UNet and the text encoder with cached latents trains, its loss falls, a run
# stopped half way and resumed ends with the same weights as one that was not; full fine-tuning
# with EMA and min-SNR writes a pipeline folder; diffusers loads both (load_lora_weights with
# peft, StableDiffusionPipeline.from_pretrained) and generates with them. The same for SDXL: LoRA
# on the UNet and both text encoders over aspect-ratio buckets, loaded by StableDiffusionXLPipeline;
# a full SDXL fine-tune as one file, loaded by from_single_file and trained again from.
# Under torchrun with 2 ranks: DataParallel, and ZeRO stages 2 and 1 across a stop and a resume,
# end with the same LoRA; one process resumes the 2-rank checkpoint set when told to.
#
#   train_text_to_image.sh PROGRAM PYTHON GOLDEN_DIR WORKDIR [FASHION_MNIST_DIR]
set -uo pipefail
bin=$1 py=$2 golden=$3 work=$4 fmnist=${5:-/usr/share/datasets/fashion-mnist}
rm -rf "$work" && mkdir -p "$work"
# shellcheck source=common.sh
source "$(dirname "$0")/common.sh"
here=$(dirname "$0")
"$py" "$here/make_text_to_image_data.py" "$work/data" "$golden" "$fmnist" >"$work/make.out" 2>&1 ||
  { cat "$work/make.out"; echo "FAIL: making the test data"; exit 1; }
sd=$work/data/sd15 xl=$work/data/sdxl images=$work/data/images
# An SDXL pipeline whose UNet is SD 1.x's: refused by name.
mkdir -p "$work/mixed" && cp -r "$xl"/. "$work/mixed/" && rm -rf "$work/mixed/unet" && cp -r "$sd/unet" "$work/mixed/unet"
base=(--pretrained_model_name_or_path "$sd" --train_data_dir "$images" --resolution 32
      --train_batch_size 4 --seed 3 --num_inference_steps 3 --num_validation_images 2
      --dataloader_num_workers 2 --threads 1)
# One intra-op thread: runs compared to the bit must sum in the same order (with --threads 0 the
# count follows the machine's load, which differs between the runs of a loaded test machine).

# Mistakes, each refused with a typed error naming it, before training.
expect_rc 0 help -- "$bin" --help
grep_in "$work/help.out" "--pretrained_model_name_or_path"
expect_rc 2 no-pipeline -- "$bin" "${base[@]}" --pretrained_model_name_or_path "$images" --output_dir "$work/bad"
grep_in "$work/no-pipeline.err" "model_index.json"
expect_rc 2 caption-column -- "$bin" "${base[@]}" --caption_column prompt --output_dir "$work/bad"
grep_in "$work/caption-column.err" "prompt"
mkdir -p "$work/empty"
expect_rc 2 empty-folder -- "$bin" "${base[@]}" --train_data_dir "$work/empty" --output_dir "$work/bad"
expect_rc 2 cache-random-crop -- "$bin" "${base[@]}" --cache_latents --output_dir "$work/bad"
grep_in "$work/cache-random-crop.err" "--center_crop"
expect_rc 2 te-without-lora -- "$bin" "${base[@]}" --train_text_encoder --output_dir "$work/bad"
grep_in "$work/te-without-lora.err" "--use_lora"
expect_rc 2 prediction -- "$bin" "${base[@]}" --prediction_type flow --output_dir "$work/bad"
grep_in "$work/prediction.err" "prediction_type"
expect_rc 2 scheduler -- "$bin" "${base[@]}" --lr_scheduler cosine_warmup --output_dir "$work/bad"
grep_in "$work/scheduler.err" "at --lr_scheduler"
grep_in "$work/scheduler.err" "cosine_warmup"
# A mistake found once the run has started (a pipeline folder without its tokenizer) leaves no
# output folder behind.
mkdir -p "$work/no-tokenizer" && cp -r "$sd"/. "$work/no-tokenizer/" && rm -rf "$work/no-tokenizer/tokenizer"
expect_rc 2 no-tokenizer -- "$bin" "${base[@]}" --pretrained_model_name_or_path "$work/no-tokenizer" \
  --output_dir "$work/refused/out"
grep_in "$work/no-tokenizer.err" "tokenizer"
[ -e "$work/refused" ] && fail "a run refused after start-up left its output folder behind"
# An image without a caption of its own trains under its file name, said so; --require_captions
# refuses it by name.
mkdir -p "$work/uncaptioned" && cp -r "$images"/. "$work/uncaptioned/"
first=$(ls "$images" | grep -E '\.(png|jpg|webp)$' | grep -v '^broken' | head -n 1)
cp "$images/$first" "$work/uncaptioned/zz_no_caption.${first##*.}"
expect_rc 2 require-captions -- "$bin" "${base[@]}" --train_data_dir "$work/uncaptioned" \
  --require_captions --output_dir "$work/bad"
grep_in "$work/require-captions.err" "1 of 25 images have no caption of their own"
grep_in "$work/require-captions.err" "zz_no_caption"
[ -e "$work/bad/checkpoints" ] && fail "a refused run left checkpoints"

# LoRA on the UNet and the text encoder at alpha != rank (scale 0.5, which only the PEFT file's
# adapter metadata tells diffusers), cached latents and flips: once straight through, once
# stopped at step 20 and resumed.
lora=("${base[@]}" --use_lora --train_text_encoder --rank 4 --lora_alpha 2 --cache_latents --center_crop
      --random_flip --learning_rate 2e-3 --max_train_steps 40 --checkpointing_steps 10
      --validation_prompt "a photo of a sneaker")
expect_rc 0 lora -- "$bin" "${lora[@]}" --output_dir "$work/lora"
grep_in "$work/lora.err" "skipped .*broken.jpg"
expect_rc 130 lora-stopped -- "$bin" "${lora[@]}" --output_dir "$work/lora-resumed" --stop_at 20
expect_rc 2 lora-again -- "$bin" "${lora[@]}" --output_dir "$work/lora-resumed"
grep_in "$work/lora-again.err" "--resume_from_checkpoint"
expect_rc 0 lora-resumed -- "$bin" "${lora[@]}" --output_dir "$work/lora-resumed" --resume_from_checkpoint latest
grep_in "$work/lora-resumed.err" "continuing from .*checkpoint-20.pt"
grep_in "$work/lora-resumed/results.json" '"reused": 48'
# A second run on the same cache folder encodes nothing.
expect_rc 0 lora-cached -- "$bin" "${lora[@]}" --max_train_steps 2 --output_dir "$work/lora-cached" --cache_dir "$work/lora/cache"
grep_in "$work/lora-cached/results.json" '"encoded": 0'
# diffusers' other run flags: epochs instead of steps (24 images, batches of 4: 6 steps an epoch),
# bf16 autocast, gradient checkpointing; an unknown reporter is refused.
expect_rc 0 epochs -- "$bin" "${lora[@]}" --max_train_steps 0 --num_train_epochs 1 --mixed_precision bf16 \
  --gradient_checkpointing --output_dir "$work/epochs" --cache_dir "$work/lora/cache"
grep_in "$work/epochs/results.json" '"steps": 6,'
grep_in "$work/epochs/results.json" '"mixed_precision": "bf16"'
expect_rc 2 report-to -- "$bin" "${lora[@]}" --report_to wandb --output_dir "$work/bad"
grep_in "$work/report-to.err" "--report_to"

# kohya's caption, noise and loss options together (LoRA, frozen text encoder: its outputs are
# encoded each step, as the captions change): stopped at step 6 and resumed, it ends with the LoRA
# of the run straight through (the caption draws follow the batch's place, the noise the saved
# generator); mistakes in them are named.
kohya=("${base[@]}" --use_lora --rank 4 --learning_rate 2e-3 --max_train_steps 12 --checkpointing_steps 3
       --shuffle_caption --keep_tokens 1 --caption_tag_dropout_rate 0.2 --caption_dropout_rate 0.1
       --noise_offset 0.05 --adaptive_noise_scale 0.01 --multires_noise_iterations 4
       --multires_noise_discount 0.3 --ip_noise_gamma 0.1 --ip_noise_gamma_random_strength
       --loss_type huber --huber_schedule snr --huber_c 0.1 --debiased_estimation_loss)
expect_rc 0 kohya -- "$bin" "${kohya[@]}" --output_dir "$work/kohya"
grep_in "$work/kohya/results.json" '"loss_type": "huber"'
expect_rc 130 kohya-stopped -- "$bin" "${kohya[@]}" --output_dir "$work/kohya-resumed" --stop_at 6
expect_rc 0 kohya-resumed -- "$bin" "${kohya[@]}" --output_dir "$work/kohya-resumed" --resume_from_checkpoint latest
cmp -s "$work/kohya/pytorch_lora_weights.safetensors" "$work/kohya-resumed/pytorch_lora_weights.safetensors" ||
  fail "the resumed run with kohya's options ended with another LoRA"
expect_rc 2 kohya-loss-type -- "$bin" "${base[@]}" --loss_type huberr --output_dir "$work/bad"
grep_in "$work/kohya-loss-type.err" "--loss_type"
expect_rc 2 kohya-two-perturbations -- "$bin" "${base[@]}" --ip_noise_gamma 0.1 --input_perturbation 0.1 --output_dir "$work/bad"
grep_in "$work/kohya-two-perturbations.err" "--ip_noise_gamma"
expect_rc 2 kohya-huber-c -- "$bin" "${base[@]}" --loss_type huber --huber_schedule exponential --huber_c 0 --output_dir "$work/bad"
grep_in "$work/kohya-huber-c.err" "--huber_c"
# LoRA+ (kohya's ratio): the UNet's and text encoder's B matrices in groups of their own at 16x
# the rate; refused without LoRA.
expect_rc 0 loraplus -- "$bin" "${base[@]}" --use_lora --train_text_encoder --loraplus_lr_ratio 16 \
  --learning_rate 1e-4 --max_train_steps 2 --output_dir "$work/loraplus"
"$py" - "$work/loraplus/results.json" <<'PY' || fail "LoRA+ groups"
import json, sys
groups = json.load(open(sys.argv[1]))["param_groups"]
fast = [g for g in groups if abs(g["lr"] - 1.6e-3) < 1e-12]
slow = [g for g in groups if abs(g["lr"] - 1e-4) < 1e-12]
assert len(fast) == 2 and slow and len(fast) + len(slow) == len(groups), groups
print("LoRA+:", groups)
PY
expect_rc 2 loraplus-no-lora -- "$bin" "${base[@]}" --loraplus_lr_ratio 16 --output_dir "$work/bad"
grep_in "$work/loraplus-no-lora.err" "--use_lora"
# Optimizers by kohya's names and settings (--optimizer_type, --optimizer_args, diffusers'
# --use_8bit_adam): each trains the LoRA and results.json names the one chosen; schedule-free,
# stopped at step 3 and resumed, ends with the LoRA of the run straight through (its checkpoint
# holds the training weights, the LoRA written the evaluation weights). Misspelt names and
# settings are refused before anything loads, naming the flag.
for spec in "Prodigy|--learning_rate 1 --optimizer_args d_coef=2 use_bias_correction=True" \
            "AdamW8bit|--use_8bit_adam" "Adafactor|--optimizer_args relative_step=False scale_parameter=False" \
            "came_pytorch.CAME|" "Lion|--learning_rate 2e-4 --optimizer_args weight_decay=0.1"; do
  name=${spec%%|*} flags=${spec#*|}
  # shellcheck disable=SC2086 # the flags are words
  expect_rc 0 "opt-$name" -- "$bin" "${base[@]}" --use_lora --rank 4 --max_train_steps 3 \
    $( [ "$name" = AdamW8bit ] || echo --optimizer_type "$name" ) $flags --output_dir "$work/opt-$name"
  [ -s "$work/opt-$name/pytorch_lora_weights.safetensors" ] || fail "$name wrote no LoRA"
done
grep_in "$work/opt-Prodigy/results.json" '"optimizer": "prodigy"'
grep_in "$work/opt-AdamW8bit/results.json" '"optimizer": "adamw8bit"'
grep_in "$work/opt-came_pytorch.CAME/results.json" '"optimizer": "came"'
sf=("${base[@]}" --use_lora --rank 4 --learning_rate 2e-3 --max_train_steps 6 --checkpointing_steps 3
    --optimizer_type AdamWScheduleFree --optimizer_args warmup_steps=2)
expect_rc 0 schedulefree -- "$bin" "${sf[@]}" --output_dir "$work/schedulefree"
expect_rc 130 schedulefree-stopped -- "$bin" "${sf[@]}" --output_dir "$work/schedulefree-resumed" --stop_at 3
expect_rc 0 schedulefree-resumed -- "$bin" "${sf[@]}" --output_dir "$work/schedulefree-resumed" \
  --resume_from_checkpoint latest
cmp -s "$work/schedulefree/pytorch_lora_weights.safetensors" \
  "$work/schedulefree-resumed/pytorch_lora_weights.safetensors" ||
  fail "the resumed schedule-free run ended with another LoRA"
expect_rc 2 opt-unknown -- "$bin" "${base[@]}" --optimizer_type AdamW9bit --output_dir "$work/bad"
grep_in "$work/opt-unknown.err" "--optimizer_type"
grep_in "$work/opt-unknown.err" "AdamWScheduleFree"
expect_rc 2 opt-arg -- "$bin" "${base[@]}" --optimizer_type Lion --optimizer_args d_coef=2 --output_dir "$work/bad"
grep_in "$work/opt-arg.err" "'d_coef' is not a setting of Lion"
expect_rc 2 opt-8bit-twice -- "$bin" "${base[@]}" --optimizer_type Lion --use_8bit_adam --output_dir "$work/bad"
grep_in "$work/opt-8bit-twice.err" "--use_8bit_adam"
# kohya's block_dims / block_alphas: UNet LoRA ranks and alphas per block (blocks of rank 0 get no
# branch). With one alpha, diffusers' load_lora_weights gives the same images from the PEFT file
# (per-module ranks in its metadata) and the kohya file; with alphas per block, the PEFT file's
# metadata and the kohya file's .alpha keys carry them (diffusers reads per-module alphas from the
# PEFT file only: docs/adapters.md). A count other than 25 is refused by name.
dims=4,0,2,8,4,2,4,4,4,4,4,4,6,4,2,8,4,2,4,4,4,4,4,4,4
alphas=1,2,1,4,2,1,1,2,2,2,2,2,3,2,1,4,2,1,2,2,2,2,2,2,2
expect_rc 0 block-dims -- "$bin" "${base[@]}" --use_lora --rank 4 --lora_alpha 2 --block_dims "$dims" \
  --learning_rate 2e-3 --max_train_steps 2 --output_dir "$work/block-dims"
expect_rc 0 block-alphas -- "$bin" "${base[@]}" --use_lora --rank 4 --block_dims "$dims" \
  --block_alphas "$alphas" --learning_rate 2e-3 --max_train_steps 2 --output_dir "$work/block-alphas"
"$py" - "$work" "$sd" >"$work/block-dims-check.out" 2>&1 <<'PY' || { cat "$work/block-dims-check.out"; fail "block_dims in diffusers"; }
import pathlib, sys
import numpy as np, torch
from safetensors.torch import load_file
from diffusers import StableDiffusionPipeline
from diffusers.utils import logging as dlogging
dlogging.set_verbosity_error()
work, sd = pathlib.Path(sys.argv[1]), sys.argv[2]
def images(out, weight_name=None):
    pipe = StableDiffusionPipeline.from_pretrained(sd, safety_checker=None)
    if weight_name:
        pipe.load_lora_weights(str(out), weight_name=weight_name)
    return pipe("a photo of a sneaker", num_inference_steps=2, height=32, width=32, output_type="np",
                generator=torch.Generator().manual_seed(0)).images, pipe
for run in ("block-dims", "block-alphas"):
    out = work / run
    ranks = {k: v.shape[0] for k, v in load_file(out / "pytorch_lora_weights.safetensors").items()
             if k.endswith("lora_A.weight")}
    assert len(set(ranks.values())) >= 3, ranks
    assert not any(k.startswith("unet.down_blocks.0.attentions.0.") for k in ranks), "IN01 has rank 0"
    peft, pipe = images(out, "pytorch_lora_weights.safetensors")
    assert pipe.unet.peft_config["default_0"].rank_pattern, run
    assert np.isfinite(peft).all() and not np.allclose(peft, images(out)[0]), run
    kohya_alphas = {float(v) for k, v in load_file(out / "lora_kohya.safetensors").items()
                    if k.endswith(".alpha")}
    if run == "block-dims":
        assert kohya_alphas == {2.0}, kohya_alphas
        kohya, _ = images(out, "lora_kohya.safetensors")
        worst = float(np.abs(peft - kohya).max())
        assert worst < 1e-4, worst
        print(f"block_dims: ranks {sorted(set(ranks.values()))}; PEFT and kohya files {worst:.1e} apart")
    else:
        assert len(kohya_alphas) >= 3 and kohya_alphas <= {1.0, 2.0, 3.0, 4.0}, kohya_alphas
        assert pipe.unet.peft_config["default_0"].alpha_pattern
        print(f"block_alphas: alphas {sorted(kohya_alphas)} in both files")
PY
# LyCORIS' LoHa and LoKr (--network_algo) on the UNet and the text encoder: the LyCORIS-layout file
# applied by lycoris-lora's own module parser and the PEFT-layout file by PEFT's LoHaConfig /
# LoKrConfig give diffusers' pipeline the same images, unlike the base's. A LoKr stopped and
# resumed ends with the same file. Misused, they are refused by name.
for algo in loha lokr; do
  expect_rc 0 "algo-$algo" -- "$bin" "${base[@]}" --use_lora --train_text_encoder --network_algo "$algo" \
    --rank 4 --lora_alpha 2 --learning_rate 2e-3 --max_train_steps 4 --checkpointing_steps 2 \
    --output_dir "$work/algo-$algo"
  grep_in "$work/algo-$algo/results.json" "\"network_algo\": \"$algo\""
done
expect_rc 130 algo-lokr-stopped -- "$bin" "${base[@]}" --use_lora --train_text_encoder --network_algo lokr \
  --rank 4 --lora_alpha 2 --learning_rate 2e-3 --max_train_steps 4 --checkpointing_steps 2 \
  --output_dir "$work/algo-lokr-resumed" --stop_at 2
expect_rc 0 algo-lokr-resumed -- "$bin" "${base[@]}" --use_lora --train_text_encoder --network_algo lokr \
  --rank 4 --lora_alpha 2 --learning_rate 2e-3 --max_train_steps 4 --checkpointing_steps 2 \
  --output_dir "$work/algo-lokr-resumed" --resume_from_checkpoint latest
cmp -s "$work/algo-lokr/lora_kohya.safetensors" "$work/algo-lokr-resumed/lora_kohya.safetensors" ||
  fail "the resumed LoKr run ended with another file"
"$py" - "$work" "$sd" >"$work/algo-check.out" 2>&1 <<'PY' || { cat "$work/algo-check.out"; fail "LoHa/LoKr files elsewhere"; }
import pathlib, sys
import numpy as np, torch
from safetensors.torch import load_file
from diffusers import StableDiffusionPipeline
from diffusers.utils import logging as dlogging
from lycoris import create_lycoris_from_weights
from peft import LoHaConfig, LoKrConfig, inject_adapter_in_model, set_peft_model_state_dict
dlogging.set_verbosity_error()
work, sd = pathlib.Path(sys.argv[1]), sys.argv[2]
def generate(pipe):
    return pipe("a photo of a sneaker", num_inference_steps=2, height=32, width=32, output_type="np",
                generator=torch.Generator().manual_seed(0)).images
def te_names(pipe):
    return {n for n, _ in pipe.text_encoder.named_modules()}
plain = generate(StableDiffusionPipeline.from_pretrained(sd, safety_checker=None))
for algo in ("loha", "lokr"):
    out = work / f"algo-{algo}"
    # LyCORIS' layout, through LyCORIS' parser (its wrapper's prefix is lycoris_).
    pipe = StableDiffusionPipeline.from_pretrained(sd, safety_checker=None)
    kohya = load_file(out / "lora_kohya.safetensors")
    strip = "" if any(n.startswith("text_model.") for n in te_names(pipe)) else "text_model_"
    for prefix, model in (("lora_unet_", pipe.unet), ("lora_te_" + strip, pipe.text_encoder)):
        part = {"lycoris_" + k[len(prefix):]: v for k, v in kohya.items() if k.startswith(prefix)}
        assert part, prefix
        net, _ = create_lycoris_from_weights(1.0, "", model, weights_sd=part)
        assert len(net.loras) == len({k.split(".")[0] for k in part}), (prefix, len(net.loras))
        net.apply_to()
    via_lycoris = generate(pipe)
    # PEFT's layout, through PEFT's adapters.
    pipe = StableDiffusionPipeline.from_pretrained(sd, safety_checker=None)
    peft = load_file(out / "pytorch_lora_weights.safetensors")
    Config = LoHaConfig if algo == "loha" else LoKrConfig
    for prefix, model, targets in (
            ("unet.", pipe.unet, ["to_q", "to_k", "to_v", "to_out.0"]),
            ("text_encoder.", pipe.text_encoder, ["q_proj", "k_proj", "v_proj", "out_proj"])):
        part = {k[len(prefix):]: v for k, v in peft.items() if k.startswith(prefix)}
        if prefix == "text_encoder." and strip:
            part = {k.removeprefix("text_model."): v for k, v in part.items()}
        inject_adapter_in_model(Config(r=4, alpha=2.0, target_modules=targets), model)
        result = set_peft_model_state_dict(model, part)
        assert not result.unexpected_keys, result.unexpected_keys[:3]
    via_peft = generate(pipe)
    worst = float(np.abs(via_lycoris - via_peft).max())
    assert worst < 1e-4 and not np.allclose(via_lycoris, plain), (algo, worst)
    print(f"{algo}: LyCORIS' parser and PEFT give the same images ({worst:.1e} apart), not the base's")
PY
expect_rc 2 algo-unknown -- "$bin" "${base[@]}" --use_lora --network_algo glora --output_dir "$work/bad"
grep_in "$work/algo-unknown.err" "--network_algo"
expect_rc 2 algo-block-dims -- "$bin" "${base[@]}" --use_lora --network_algo loha --block_dims "$dims" --output_dir "$work/bad"
grep_in "$work/algo-block-dims.err" "--block_dims"
expect_rc 2 block-dims-count -- "$bin" "${base[@]}" --use_lora --block_dims 4,4,4 --output_dir "$work/bad"
grep_in "$work/block-dims-count.err" "--block_dims"
# DoRA and kohya's LoCon (--conv_dim: the resnets' and resamplers' layers too), from flags and
# from kohya's --network_args. Per output row: diffusers' load_lora_weights of the PEFT file and
# lycoris-lora's parser of the kohya file give the same images, unlike the base's; a run stopped
# and resumed writes the same file. Per input column (the web UI's form): the kohya file alone,
# applied with the web UI's merge. Misused, refused by name.
dora=(--use_lora --train_text_encoder --use_dora --rank 4 --lora_alpha 2 --conv_dim 2 --conv_alpha 1
      --learning_rate 2e-3 --max_train_steps 4 --checkpointing_steps 2)
expect_rc 0 dora -- "$bin" "${base[@]}" "${dora[@]}" --output_dir "$work/dora"
expect_rc 130 dora-stopped -- "$bin" "${base[@]}" "${dora[@]}" --output_dir "$work/dora-resumed" --stop_at 2
expect_rc 0 dora-resumed -- "$bin" "${base[@]}" "${dora[@]}" --output_dir "$work/dora-resumed" \
  --resume_from_checkpoint latest
cmp -s "$work/dora/lora_kohya.safetensors" "$work/dora-resumed/lora_kohya.safetensors" ||
  fail "the resumed DoRA run ended with another file"
expect_rc 0 dora-input -- "$bin" "${base[@]}" --use_lora --rank 4 --lora_alpha 2 --learning_rate 2e-3 \
  --max_train_steps 2 --network_args "conv_dim=2" "conv_alpha=1" "dora_wd=True" "wd_on_output=False" \
  --output_dir "$work/dora-input"
[ -e "$work/dora-input/pytorch_lora_weights.safetensors" ] && fail "DoRA per input column wrote a PEFT file"
"$py" - "$work" "$sd" >"$work/dora-check.out" 2>&1 <<'PY' || { cat "$work/dora-check.out"; fail "DoRA/LoCon files elsewhere"; }
import pathlib, sys
import numpy as np, torch
from safetensors.torch import load_file
from diffusers import StableDiffusionPipeline
from diffusers.utils import logging as dlogging
from lycoris import create_lycoris_from_weights
dlogging.set_verbosity_error()
work, sd = pathlib.Path(sys.argv[1]), sys.argv[2]
def pipeline():
    return StableDiffusionPipeline.from_pretrained(sd, safety_checker=None)
def generate(pipe):
    return pipe("a photo of a sneaker", num_inference_steps=2, height=32, width=32, output_type="np",
                generator=torch.Generator().manual_seed(0)).images
plain = generate(pipeline())
out = work / "dora"
peft = load_file(out / "pytorch_lora_weights.safetensors")
kohya = load_file(out / "lora_kohya.safetensors")
for key, rank in (("unet.down_blocks.0.resnets.0.conv1.lora_A.weight", 2),
                  ("unet.down_blocks.0.resnets.0.time_emb_proj.lora_A.weight", 4),
                  ("unet.down_blocks.0.downsamplers.0.conv.lora_A.weight", 2)):
    assert peft[key].shape[0] == rank, (key, peft[key].shape)
assert kohya["lora_unet_down_blocks_0_resnets_0_conv1.dora_scale"].shape[1:] == (1, 1, 1)
# The text encoder's magnitudes as transformers' adapter loader (diffusers' path) reads them.
assert any(k.startswith("text_encoder.") and k.endswith("lora_magnitude_vector.weight") for k in peft)
pipe = pipeline()
pipe.load_lora_weights(str(out), weight_name="pytorch_lora_weights.safetensors")
assert pipe.unet.peft_config["default_0"].use_dora
via_diffusers = generate(pipe)
pipe = pipeline()
names = {n for n, _ in pipe.text_encoder.named_modules()}
strip = "" if any(n.startswith("text_model.") for n in names) else "text_model_"
for prefix, model in (("lora_unet_", pipe.unet), ("lora_te_" + strip, pipe.text_encoder)):
    part = {"lycoris_" + k[len(prefix):]: v for k, v in kohya.items() if k.startswith(prefix)}
    net, _ = create_lycoris_from_weights(1.0, "", model, weights_sd=part)
    assert len(net.loras) == len({k.split(".")[0] for k in part}), (prefix, len(net.loras))
    net.apply_to()
via_lycoris = generate(pipe)
worst = float(np.abs(via_diffusers - via_lycoris).max())
assert worst < 1e-4 and not np.allclose(via_diffusers, plain), worst
print(f"DoRA + LoCon: diffusers (PEFT file) and LyCORIS (kohya file) {worst:.1e} apart, not the base's")
# Per input column: the web UI's merge (networks' apply_weight_decompose) of the kohya file.
pipe = pipeline()
sd_in = load_file(work / "dora-input" / "lora_kohya.safetensors")
modules = dict(pipe.unet.named_modules())
merged = 0
with torch.no_grad():
    for key in [k for k in sd_in if k.endswith(".dora_scale")]:
        base = key[:-len(".dora_scale")]
        name = base[len("lora_unet_"):]
        module = next(m for n, m in modules.items() if n.replace(".", "_") == name)
        w = module.weight
        up, down = sd_in[base + ".lora_up.weight"], sd_in[base + ".lora_down.weight"]
        scale = float(sd_in[base + ".alpha"]) / down.shape[0]
        w1 = w + (up.flatten(1) @ down.flatten(1)).reshape(w.shape) * scale
        dim = w.dim() - 1
        norm = (w1.transpose(0, 1).reshape(w1.shape[1], -1).norm(dim=1, keepdim=True)
                .reshape(w1.shape[1], *[1] * dim).transpose(0, 1))
        assert sd_in[key].shape == norm.shape, (key, sd_in[key].shape, norm.shape)
        w.copy_(w1 * (sd_in[key] / norm))
        merged += 1
webui = generate(pipe)
assert merged > 10 and np.isfinite(webui).all() and not np.allclose(webui, plain), merged
print(f"DoRA per input column: the web UI's merge applies {merged} modules")
PY
expect_rc 2 network-args-unknown -- "$bin" "${base[@]}" --use_lora --network_args "rank_dropout=0.1" --output_dir "$work/bad"
grep_in "$work/network-args-unknown.err" "rank_dropout"
expect_rc 2 dora-loha -- "$bin" "${base[@]}" --use_lora --use_dora --network_algo loha --output_dir "$work/bad"
grep_in "$work/dora-loha.err" "--use_dora"
expect_rc 2 conv-without-lora -- "$bin" "${base[@]}" --conv_dim 4 --output_dir "$work/bad"
grep_in "$work/conv-without-lora.err" "--conv_dim"
# kohya's dataset config: a subset of uncaptioned images under class tokens, repeated twice, and a
# regularization subset weighted by --prior_loss_weight; the dataset's batch size and resolution
# come from the file. A misspelt key (with the nearest one), a key in the wrong table, a missing
# folder and two sets of caption options are refused with the file's line.
mkdir -p "$work/dc/inst" "$work/dc/reg"
n=0
for f in $(ls "$images" | grep -E '\.(png|jpg|webp)$' | grep -v '^broken' | head -n 6); do
  if [ $n -lt 4 ]; then cp "$images/$f" "$work/dc/inst/"
  else cp "$images/$f" "$work/dc/reg/" && echo "a shoe, photo" >"$work/dc/reg/${f%.*}.txt"; fi
  n=$((n + 1))
done
dcbase=(--pretrained_model_name_or_path "$sd" --seed 3 --num_inference_steps 3 --dataloader_num_workers 2 --threads 1)
cat >"$work/dc/dataset.toml" <<TOML
[general]
shuffle_caption = true
caption_extension = ".txt"
keep_tokens = 1
color_aug = false

[[datasets]]
resolution = 32
batch_size = 2

  [[datasets.subsets]]
  image_dir = "$work/dc/inst"
  class_tokens = "sks shoe"
  num_repeats = 2

  [[datasets.subsets]]
  image_dir = "$work/dc/reg"
  is_reg = true
TOML
expect_rc 0 dataset-config -- "$bin" "${dcbase[@]}" --dataset_config "$work/dc/dataset.toml" --use_lora \
  --prior_loss_weight 0.5 --max_train_steps 2 --output_dir "$work/dataset-config"
grep_in "$work/dataset-config.err" "2 regularization images (8 with repeats) beside 8 training images"
grep_in "$work/dataset-config/results.json" '"train_batch_size": 2'
sed 's/num_repeats = 2/num_repeat = 2/' "$work/dc/dataset.toml" >"$work/dc/misspelt.toml"
expect_rc 2 dataset-config-misspelt -- "$bin" "${dcbase[@]}" --dataset_config "$work/dc/misspelt.toml" --output_dir "$work/bad"
grep_in "$work/dataset-config-misspelt.err" "misspelt.toml:14:3: 'num_repeat' .*did you mean 'num_repeats'"
sed 's/^batch_size = 2/batch_size = 2\nimage_dir = "x"/' "$work/dc/dataset.toml" >"$work/dc/wrong-table.toml"
expect_rc 2 dataset-config-table -- "$bin" "${dcbase[@]}" --dataset_config "$work/dc/wrong-table.toml" --output_dir "$work/bad"
grep_in "$work/dataset-config-table.err" "does not belong in \[\[datasets\]\]"
sed "s|$work/dc/reg|$work/dc/nowhere|" "$work/dc/dataset.toml" >"$work/dc/missing.toml"
expect_rc 2 dataset-config-missing -- "$bin" "${dcbase[@]}" --dataset_config "$work/dc/missing.toml" --output_dir "$work/bad"
grep_in "$work/dataset-config-missing.err" "nowhere"
printf '[[datasets]]\n[[datasets.subsets]]\nimage_dir = "%s"\nshuffle_caption = true\n[[datasets.subsets]]\nimage_dir = "%s"\n' \
  "$work/dc/inst" "$work/dc/reg" >"$work/dc/two-captions.toml"
expect_rc 2 dataset-config-captions -- "$bin" "${dcbase[@]}" --dataset_config "$work/dc/two-captions.toml" --output_dir "$work/bad"
grep_in "$work/dataset-config-captions.err" "caption options"
expect_rc 2 dataset-config-and-dir -- "$bin" "${base[@]}" --dataset_config "$work/dc/dataset.toml" --output_dir "$work/bad"
grep_in "$work/dataset-config-and-dir.err" "--dataset_config"
# kohya's masked loss: mask images of the same stems (--masked_loss --conditioning_data_dir), or
# each image's alpha channel (--alpha_mask, opaque where an image has none). Masks of zeros leave
# nothing to learn: the LoRA's up matrices stay zero. Missing masks and cached latents with masks
# are refused by name.
mkdir -p "$work/masks-zero" "$work/masks-half"
"$py" - "$work/dc/inst" "$work/masks-zero" "$work/masks-half" <<'PY'
import pathlib, sys
from PIL import Image
src, zero, half = (pathlib.Path(a) for a in sys.argv[1:])
for f in src.iterdir():
    w, h = Image.open(f).size
    Image.new("RGB", (w, h)).save(zero / (f.stem + ".png"))
    m = Image.new("RGB", (w, h))
    m.paste((255, 255, 255), (0, 0, w // 2, h))
    m.save(half / (f.stem + ".png"))
PY
mask=(--pretrained_model_name_or_path "$sd" --train_data_dir "$work/dc/inst" --resolution 32 --train_batch_size 2
      --seed 3 --num_inference_steps 3 --dataloader_num_workers 2 --threads 1 --use_lora --learning_rate 1e-2
      --max_train_steps 2 --adam_weight_decay 0)
expect_rc 0 masked-zero -- "$bin" "${mask[@]}" --masked_loss --conditioning_data_dir "$work/masks-zero" --output_dir "$work/masked-zero"
expect_rc 0 masked-half -- "$bin" "${mask[@]}" --masked_loss --conditioning_data_dir "$work/masks-half" --output_dir "$work/masked-half"
expect_rc 0 alpha-mask -- "$bin" "${mask[@]}" --alpha_mask --output_dir "$work/alpha-mask"
"$py" - "$work" >"$work/mask-check.out" 2>&1 <<'PY' || { cat "$work/mask-check.out"; fail "masked loss"; }
import pathlib, sys
from safetensors.torch import load_file
work = pathlib.Path(sys.argv[1])
def ups(run):
    return [v for k, v in load_file(work / run / "lora_kohya.safetensors").items() if k.endswith("lora_up.weight")]
assert all(float(u.abs().max()) == 0.0 for u in ups("masked-zero")), "a zero mask trained the LoRA"
assert any(float(u.abs().max()) > 0.0 for u in ups("masked-half")), "a half mask trained nothing"
assert any(float(u.abs().max()) > 0.0 for u in ups("alpha-mask")), "opaque images trained nothing"
print("masked loss: zero masks leave the LoRA untrained; half masks and opaque alpha train it")
PY
mkdir -p "$work/masks-missing" && cp "$work/masks-half"/* "$work/masks-missing/" && rm "$(ls -d "$work/masks-missing"/* | head -n 1)"
expect_rc 2 masked-missing -- "$bin" "${mask[@]}" --masked_loss --conditioning_data_dir "$work/masks-missing" --output_dir "$work/bad"
grep_in "$work/masked-missing.err" "has no mask for"
expect_rc 2 masked-cache -- "$bin" "${mask[@]}" --alpha_mask --cache_latents --center_crop --output_dir "$work/bad"
grep_in "$work/masked-cache.err" "--alpha_mask"
expect_rc 2 masked-no-dir -- "$bin" "${mask[@]}" --masked_loss --output_dir "$work/bad"
grep_in "$work/masked-no-dir.err" "--conditioning_data_dir"
# diffusers' prior preservation: the class images drawn by the model where too few (a second run
# draws none), each instance batch followed by its class batch.
expect_rc 0 prior -- "$bin" "${base[@]}" --use_lora --center_crop --with_prior_preservation \
  --class_data_dir "$work/class" --class_prompt "a photo of a shoe" --num_class_images 3 \
  --sample_batch_size 2 --max_train_steps 2 --output_dir "$work/prior"
grep_in "$work/prior.err" "drawing 3 class images"
[ "$(ls "$work/class" | grep -c '\.png$')" = 3 ] || fail "prior preservation did not draw 3 class images"
expect_rc 0 prior-again -- "$bin" "${base[@]}" --use_lora --center_crop --with_prior_preservation \
  --class_data_dir "$work/class" --class_prompt "a photo of a shoe" --num_class_images 3 \
  --max_train_steps 2 --output_dir "$work/prior-again"
grep -q "drawing" "$work/prior-again.err" && fail "a second run drew class images again"
expect_rc 2 prior-no-prompt -- "$bin" "${base[@]}" --with_prior_preservation --class_data_dir "$work/class" --output_dir "$work/bad"
grep_in "$work/prior-no-prompt.err" "--class_prompt"
# Full fine-tuning with EMA, min-SNR and offset noise, latents encoded every step, buckets.
expect_rc 0 full -- "$bin" "${base[@]}" --use_ema --ema_decay 0.9 --snr_gamma 5 --noise_offset 0.05 \
  --enable_bucket --min_bucket_reso 16 --max_bucket_reso 64 --bucket_reso_steps 16 \
  --learning_rate 5e-4 --max_train_steps 30 --validation_prompt "a photo of a bag" --output_dir "$work/full"
grep_in "$work/full.err" "number of buckets"
# A full fine-tune written as one file in the original layout (fp16, as the web UI's), trained on
# again from that file (its configs from --single_file_config), written back as a diffusers folder.
expect_rc 0 single -- "$bin" "${base[@]}" --max_train_steps 2 --save_format single_file \
  --save_precision fp16 --output_dir "$work/single"
[ -s "$work/single/model.safetensors" ] || fail "--save_format single_file wrote no model.safetensors"
grep_in "$work/single.out" "model.safetensors"
expect_rc 2 single-lora -- "$bin" "${base[@]}" --use_lora --save_format single_file --output_dir "$work/bad"
grep_in "$work/single-lora.err" "--save_format single_file"
expect_rc 2 single-no-config -- "$bin" "${base[@]}" --pretrained_model_name_or_path \
  "$work/single/model.safetensors" --max_train_steps 1 --output_dir "$work/bad"
grep_in "$work/single-no-config.err" "--single_file_config"
expect_rc 0 from-single -- "$bin" "${base[@]}" --pretrained_model_name_or_path \
  "$work/single/model.safetensors" --single_file_config "$sd" --max_train_steps 2 \
  --output_dir "$work/from-single"
[ -s "$work/from-single/text_encoder/config.json" ] && [ -d "$work/from-single/unet" ] ||
  fail "a full fine-tune of a single file wrote no pipeline folder"
# A single file with no config folder: its configs told from its keys (a pipeline keeping SD 1.x's
# sizing conventions), the tokenizer from OpenAI's BPE merges file or a tokenizer folder; written
# back as a diffusers folder that diffusers loads. Without either, the error names both flags.
conv=$work/data/sd15_conventional bpe=$work/data/bpe_simple_vocab_16e6.txt.gz
expect_rc 0 conv-single -- "$bin" "${base[@]}" --pretrained_model_name_or_path "$conv" --max_train_steps 1 \
  --save_format single_file --output_dir "$work/conv-single"
expect_rc 0 told -- "$bin" "${base[@]}" --pretrained_model_name_or_path "$work/conv-single/model.safetensors" \
  --tokenizer_name "$bpe" --max_train_steps 2 --output_dir "$work/told"
[ -s "$work/told/model_index.json" ] && [ -s "$work/told/tokenizer/vocab.json" ] &&
  [ -s "$work/told/scheduler/scheduler_config.json" ] || fail "the told-config run wrote no whole pipeline folder"
expect_rc 0 told-folder-tokenizer -- "$bin" "${base[@]}" --pretrained_model_name_or_path \
  "$work/conv-single/model.safetensors" --tokenizer_name "$conv/tokenizer" --max_train_steps 1 \
  --save_format single_file --output_dir "$work/told-folder"
# The original config beside the file (model.yaml, where the web UI looks): v-prediction, the heads
# and the VAE scale it gives; a malformed one and an unknown parameterization are named.
mkdir -p "$work/conv-v" && cp "$work/conv-single/model.safetensors" "$work/conv-v/model.safetensors"
cat >"$work/conv-v/model.yaml" <<'YAML'
model:
  target: ldm.models.diffusion.ddpm.LatentDiffusion
  params:
    parameterization: "v"
    scale_factor: 0.18215
    unet_config:
      target: ldm.modules.diffusionmodules.openaimodel.UNetModel
      params:
        num_heads: 8
        num_head_channels: -1
        context_dim: 64
YAML
expect_rc 0 told-yaml -- "$bin" "${base[@]}" --pretrained_model_name_or_path "$work/conv-v/model.safetensors" \
  --tokenizer_name "$bpe" --max_train_steps 1 --output_dir "$work/told-yaml"
grep_in "$work/told-yaml/results.json" '"prediction_type": "v_prediction"'
printf 'model: [unclosed\n' >"$work/bad.yaml"
expect_rc 2 bad-yaml -- "$bin" "${base[@]}" --pretrained_model_name_or_path "$work/conv-single/model.safetensors" \
  --tokenizer_name "$bpe" --original_config "$work/bad.yaml" --max_train_steps 1 --output_dir "$work/bad"
grep_in "$work/bad-yaml.err" "bad.yaml"
printf 'model:\n  params:\n    parameterization: "x0"\n' >"$work/x0.yaml"
expect_rc 2 x0-yaml -- "$bin" "${base[@]}" --pretrained_model_name_or_path "$work/conv-single/model.safetensors" \
  --tokenizer_name "$bpe" --original_config "$work/x0.yaml" --max_train_steps 1 --output_dir "$work/bad"
grep_in "$work/x0-yaml.err" "parameterization is 'x0'"
expect_rc 2 told-no-tokenizer -- "$bin" "${base[@]}" --pretrained_model_name_or_path \
  "$work/conv-single/model.safetensors" --tokenizer_name "$work/nothing-here" --max_train_steps 1 --output_dir "$work/bad"
grep_in "$work/told-no-tokenizer.err" "BPE merges file"
expect_rc 2 folder-with-tokenizer -- "$bin" "${base[@]}" --tokenizer_name "$bpe" --max_train_steps 1 --output_dir "$work/bad"
grep_in "$work/folder-with-tokenizer.err" "go with a single file"
# A file that holds the original trainer's EMA weights beside the trained ones (model_ema.*):
# --use_ema_weights starts from them (the web UI's model_ema); the stale EMA is not written back
# (a loader preferring it would get the model before the fine-tune); refused for a file without
# them and for a folder.
"$py" - "$work/conv-single/model.safetensors" "$work/with-ema.safetensors" <<'PY' || fail "making the EMA file"
import sys
from safetensors.torch import load_file, save_file
sd = load_file(sys.argv[1])
for key in [k for k in sd if k.startswith("model.diffusion_model.")]:
    sd["model_ema." + key[len("model."):].replace(".", "")] = sd[key] + 0.5
save_file(sd, sys.argv[2])
PY
expect_rc 0 ema-weights -- "$bin" "${base[@]}" --pretrained_model_name_or_path "$work/with-ema.safetensors" \
  --tokenizer_name "$bpe" --use_ema_weights --learning_rate 1e-5 --max_train_steps 1 \
  --save_format single_file --output_dir "$work/ema-weights"
"$py" - "$work/with-ema.safetensors" "$work/ema-weights/model.safetensors" <<'PY' || fail "the run did not start from the EMA weights"
import sys
from safetensors.torch import load_file
base, out = load_file(sys.argv[1]), load_file(sys.argv[2])
unet = [k for k in base if k.startswith("model.diffusion_model.")]
far = max((out[k].float() - base[k].float() - 0.5).abs().max().item() for k in unet)
assert far < 1e-2, far
assert not any(k.startswith("model_ema.") for k in out), "the stale EMA weights were written back"
print(f"--use_ema_weights: the UNet started from model_ema.* (within {far:.1e} after a step)")
PY
expect_rc 2 ema-none -- "$bin" "${base[@]}" --pretrained_model_name_or_path "$work/conv-single/model.safetensors" \
  --tokenizer_name "$bpe" --use_ema_weights --max_train_steps 1 --output_dir "$work/bad"
grep_in "$work/ema-none.err" "holds no EMA weights"
expect_rc 2 ema-folder -- "$bin" "${base[@]}" --use_ema_weights --max_train_steps 1 --output_dir "$work/bad"
grep_in "$work/ema-folder.err" "go with a single file"
# A pipeline folder holding only fp16 variant files (diffusers' save_pretrained(variant="fp16")):
# refused without --variant, naming the variant; with --variant fp16 it trains, and its output
# folder loads in diffusers with variant="fp16" (the trained UNet written in that variant too).
"$py" - "$sd" "$work/sd-fp16" >"$work/variant-make.out" 2>&1 <<'PY' || fail "making an fp16-variant pipeline"
import sys, torch
from diffusers import StableDiffusionPipeline
StableDiffusionPipeline.from_pretrained(sys.argv[1], torch_dtype=torch.float16).save_pretrained(
    sys.argv[2], variant="fp16")
PY
expect_rc 2 variant-missing -- "$bin" "${base[@]}" --pretrained_model_name_or_path "$work/sd-fp16" \
  --max_train_steps 2 --output_dir "$work/bad"
grep_in "$work/variant-missing.err" 'variant "fp16"'
expect_rc 0 variant -- "$bin" "${base[@]}" --pretrained_model_name_or_path "$work/sd-fp16" \
  --variant fp16 --max_train_steps 2 --output_dir "$work/variant"
ls "$work/variant/unet"/diffusion_pytorch_model.fp16.safetensors >/dev/null 2>&1 ||
  fail "the fp16-variant run did not write its UNet in that variant"

# SDXL: LoRA on the UNet and both text encoders, buckets, cached latents (time ids from each
# image's size and crop).
expect_rc 2 xl-wrong-unet -- "$bin" "${base[@]}" --pretrained_model_name_or_path "$work/mixed" --output_dir "$work/bad"
expect_rc 0 xl -- "$bin" "${base[@]}" --pretrained_model_name_or_path "$xl" --use_lora --train_text_encoder \
  --cache_latents --enable_bucket --min_bucket_reso 16 --max_bucket_reso 64 --bucket_reso_steps 16 \
  --learning_rate 2e-3 --max_train_steps 30 --validation_prompt "a photo of a trouser" --output_dir "$work/xl"
# SDXL as one file: a full fine-tune written in SDXL's original layout (fp16), trained again from
# that file and written back as one, every key of the first in the second; the file with an SD 1.x
# config folder is refused by name.
expect_rc 0 xl-single -- "$bin" "${base[@]}" --pretrained_model_name_or_path "$xl" --max_train_steps 2 \
  --save_format single_file --save_precision fp16 --output_dir "$work/xl-single"
expect_rc 0 xl-from-single -- "$bin" "${base[@]}" --pretrained_model_name_or_path \
  "$work/xl-single/model.safetensors" --single_file_config "$xl" --max_train_steps 2 \
  --save_format single_file --output_dir "$work/xl-from-single"
expect_rc 2 xl-single-sd-config -- "$bin" "${base[@]}" --pretrained_model_name_or_path \
  "$work/xl-single/model.safetensors" --single_file_config "$sd" --max_train_steps 1 --output_dir "$work/bad"
grep_in "$work/xl-single-sd-config.err" "Stable Diffusion XL file"

# Under torchrun with 2 ranks (each its own batches of 2; rank 0 caches the latents and the text
# encoder's outputs, the other rank reads them): DataParallel straight through; ZeRO stage 2
# stopped at step 6, its checkpoint set resumed by 2 ranks at stage 3 (each UNet block a unit
# whose LoRA parameters the other rank frees), ending where DataParallel ends (each with an EMA,
# which the sharded runs keep per rank and gather for the file they write); one process refuses the set unless told that the world size changes.
export GLOO_SOCKET_IFNAME=lo
launch=("$(dirname "$py")/torchrun" --standalone --nproc-per-node 2 --no-python "$bin")
ranks=("${base[@]}" --train_batch_size 2 --use_lora --rank 4 --cache_latents --center_crop
       --learning_rate 2e-3 --max_train_steps 12 --checkpointing_steps 4 --rank_timeout 120
       --validation_prompt "a photo of a sneaker" --use_ema --ema_decay 0.8)
expect_rc 0 dp -- "${launch[@]}" "${ranks[@]}" --output_dir "$work/dp"
grep_in "$work/dp/results.json" '"ranks": 2'
# Rank 0 encoded the 24 latents; rank 1 found them all (it reports only when it had to encode),
# and the folder is reported once.
[ "$(grep -c "latent cache: 24 entries, 0 reused, 24 encoded" "$work/dp.err")" -eq 1 ] &&
  [ "$(grep -c "latent cache:" "$work/dp.err")" -eq 1 ] || fail "the latent cache was not built once"
[ "$(grep -c "24 images" "$work/dp.err")" -eq 1 ] || fail "the image folder should be reported once"
# A damaged shard of the text cache is set aside and said so; its captions are encoded again.
shard=$(find "$work/dp/cache/text" -name 'shard-*.safetensors' | head -n 1)
[ -n "$shard" ] || fail "the 2-rank run wrote no text cache"
"$py" -c "import sys; p = sys.argv[1]; b = bytearray(open(p, 'rb').read()); b[len(b) // 2] ^= 0xFF; open(p, 'wb').write(b)" "$shard"
expect_rc 0 text-cache-damaged -- "$bin" "${base[@]}" --use_lora --rank 4 --cache_latents --center_crop \
  --max_train_steps 1 --output_dir "$work/text-cache" --cache_dir "$work/dp/cache"
grep_in "$work/text-cache-damaged.err" "text cache: $shard was damaged"
grep_in "$work/text-cache-damaged.err" "its captions are encoded again"
[ -e "$shard.damaged" ] || fail "the damaged text-cache shard was not set aside"
expect_rc 1 zero2-stopped -- "${launch[@]}" "${ranks[@]}" --sharding 2 --stop_at 6 --output_dir "$work/zero"
grep_in "$work/zero2-stopped.err" "stopped at step 6"
# Its last line names what it wrote: results.json and the checkpoint, not the LoRA files.
grep_in "$work/zero2-stopped.out" "wrote $work/zero: results.json (stopped early"
grep -q "pytorch_lora_weights" "$work/zero2-stopped.out" && fail "a stopped run claims its LoRA file"
for f in checkpoint-6.pt checkpoint-6.pt.shard-0-of-2 checkpoint-6.pt.shard-1-of-2; do
  [ -s "$work/zero/checkpoints/$f" ] || fail "the stage-2 run did not write $f"
done
cp -r "$work/zero" "$work/zero-one"
expect_rc 0 zero3-resumed -- "${launch[@]}" "${ranks[@]}" --sharding 3 --output_dir "$work/zero" \
  --resume_from_checkpoint latest
grep_in "$work/zero/results.json" '"resumed_from": 6'
expect_rc 2 one-rank-refused -- "$bin" "${ranks[@]}" --output_dir "$work/zero-one" --resume_from_checkpoint latest
grep_in "$work/one-rank-refused.err" "written by 2 ranks"
expect_rc 0 one-rank -- "$bin" "${ranks[@]}" --output_dir "$work/zero-one" --resume_from_checkpoint latest \
  --allow_world_size_change
grep_in "$work/zero-one/results.json" '"resumed_from": 6'
# --sharded_mixed_precision (FSDP's mixed precision): refused without a stage that shards or a
# dtype to compute in; at stage 3 with bf16 the LoRA computes in bf16 and the file holds the
# float32 masters, equal to DataParallel's under the same autocast (whose matrix products cast
# the weights to bf16 anyway).
expect_rc 2 smp-no-stage -- "$bin" "${ranks[@]}" --sharded_mixed_precision --mixed_precision bf16 \
  --output_dir "$work/bad"
grep_in "$work/smp-no-stage.err" "needs --sharding 1, 2 or 3"
expect_rc 2 smp-no-dtype -- "$bin" "${ranks[@]}" --sharding 2 --sharded_mixed_precision \
  --output_dir "$work/bad"
grep_in "$work/smp-no-dtype.err" "needs --mixed_precision bf16 or fp16"
expect_rc 0 smp -- "${launch[@]}" "${ranks[@]}" --sharding 3 --sharded_mixed_precision \
  --mixed_precision bf16 --output_dir "$work/smp"
expect_rc 0 dp-bf16 -- "${launch[@]}" "${ranks[@]}" --mixed_precision bf16 --output_dir "$work/dp-bf16"
# --offload_params: at stage 3 each UNet block's LoRA parameters live in host memory between
# uses (every rank's share too); the run ends where DataParallel ends. Refused below stage 3.
expect_rc 2 offload-no-stage -- "$bin" "${ranks[@]}" --sharding 2 --offload_params \
  --output_dir "$work/bad"
grep_in "$work/offload-no-stage.err" "needs --sharding 3"
expect_rc 0 offload -- "${launch[@]}" "${ranks[@]}" --sharding 3 --offload_params \
  --output_dir "$work/offload"

"$py" - "$work" "$sd" "$xl" >"$work/python.out" 2>&1 <<'PY' || { fail "Python check"; }
import json, math, pathlib, sys
import numpy as np
import torch
from safetensors.torch import load_file
from diffusers import StableDiffusionPipeline
from diffusers.utils import logging as dlogging
dlogging.set_verbosity_error()
work, sd = pathlib.Path(sys.argv[1]), sys.argv[2]
for run in ("lora", "lora-resumed", "full", "xl", "dp"):
    r = json.loads((work / run / "results.json").read_text())
    assert r["finished"] and math.isfinite(r["last_loss"]), (run, r)
    print(f"{run}: loss {r['first_loss']:.4f} -> {r['last_loss']:.4f}, data {100 * r['data_share']:.1f}%")
    assert r["last_loss"] < r["first_loss"], f"{run}: the loss did not fall"
# Stopped and resumed equals straight through, to the bit.
a = load_file(work / "lora" / "pytorch_lora_weights.safetensors")
b = load_file(work / "lora-resumed" / "pytorch_lora_weights.safetensors")
assert a.keys() == b.keys()
assert all(torch.equal(a[k], b[k]) for k in a), "the resumed run's LoRA differs"
assert any(k.startswith("text_encoder.") for k in a) and any(k.startswith("unet.") for k in a)
# 2 ranks: ZeRO stage 2, stopped, resumed at stage 3, ends where DataParallel ends.
a = load_file(work / "dp" / "pytorch_lora_weights.safetensors")
b = load_file(work / "zero" / "pytorch_lora_weights.safetensors")
assert a.keys() == b.keys()
worst = max(float((a[k] - b[k]).abs().max()) for k in a)
assert worst <= 1e-6, f"the sharded, resumed run ends {worst} from DataParallel's"
print(f"torchrun, 2 ranks: stage 2 stopped and resumed at stage 3 ends {worst:.1e} from DataParallel")
b = load_file(work / "offload" / "pytorch_lora_weights.safetensors")
assert a.keys() == b.keys()
worst = max(float((a[k] - b[k]).abs().max()) for k in a)
assert worst <= 1e-6, f"stage 3 with offloaded parameters ends {worst} from DataParallel's"
print(f"torchrun, 2 ranks: stage 3 with the parameters offloaded ends {worst:.1e} from DataParallel")
a = load_file(work / "dp-bf16" / "pytorch_lora_weights.safetensors")
c = load_file(work / "smp" / "pytorch_lora_weights.safetensors")
assert c.keys() == a.keys() and all(t.dtype == torch.float32 for t in c.values())
worst = max(float((a[k] - c[k]).abs().max()) for k in a)
moved = max(float(c[k].abs().max()) for k in c if "lora_B" in k)
assert moved > 0 and worst <= 1e-6, f"stage 3 in bf16 ends {worst} from DataParallel under autocast"
r = json.loads((work / "smp" / "results.json").read_text())
assert r["finished"] and r["last_loss"] < r["first_loss"], r
print(f"torchrun, 2 ranks, stage 3 with bf16 parameters and float32 masters: {worst:.1e} from "
      f"DataParallel under bf16 autocast, loss {r['first_loss']:.4f} -> {r['last_loss']:.4f}")

def generate(pipe):
    out = pipe("a photo of a sneaker", num_inference_steps=2, height=32, width=32,
               output_type="np", generator=torch.Generator().manual_seed(0)).images
    assert out.shape == (1, 32, 32, 3) and np.isfinite(out).all(), out.shape
    return out

base = StableDiffusionPipeline.from_pretrained(sd, safety_checker=None)
plain = generate(base)
base.load_lora_weights(str(work / "lora"))
adapted = generate(base)
assert not np.allclose(plain, adapted), "the LoRA changed nothing"
print("load_lora_weights: generates, and differently from the base")
# The kohya file of the same run (alpha in its tensors) gives the same images as the PEFT file
# (alpha in its metadata): a reader of either applies the scale the run trained at.
assert base.unet.peft_config["default_0"].lora_alpha == 2 and base.unet.peft_config["default_0"].r == 4
assert base.text_encoder.peft_config["default_0"].lora_alpha == 2
via_kohya = StableDiffusionPipeline.from_pretrained(sd, safety_checker=None)
via_kohya.load_lora_weights(str(work / "lora"), weight_name="lora_kohya.safetensors")
worst = float(np.abs(generate(via_kohya) - adapted).max())
assert worst < 1e-4, f"the kohya and PEFT files of one run give images {worst} apart"
print(f"rank 4, alpha 2: the PEFT and the kohya file give the same images ({worst:.1e} apart)")
del via_kohya
kohya = load_file(work / "lora" / "lora_kohya.safetensors")
assert any(k.startswith("lora_unet_") for k in kohya) and any(k.startswith("lora_te_") for k in kohya)
single = StableDiffusionPipeline.from_single_file(
    str(work / "single" / "model.safetensors"), config=sd, local_files_only=True,
    torch_dtype=torch.float32, safety_checker=None, requires_safety_checker=False)
generate(single)
from_single = StableDiffusionPipeline.from_pretrained(str(work / "from-single"), safety_checker=None)
generate(from_single)
print("single file: from_single_file loads difftrain's file and generates; the folder trained from it loads")
told = StableDiffusionPipeline.from_pretrained(str(work / "told"), safety_checker=None)
conv = StableDiffusionPipeline.from_pretrained(str(work / "data" / "sd15_conventional"), safety_checker=None)
for name in ("unet", "vae", "text_encoder"):
    a, b = (dict(c) if isinstance(c, dict) else c.to_dict()
            for c in (getattr(told, name).config, getattr(conv, name).config))
    for key in ("block_out_channels", "layers_per_block", "cross_attention_dim", "attention_head_dim",
                "norm_num_groups", "latent_channels", "hidden_size", "num_hidden_layers",
                "num_attention_heads", "intermediate_size", "down_block_types", "up_block_types"):
        if key in b:
            got, want = a[key], b[key]
            if isinstance(want, (list, tuple)) and not isinstance(got, (list, tuple)):
                got = [got] * len(want)
            if isinstance(got, (list, tuple)) and not isinstance(want, (list, tuple)):
                want = [want] * len(got)
            assert list(got) == list(want) if isinstance(got, (list, tuple)) else got == want, (name, key, got, want)
assert told.tokenizer("a photo of a cat").input_ids == conv.tokenizer("a photo of a cat").input_ids
generate(told)
print("single file without configs: the told configs are the pipeline's; diffusers loads and generates with the folder")
variant = StableDiffusionPipeline.from_pretrained(str(work / "variant"), variant="fp16",
                                                  torch_dtype=torch.float32, safety_checker=None)
assert variant.unet.dtype == torch.float32
generate(variant)
print("--variant fp16: the output folder loads with variant=\"fp16\" and generates")
full = StableDiffusionPipeline.from_pretrained(str(work / "full"), safety_checker=None)
trained = dict(full.unet.named_parameters())
moved = sum(not torch.equal(p, trained[n]) for n, p in base.unet.named_parameters() if n in trained)
assert moved > 0, "the full fine-tuning changed no UNet weight"
generate(full)
print(f"full fine-tuning: the pipeline folder loads and generates ({moved} tensors changed)")

from diffusers import StableDiffusionXLPipeline
xl = StableDiffusionXLPipeline.from_pretrained(sys.argv[3])
keys = load_file(work / "xl" / "pytorch_lora_weights.safetensors").keys()
assert {k.split(".")[0] for k in keys} == {"unet", "text_encoder", "text_encoder_2"}, keys
plain = generate(xl)
xl.load_lora_weights(str(work / "xl"))
assert not np.allclose(plain, generate(xl)), "the SDXL LoRA changed nothing"
kohya = load_file(work / "xl" / "lora_kohya.safetensors")
assert {k.split("_")[1] for k in kohya} == {"unet", "te1", "te2"}, sorted(kohya)[:4]
print("SDXL: load_lora_weights reads the UNet's and both text encoders' LoRA and generates")
xl_single = StableDiffusionXLPipeline.from_single_file(
    str(work / "xl-single" / "model.safetensors"), config=sys.argv[3], local_files_only=True,
    torch_dtype=torch.float32)
generate(xl_single)
first = load_file(work / "xl-single" / "model.safetensors")
second = load_file(work / "xl-from-single" / "model.safetensors")
assert set(first) == set(second), sorted(set(first) ^ set(second))[:5]
assert all(first[k].shape == second[k].shape for k in first)
print(f"SDXL single file: from_single_file loads difftrain's file and generates; trained again from "
      f"it, the file written back has its {len(first)} keys")
PY
cat "$work/python.out"
[ "$failures" -eq 0 ] && echo "train_text_to_image end to end: ok" || exit 1
