#!/usr/bin/env bash
# finetune_transformer end to end on a tiny Stable Diffusion 3 pipeline (with and without T5) and
# a captioned image folder that make_sd3_data.py writes: mistakes are refused before any work;
# LoRA on both streams' attention trains, its loss falls, a run stopped half way and resumed ends
# with the same LoRA as one that was not; full fine-tuning with another weighting scheme and
# without preconditioning writes a pipeline folder; the pipeline without T5 trains; diffusers
# loads both results (StableDiffusion3Pipeline.load_lora_weights with peft, from_pretrained) and
# generates with them; a full fine-tune as one SD3 file, trained again from that file, loaded by
# from_single_file. Then the same for two tiny CogVideoX pipelines and a folder of videos as
# frames: mistakes refused, LoRA resumed to the bit, full fine-tuning with the DPM scheduler, and
# diffusers' CogVideoXPipeline, given difftrain's LoRA or folder and the same starting noise,
# draws the validation video difftrain drew (within 2/255). Under torchrun with 2 ranks, full
# fine-tuning of either with DataParallel and with ZeRO stage 3 ends with the same transformer.
#
#   finetune_transformer.sh PROGRAM PYTHON GOLDEN_DIR WORKDIR [FASHION_MNIST_DIR]
set -uo pipefail
bin=$1 py=$2 golden=$3 work=$4 fmnist=${5:-/usr/share/datasets/fashion-mnist}
rm -rf "$work" && mkdir -p "$work"
# shellcheck source=common.sh
source "$(dirname "$0")/common.sh"
here=$(dirname "$0")
"$py" "$here/make_sd3_data.py" "$work/data" "$golden" "$fmnist" >"$work/make.out" 2>&1 ||
  { cat "$work/make.out"; echo "FAIL: making the test data"; exit 1; }
sd3=$work/data/sd3 images=$work/data/images
base=(--pretrained_model_name_or_path "$sd3" --train_data_dir "$images" --resolution 32
      --train_batch_size 4 --seed 3 --num_inference_steps 3 --num_validation_images 2
      --dataloader_num_workers 2 --threads 1 --center_crop)

# Mistakes, each refused with a typed error naming it, before training.
expect_rc 0 help -- "$bin" --help
grep_in "$work/help.out" "--weighting_scheme"
expect_rc 2 no-pipeline -- "$bin" "${base[@]}" --pretrained_model_name_or_path "$images" --output_dir "$work/bad"
grep_in "$work/no-pipeline.err" "model_index.json"
expect_rc 2 scheme -- "$bin" "${base[@]}" --weighting_scheme lognorm --output_dir "$work/bad"
grep_in "$work/scheme.err" "--weighting_scheme"
expect_rc 2 resolution -- "$bin" "${base[@]}" --resolution 36 --output_dir "$work/bad"
grep_in "$work/resolution.err" "--resolution"
mkdir -p "$work/sd1" && cp -r "$sd3"/. "$work/sd1/" &&
  sed -i 's/StableDiffusion3Pipeline/StableDiffusionPipeline/' "$work/sd1/model_index.json"
expect_rc 2 other-pipeline -- "$bin" "${base[@]}" --pretrained_model_name_or_path "$work/sd1" --output_dir "$work/bad"
grep_in "$work/other-pipeline.err" "StableDiffusion3Pipeline"
[ -e "$work/bad/checkpoints" ] && fail "a refused run left checkpoints"

# LoRA (rank 4, alpha 8): once straight through, once stopped at step 8 and resumed.
lora=("${base[@]}" --use_lora --rank 4 --lora_alpha 8 --learning_rate 2e-3 --max_train_steps 24
      --checkpointing_steps 4 --validation_prompt "a photo of a sneaker")
expect_rc 0 lora -- "$bin" "${lora[@]}" --output_dir "$work/lora"
grep_in "$work/lora.err" "skipped .*broken.jpg"
expect_rc 130 lora-stopped -- "$bin" "${lora[@]}" --output_dir "$work/lora-resumed" --stop_at 8
expect_rc 2 lora-again -- "$bin" "${lora[@]}" --output_dir "$work/lora-resumed"
grep_in "$work/lora-again.err" "--resume_from_checkpoint"
expect_rc 0 lora-resumed -- "$bin" "${lora[@]}" --output_dir "$work/lora-resumed" --resume_from_checkpoint latest
grep_in "$work/lora-resumed.err" "continuing from .*checkpoint-8.pt"

# Schedule-free AdamW by kohya's name, with validation images every 2 steps (each shows the
# evaluation weights; the checkpoint at the same step holds the training weights): stopped at
# step 4 and resumed, it ends with the LoRA of the run straight through. Prodigy by name.
sf=("${base[@]}" --use_lora --rank 4 --learning_rate 2e-3 --max_train_steps 6 --checkpointing_steps 2
    --validation_prompt "a photo of a sneaker" --validation_steps 2 --optimizer_type AdamWScheduleFree)
expect_rc 0 schedulefree -- "$bin" "${sf[@]}" --output_dir "$work/schedulefree"
grep_in "$work/schedulefree/results.json" '"optimizer": "adamw_schedulefree"'
expect_rc 130 schedulefree-stopped -- "$bin" "${sf[@]}" --output_dir "$work/schedulefree-resumed" --stop_at 4
expect_rc 0 schedulefree-resumed -- "$bin" "${sf[@]}" --output_dir "$work/schedulefree-resumed" \
  --resume_from_checkpoint latest
cmp -s "$work/schedulefree/pytorch_lora_weights.safetensors" \
  "$work/schedulefree-resumed/pytorch_lora_weights.safetensors" ||
  fail "the resumed schedule-free run ended with another LoRA"
expect_rc 0 prodigy -- "$bin" "${base[@]}" --use_lora --rank 4 --max_train_steps 2 --learning_rate 1 \
  --optimizer_type prodigyopt.Prodigy --optimizer_args "betas=(0.9, 0.99)" safeguard_warmup=True \
  --output_dir "$work/prodigy"
grep_in "$work/prodigy/results.json" '"optimizer": "prodigy"'

# kohya's options as its sd3_train takes them (tag shuffling with a kept token, caption dropout,
# ip_noise_gamma, Huber on the exponential schedule) with DoRA: stopped and resumed, the same
# LoRA; diffusers' StableDiffusion3Pipeline loads it as DoRA and draws other images than the base.
# Options for other noise schedules, Huber's snr schedule (SD3's flow has no ᾱ) and DoRA per
# input column (no PEFT form) are refused by name.
ko=("${base[@]}" --use_lora --use_dora --rank 4 --learning_rate 2e-3 --max_train_steps 6
    --checkpointing_steps 2 --shuffle_caption --keep_tokens 1 --caption_dropout_rate 0.3
    --ip_noise_gamma 0.1 --loss_type huber --huber_schedule exponential --huber_c 0.2)
expect_rc 0 kohya -- "$bin" "${ko[@]}" --output_dir "$work/kohya"
grep_in "$work/kohya/results.json" '"loss_type": "huber"'
expect_rc 130 kohya-stopped -- "$bin" "${ko[@]}" --output_dir "$work/kohya-resumed" --stop_at 4
expect_rc 0 kohya-resumed -- "$bin" "${ko[@]}" --output_dir "$work/kohya-resumed" --resume_from_checkpoint latest
cmp -s "$work/kohya/pytorch_lora_weights.safetensors" "$work/kohya-resumed/pytorch_lora_weights.safetensors" ||
  fail "the resumed run with kohya's options ended with another LoRA"
"$py" - "$work" "$sd3" >"$work/kohya-check.out" 2>&1 <<'PY' || { cat "$work/kohya-check.out"; fail "DoRA LoRA in diffusers"; }
import pathlib, sys
import numpy as np, torch
from diffusers import StableDiffusion3Pipeline
from diffusers.utils import logging as dlogging
dlogging.set_verbosity_error()
work, sd3 = pathlib.Path(sys.argv[1]), sys.argv[2]
def generate(pipe):
    return pipe("a photo of a sneaker", num_inference_steps=2, height=32, width=32, output_type="np",
                generator=torch.Generator().manual_seed(0)).images
plain = generate(StableDiffusion3Pipeline.from_pretrained(sd3))
pipe = StableDiffusion3Pipeline.from_pretrained(sd3)
pipe.load_lora_weights(str(work / "kohya"), weight_name="pytorch_lora_weights.safetensors")
assert pipe.transformer.peft_config["default_0"].use_dora
adapted = generate(pipe)
assert np.isfinite(adapted).all() and not np.allclose(adapted, plain)
print("SD3 DoRA LoRA loads in diffusers as DoRA")
PY
expect_rc 2 kohya-offset -- "$bin" "${base[@]}" --noise_offset 0.1 --output_dir "$work/bad"
grep_in "$work/kohya-offset.err" "--noise_offset"
expect_rc 2 kohya-huber-snr -- "$bin" "${base[@]}" --loss_type huber --output_dir "$work/bad"
grep_in "$work/kohya-huber-snr.err" "--huber_schedule"
expect_rc 2 dora-input -- "$bin" "${base[@]}" --use_lora --use_dora --dora_wd_on_output false --output_dir "$work/bad"
grep_in "$work/dora-input.err" "--dora_wd_on_output"

# Full fine-tuning: sigma_sqrt weighting, the loss on ε − x₀, gradient checkpointing, bf16.
expect_rc 0 full -- "$bin" "${base[@]}" --weighting_scheme sigma_sqrt --precondition_outputs 0 \
  --gradient_checkpointing --mixed_precision bf16 --learning_rate 5e-4 --max_train_steps 12 \
  --validation_prompt "a photo of a bag" --output_dir "$work/full"
# Without T5 (its tokens are zeros, as diffusers' pipeline gives them), mode density.
expect_rc 0 no-t5 -- "$bin" "${base[@]}" --pretrained_model_name_or_path "$work/data/sd3_no_t5" \
  --use_lora --weighting_scheme mode --max_train_steps 6 --output_dir "$work/no-t5"
grep_in "$work/no-t5/results.json" '"t5": false'
# SD3 as one file: a full fine-tune written in Stability's layout (bf16), trained again from that
# file (its configs from --single_file_config) and written back as one; refused without the
# config folder, with LoRA, and for CogVideoX.
expect_rc 0 sd3-single -- "$bin" "${base[@]}" --max_train_steps 2 --save_format single_file \
  --save_precision bf16 --output_dir "$work/sd3-single"
expect_rc 0 sd3-from-single -- "$bin" "${base[@]}" --pretrained_model_name_or_path \
  "$work/sd3-single/model.safetensors" --single_file_config "$sd3" --max_train_steps 2 \
  --output_dir "$work/sd3-from-single"
expect_rc 2 sd3-single-no-config -- "$bin" "${base[@]}" --pretrained_model_name_or_path \
  "$work/sd3-single/model.safetensors" --max_train_steps 1 --output_dir "$work/bad"
grep_in "$work/sd3-single-no-config.err" "--single_file_config"
expect_rc 2 sd3-single-lora -- "$bin" "${base[@]}" --use_lora --save_format single_file --output_dir "$work/bad"
grep_in "$work/sd3-single-lora.err" "--save_format single_file"
# A single file read without its config folder: the configs told from the keys (a model of SD3's
# conventions), CLIP's tokenizers from the BPE merges file and T5's from spiece.model. It trains
# to the bit as the same file read with --single_file_config does.
conv=$work/data/sd3_conventional bpe=$work/data/bpe_simple_vocab_16e6.txt.gz spm=$work/data/spiece.model
expect_rc 0 sd3-conv-single -- "$bin" "${base[@]}" --pretrained_model_name_or_path "$conv" \
  --max_train_steps 1 --save_format single_file --output_dir "$work/sd3-conv-single"
cf=$work/sd3-conv-single/model.safetensors
expect_rc 0 sd3-told-folder -- "$bin" "${base[@]}" --pretrained_model_name_or_path "$cf" \
  --single_file_config "$conv" --max_train_steps 2 --output_dir "$work/sd3-told-folder"
expect_rc 0 sd3-told -- "$bin" "${base[@]}" --pretrained_model_name_or_path "$cf" \
  --tokenizer_name "$bpe" --t5_tokenizer "$spm" --max_train_steps 2 --output_dir "$work/sd3-told"
cmp -s "$work/sd3-told-folder/model.safetensors" "$work/sd3-told/model.safetensors" ||
  fail "the SD3 file read with told configs trained differently from the file read with its folder"
expect_rc 2 sd3-told-no-t5 -- "$bin" "${base[@]}" --pretrained_model_name_or_path "$cf" \
  --tokenizer_name "$bpe" --max_train_steps 1 --output_dir "$work/bad"
grep_in "$work/sd3-told-no-t5.err" "--t5_tokenizer"
expect_rc 2 sd3-told-yaml -- "$bin" "${base[@]}" --pretrained_model_name_or_path "$cf" \
  --tokenizer_name "$bpe" --t5_tokenizer "$spm" --original_config "$work/x.yaml" --max_train_steps 1 \
  --output_dir "$work/bad"
grep_in "$work/sd3-told-yaml.err" "--original_config"
expect_rc 2 sd3-folder-t5-tokenizer -- "$bin" "${base[@]}" --t5_tokenizer "$spm" --max_train_steps 1 \
  --output_dir "$work/bad"
grep_in "$work/sd3-folder-t5-tokenizer.err" "goes with a single file"
expect_rc 2 sd3-told-one-tokenizer -- "$bin" "${base[@]}" --pretrained_model_name_or_path "$cf" \
  --tokenizer_name "$conv/tokenizer" --t5_tokenizer "$spm" --max_train_steps 1 --output_dir "$work/bad"
grep_in "$work/sd3-told-one-tokenizer.err" "tokenizer_2/"

"$py" - "$work" "$sd3" >"$work/python.out" 2>&1 <<'PY' || { fail "Python check"; }
import json, math, pathlib, sys
import numpy as np
import torch
from safetensors.torch import load_file
from diffusers import StableDiffusion3Pipeline
from diffusers.utils import logging as dlogging
dlogging.set_verbosity_error()
work, sd3 = pathlib.Path(sys.argv[1]), sys.argv[2]
for run in ("lora", "lora-resumed", "full", "no-t5"):
    r = json.loads((work / run / "results.json").read_text())
    assert r["finished"] and math.isfinite(r["last_loss"]), (run, r)
    print(f"{run}: loss {r['first_loss']:.4f} -> {r['last_loss']:.4f}")
r = json.loads((work / "lora" / "results.json").read_text())
assert r["last_loss"] < r["first_loss"], "the LoRA run's loss did not fall"
# Stopped and resumed equals straight through, to the bit.
a = load_file(work / "lora" / "pytorch_lora_weights.safetensors")
b = load_file(work / "lora-resumed" / "pytorch_lora_weights.safetensors")
assert a.keys() == b.keys() and all(k.startswith("transformer.") for k in a)
assert all(torch.equal(a[k], b[k]) for k in a), "the resumed run's LoRA differs"

def generate(pipe):
    out = pipe("a photo of a sneaker", num_inference_steps=2, height=32, width=32,
               output_type="np", generator=torch.Generator().manual_seed(0)).images
    assert out.shape == (1, 32, 32, 3) and np.isfinite(out).all(), out.shape
    return out

base = StableDiffusion3Pipeline.from_pretrained(sd3)
plain = generate(base)
base.load_lora_weights(str(work / "lora"))
config = base.transformer.peft_config["default_0"]
assert (config.r, config.lora_alpha) == (4, 8.0), (config.r, config.lora_alpha)
adapted = generate(base)
assert not np.allclose(plain, adapted), "the LoRA changed nothing"
print("load_lora_weights: rank 4, alpha 8 from the file's metadata; generates, differently")
full = StableDiffusion3Pipeline.from_pretrained(str(work / "full"))
fresh = StableDiffusion3Pipeline.from_pretrained(sd3)
trained = dict(full.transformer.named_parameters())
moved = sum(not torch.equal(p, trained[n]) for n, p in fresh.transformer.named_parameters())
assert moved > 0, "the full fine-tuning changed no weight"
generate(full)
print(f"full fine-tuning: the pipeline folder loads and generates ({moved} tensors changed)")
from diffusers import SD3Transformer2DModel
first = load_file(work / "sd3-single" / "model.safetensors")
second = load_file(work / "sd3-from-single" / "model.safetensors")
assert set(first) == set(second) and all(first[k].shape == second[k].shape for k in first)
assert any(k.startswith("text_encoders.t5xxl.") for k in first) and first[
    "model.diffusion_model.pos_embed"].dtype == torch.bfloat16
for run in ("sd3-single", "sd3-from-single"):
    single = SD3Transformer2DModel.from_single_file(
        str(work / run / "model.safetensors"), config=sd3, subfolder="transformer",
        local_files_only=True, torch_dtype=torch.float32)
    pipe = StableDiffusion3Pipeline.from_pretrained(sd3, transformer=single)
    generate(pipe)
print(f"SD3 single file: {len(first)} keys in Stability's layout; from_single_file loads the "
      "transformer of both files and the pipeline generates with it")
conv = str(work / "data" / "sd3_conventional")
told = SD3Transformer2DModel.from_single_file(
    str(work / "sd3-told" / "model.safetensors"), config=conv, subfolder="transformer",
    local_files_only=True, torch_dtype=torch.float32)
generate(StableDiffusion3Pipeline.from_pretrained(conv, transformer=told))
print("SD3 single file read with told configs and tokenizer files: trained as with its folder "
      "(the same bytes), and from_single_file loads what it wrote")
PY
cat "$work/python.out"
for run in lora full; do
  [ -s "$work/$run/validation.png" ] || fail "$run wrote no validation.png"
  ls "$work/$run/tensorboard"/events.out.tfevents.* >/dev/null 2>&1 || fail "$run wrote no event file"
done

# Under torchrun with 2 ranks (each its own batches of 2): full fine-tuning with checkpointed
# blocks, where every transformer block is a unit, with DataParallel and with ZeRO stage 3 (the
# other rank's share of each block freed outside its forward and backward and gathered again for
# its recompute) ends with the same transformer; rank 0 alone writes the outputs.
export GLOO_SOCKET_IFNAME=lo
launch=("$(dirname "$py")/torchrun" --standalone --nproc-per-node 2 --no-python "$bin")
ranks=("${base[@]}" --train_batch_size 2 --learning_rate 5e-4 --max_train_steps 6 --rank_timeout 120
       --gradient_checkpointing)
expect_rc 0 ranks-dp -- "${launch[@]}" "${ranks[@]}" --output_dir "$work/ranks-dp"
expect_rc 0 ranks-zero3 -- "${launch[@]}" "${ranks[@]}" --sharding 3 --output_dir "$work/ranks-zero3"
[ "$(grep -c "full fine-tuning: 6 steps" "$work/ranks-zero3.out")" -eq 1 ] ||
  fail "the stage-3 run should report once (rank 0)"
"$py" - "$work" >"$work/python-ranks.out" 2>&1 <<'PY' || { cat "$work/python-ranks.out"; fail "torchrun check"; }
import json, pathlib, sys
from safetensors.torch import load_file
work = pathlib.Path(sys.argv[1])
for run in ("ranks-dp", "ranks-zero3"):
    r = json.loads((work / run / "results.json").read_text())
    assert r["finished"] and r["ranks"] == 2, (run, r)
a, b = (load_file(work / run / "transformer" / "diffusion_pytorch_model.safetensors")
        for run in ("ranks-dp", "ranks-zero3"))
assert a.keys() == b.keys()
worst = max(float((a[k] - b[k]).abs().max()) for k in a)
assert worst <= 1e-5, f"stage 3 ends {worst} from DataParallel"
print(f"torchrun, 2 ranks: stage 3 ends {worst:.1e} from DataParallel ({len(a)} tensors)")
PY
cat "$work/python-ranks.out"

# ---- CogVideoX: two tiny pipelines (rotary + DDIM, sine-cosine table + DPM) and a video folder.
"$py" "$here/make_cogvideox_data.py" "$work/cog" "$golden" "$fmnist" >"$work/make-cog.out" 2>&1 ||
  { cat "$work/make-cog.out"; echo "FAIL: making the CogVideoX test data"; exit 1; }
videos=$work/cog/videos
cog=(--pretrained_model_name_or_path "$work/cog/cogvideox" --train_data_dir "$videos"
     --caption_column prompts.txt --video_column videos.txt --height 32 --width 32
     --train_batch_size 2 --seed 3 --num_inference_steps 3 --num_validation_images 1 --threads 1
     --validation_prompt "a bag sliding to the left")
expect_rc 2 cog-captions -- "$bin" "${cog[@]}" --caption_column captions.txt --output_dir "$work/bad-cog"
grep_in "$work/cog-captions.err" "--caption_column"
expect_rc 2 cog-height -- "$bin" "${cog[@]}" --height 36 --output_dir "$work/bad-cog"
expect_rc 2 cog-single -- "$bin" "${cog[@]}" --save_format single_file --output_dir "$work/bad-cog"
grep_in "$work/cog-single.err" "SAT checkpoints are read"
grep_in "$work/cog-height.err" "--height"
mkdir -p "$work/cog/mp4" && printf 'a clip\n' >"$work/cog/mp4/prompts.txt" &&
  printf 'clip.mp4\n' >"$work/cog/mp4/videos.txt" && : >"$work/cog/mp4/clip.mp4"
expect_rc 2 cog-mp4 -- "$bin" "${cog[@]}" --train_data_dir "$work/cog/mp4" --output_dir "$work/bad-cog"
grep_in "$work/cog-mp4.err" "clip.mp4"
mkdir -p "$work/cog/nothing"
expect_rc 2 cog-nothing -- "$bin" "${cog[@]}" --train_data_dir "$work/cog/nothing" --output_dir "$work/bad-cog"
grep_in "$work/cog-nothing.err" "labels/"
[ -e "$work/bad-cog/checkpoints" ] && fail "a refused CogVideoX run left checkpoints"
cog_lora=("${cog[@]}" --use_lora --rank 4 --lora_alpha 8 --learning_rate 2e-3 --max_train_steps 24
          --checkpointing_steps 4)
expect_rc 0 cog-lora -- "$bin" "${cog_lora[@]}" --output_dir "$work/cog-lora"
expect_rc 130 cog-lora-stopped -- "$bin" "${cog_lora[@]}" --output_dir "$work/cog-lora-resumed" --stop_at 8
expect_rc 0 cog-lora-resumed -- "$bin" "${cog_lora[@]}" --output_dir "$work/cog-lora-resumed" \
  --resume_from_checkpoint latest
# Video files: the same clips as lossless FFV1 MKVs in SAT's layout (videos/ + labels/) train the
# LoRA the frame folders train, to the bit; validation videos are also H.264 MP4s PyAV plays.
"$py" - "$videos" "$work/cog/sat_layout" >"$work/make-mkv.out" 2>&1 <<'PY' || { cat "$work/make-mkv.out"; fail "making the MKV clips"; }
import pathlib, sys
import av
import numpy as np
from PIL import Image
src, dst = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
(dst / "videos").mkdir(parents=True)
(dst / "labels").mkdir()
names = (src / "videos.txt").read_text().splitlines()
prompts = (src / "prompts.txt").read_text().splitlines()
for name, prompt in zip(names, prompts):
    with av.open(str(dst / "videos" / f"{name}.mkv"), "w") as out:
        s = out.add_stream("ffv1", rate=8)
        s.width, s.height, s.pix_fmt = 40, 40, "bgr0"
        for f in sorted((src / name).glob("*.png")):
            rgb = np.asarray(Image.open(f).convert("RGB"))
            for p in s.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")):
                out.mux(p)
        for p in s.encode():
            out.mux(p)
    (dst / "labels" / f"{name}.txt").write_text(prompt + "\n")
PY
cog_short=("${cog[@]}" --use_lora --rank 4 --learning_rate 2e-3 --max_train_steps 3 --num_validation_images 1)
expect_rc 0 cog-frames3 -- "$bin" "${cog_short[@]}" --output_dir "$work/cog-frames3"
expect_rc 0 cog-sat-layout -- "$bin" "${cog_short[@]}" --train_data_dir "$work/cog/sat_layout" \
  --output_dir "$work/cog-sat-layout"
cmp -s "$work/cog-frames3/pytorch_lora_weights.safetensors" \
  "$work/cog-sat-layout/pytorch_lora_weights.safetensors" ||
  fail "the MKV clips in SAT's layout trained another LoRA than their frame folders"
grep_in "$work/cog-sat-layout/results.json" '"frames": 9'
cmp -s "$work/cog-frames3/validation.png" "$work/cog-sat-layout/validation.png" ||
  fail "the MKV clips' run drew another validation video than the frame folders' run"
"$py" - "$work/cog-sat-layout/validation/video-0.mp4" >"$work/mp4-check.out" 2>&1 <<'PY' || { cat "$work/mp4-check.out"; fail "validation MP4"; }
import sys
import av
with av.open(sys.argv[1]) as f:
    s = f.streams.video[0]
    frames = [fr.to_ndarray(format="rgb24") for fr in f.decode(s)]
assert s.codec_context.name in ("h264", "mpeg4") and len(frames) == 9, (s.codec_context.name, len(frames))
assert frames[0].shape == (32, 32, 3), frames[0].shape
print(f"validation MP4: {len(frames)} frames of {s.codec_context.name}, {float(s.average_rate)} fps")
PY
cat "$work/mp4-check.out"
# kohya's options on CogVideoX: caption dropout, ip_noise_gamma and the L1 loss in its weighting.
expect_rc 0 cog-kohya -- "$bin" "${cog[@]}" --use_lora --rank 4 --max_train_steps 2 --loss_type l1 \
  --ip_noise_gamma 0.05 --caption_dropout_rate 0.5 --output_dir "$work/cog-kohya"
grep_in "$work/cog-kohya/results.json" '"loss_type": "l1"'
# Full fine-tuning of the sine-cosine, DPM pipeline: checkpointed blocks, bf16, random flips.
expect_rc 0 cog-full -- "$bin" "${cog[@]}" --pretrained_model_name_or_path "$work/cog/cogvideox_2b" \
  --gradient_checkpointing --mixed_precision bf16 --random_flip --learning_rate 5e-4 \
  --max_train_steps 8 --output_dir "$work/cog-full"
# The same model as the SAT training code keeps it (mp_rank_00_model_states.pt beside DeepSpeed's
# objects, 3d-vae.pt), its configs from the folder: trains to the same transformer, to the bit, as
# the folder does, and the folder it writes holds the VAE read from 3d-vae.pt.
"$py" - "$work/cog/cogvideox_2b" "$work/sat" "$here/../reference" >"$work/make-sat.out" 2>&1 <<'PY' || { cat "$work/make-sat.out"; fail "making the SAT checkpoints"; }
import pathlib, sys
import torch
sys.path.insert(0, sys.argv[3])
import ref_cogvideox_sat as r
from diffusers import AutoencoderKLCogVideoX, CogVideoXTransformer3DModel
src, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)
t = CogVideoXTransformer3DModel.from_pretrained(src / "transformer")
r.deepspeed_file(r.to_sat_transformer(t, dict(t.config)), out / "mp_rank_00_model_states.pt", 1000)
torch.save({"state_dict": r.to_sat_vae(AutoencoderKLCogVideoX.from_pretrained(src / "vae"))},
           out / "3d-vae.pt")
PY
sat_run=("${cog[@]}" --learning_rate 5e-4 --max_train_steps 2)
expect_rc 0 cog-folder-base -- "$bin" "${sat_run[@]}" --pretrained_model_name_or_path "$work/cog/cogvideox_2b" \
  --output_dir "$work/cog-folder-base"
expect_rc 0 cog-sat -- "$bin" "${sat_run[@]}" --pretrained_model_name_or_path \
  "$work/sat/mp_rank_00_model_states.pt" --single_file_config "$work/cog/cogvideox_2b" \
  --sat_vae "$work/sat/3d-vae.pt" --output_dir "$work/cog-sat"
cmp -s "$work/cog-folder-base/transformer/diffusion_pytorch_model.safetensors" \
  "$work/cog-sat/transformer/diffusion_pytorch_model.safetensors" ||
  fail "the SAT checkpoint trained differently from its folder"
expect_rc 2 cog-sat-no-config -- "$bin" "${sat_run[@]}" --pretrained_model_name_or_path \
  "$work/sat/mp_rank_00_model_states.pt" --output_dir "$work/bad-cog"
grep_in "$work/cog-sat-no-config.err" "--single_file_config"
"$py" - "$work" >"$work/python-sat.out" 2>&1 <<'PY' || { cat "$work/python-sat.out"; fail "SAT Python check"; }
import pathlib, sys
import torch
from diffusers import AutoencoderKLCogVideoX, CogVideoXPipeline
work = pathlib.Path(sys.argv[1])
base = AutoencoderKLCogVideoX.from_pretrained(work / "cog" / "cogvideox_2b" / "vae").state_dict()
pipe = CogVideoXPipeline.from_pretrained(work / "cog-sat")
assert all(torch.equal(v, base[k]) for k, v in pipe.vae.state_dict().items())
print("SAT checkpoints: trained as the folder, and diffusers loads the folder written")
PY
cat "$work/python-sat.out"
# Under torchrun with 2 ranks: DataParallel and stage 3 end with the same transformer.
cog_ranks=("${cog[@]}" --train_batch_size 1 --learning_rate 5e-4 --max_train_steps 3 --rank_timeout 120)
expect_rc 0 cog-ranks-dp -- "${launch[@]}" "${cog_ranks[@]}" --output_dir "$work/cog-ranks-dp"
expect_rc 0 cog-ranks-zero3 -- "${launch[@]}" "${cog_ranks[@]}" --sharding 3 --output_dir "$work/cog-ranks-zero3"
"$py" - "$work" >"$work/python-cog.out" 2>&1 <<'PY' || { fail "CogVideoX Python check"; }
import json, math, pathlib, sys
import numpy as np
import torch
from PIL import Image
from safetensors.torch import load_file
from diffusers import CogVideoXPipeline
from diffusers.utils import logging as dlogging
dlogging.set_verbosity_error()
work = pathlib.Path(sys.argv[1])
for run in ("cog-lora", "cog-lora-resumed", "cog-full"):
    r = json.loads((work / run / "results.json").read_text())
    assert r["finished"] and math.isfinite(r["last_loss"]), (run, r)
    assert (r["frames"], r["latent_frames"]) == (9, 3), r
    print(f"{run}: loss {r['first_loss']:.4f} -> {r['last_loss']:.4f}")
r = json.loads((work / "cog-lora" / "results.json").read_text())
assert r["last_loss"] < r["first_loss"], "the CogVideoX LoRA run's loss did not fall"
a = load_file(work / "cog-lora" / "pytorch_lora_weights.safetensors")
b = load_file(work / "cog-lora-resumed" / "pytorch_lora_weights.safetensors")
assert a.keys() == b.keys() and all(k.startswith("transformer.") for k in a)
assert all(torch.equal(a[k], b[k]) for k in a), "the resumed CogVideoX run's LoRA differs"
# 2 ranks: stage 3 ends where DataParallel ends.
a, b = (load_file(work / run / "transformer" / "diffusion_pytorch_model.safetensors")
        for run in ("cog-ranks-dp", "cog-ranks-zero3"))
assert all(json.loads((work / run / "results.json").read_text())["ranks"] == 2
           for run in ("cog-ranks-dp", "cog-ranks-zero3"))
worst = max(float((a[k] - b[k]).abs().max()) for k in a)
assert worst <= 1e-5, f"CogVideoX at stage 3 ends {worst} from DataParallel"
print(f"CogVideoX, torchrun, 2 ranks: stage 3 ends {worst:.1e} from DataParallel")

def frames_of(run):
    folder = work / run / "validation" / "video-0"
    return np.stack([np.asarray(Image.open(folder / f"frame-{k:04d}.png")) for k in range(9)])

def generate(pipe):
    # The noise difftrain's validation starts from: a CPU generator seeded with --seed + 7.
    g = torch.Generator().manual_seed(3 + 7)
    latents = torch.randn(1, 3, 4, 8, 8, generator=g)
    out = pipe("a bag sliding to the left", num_inference_steps=3, guidance_scale=5.0, height=32,
               width=32, num_frames=9, max_sequence_length=16, latents=latents, generator=g,
               output_type="np").frames[0]
    return np.round(out * 255).astype(np.int64)

# diffusers' pipeline with difftrain's LoRA draws the video difftrain drew after training.
pipe = CogVideoXPipeline.from_pretrained(str(work / "cog" / "cogvideox"))
pipe.load_lora_weights(str(work / "cog-lora"))
config = pipe.transformer.peft_config["default_0"]
assert (config.r, config.lora_alpha) == (4, 8.0), (config.r, config.lora_alpha)
mine, theirs = frames_of("cog-lora"), generate(pipe)
diff = np.abs(mine - theirs).max()
print(f"LoRA video: diffusers' pipeline vs difftrain's validation frames, max difference {diff}/255")
assert diff <= 2, diff
full = CogVideoXPipeline.from_pretrained(str(work / "cog-full"))
fresh = CogVideoXPipeline.from_pretrained(str(work / "cog" / "cogvideox_2b"))
trained = dict(full.transformer.named_parameters())
moved = sum(not torch.equal(p, trained[n]) for n, p in fresh.transformer.named_parameters())
assert moved > 0, "the full fine-tuning changed no weight"
mine, theirs = frames_of("cog-full"), generate(full)
diff = np.abs(mine - theirs).max()
print(f"full fine-tuning (DPM): {moved} tensors changed; the video differs by at most {diff}/255")
assert diff <= 2, diff
PY
cat "$work/python-cog.out"
for run in cog-lora cog-full; do
  [ -s "$work/$run/validation.png" ] || fail "$run wrote no validation.png"
  ls "$work/$run/tensorboard"/events.out.tfevents.* >/dev/null 2>&1 || fail "$run wrote no event file"
done
[ "$failures" -eq 0 ] && echo "finetune_transformer end to end: ok" || exit 1
