#!/usr/bin/env bash
# finetune_transformer's video options end to end on tiny CogVideoX pipelines that
# make_cogvideox_video_data.py writes, with H.264 clips in the SAT guide's layout: mistakes are
# refused before any work; CogVideoX 1.5 (patch_size_t 2) trains on 9 frames (3 latent frames,
# padded to 4) chosen by SAT's sampling at a training fps, and diffusers' CogVideoXPipeline with
# difftrain's LoRA and use_dynamic_cfg draws the validation video difftrain drew; image-to-video
# for 1.5 (ofs, DPM, a given first frame) likewise through CogVideoXImageToVideoPipeline; a 1.0
# image-to-video model (5B-I2V's learned positions) fully fine-tuned writes a folder that pipeline
# loads and draws the same video from. Validation videos are MP4 and GIF files PyAV plays.
#
#   finetune_transformer_video.sh PROGRAM PYTHON GOLDEN_DIR WORKDIR [FASHION_MNIST_DIR]
set -uo pipefail
bin=$1 py=$2 golden=$3 work=$4 fmnist=${5:-/usr/share/datasets/fashion-mnist}
rm -rf "$work" && mkdir -p "$work"
# shellcheck source=common.sh
source "$(dirname "$0")/common.sh"
here=$(dirname "$0")
"$py" "$here/make_cogvideox_video_data.py" "$work/data" "$golden" "$fmnist" >"$work/make.out" 2>&1 ||
  { cat "$work/make.out"; echo "FAIL: making the test data"; exit 1; }
d=$work/data
base=(--train_data_dir "$d/clips" --height 32 --width 32 --max_num_frames 9 --frame_sampling sat
      --video_fps 5 --skip_frames_start 0 --train_batch_size 2 --seed 3 --num_inference_steps 3
      --num_validation_images 1 --threads 1 --validation_prompt "a bag sliding to the left")

# Mistakes, each refused naming the flag, before training.
expect_rc 2 sampling -- "$bin" "${base[@]}" --pretrained_model_name_or_path "$d/cog15" \
  --frame_sampling uniform --output_dir "$work/bad"
grep_in "$work/sampling.err" "--frame_sampling"
expect_rc 2 sat-frames -- "$bin" "${base[@]}" --pretrained_model_name_or_path "$d/cog15" \
  --max_num_frames 10 --output_dir "$work/bad"
grep_in "$work/sat-frames.err" "4k + 1"
expect_rc 2 t2v-image -- "$bin" "${base[@]}" --pretrained_model_name_or_path "$d/cog15" \
  --validation_images "$d/first.png" --output_dir "$work/bad"
grep_in "$work/t2v-image.err" "--validation_images"
expect_rc 2 ofs -- "$bin" "${base[@]}" --pretrained_model_name_or_path "$d/cog_i2v" --ofs 3 \
  --output_dir "$work/bad"
grep_in "$work/ofs.err" "--ofs"
expect_rc 2 images -- "$bin" "${base[@]}" --pretrained_model_name_or_path "$d/cog_i2v" \
  --validation_images "$d/first.png" "$d/first.png" "$d/first.png" --output_dir "$work/bad"
grep_in "$work/images.err" "3 images for 1"
[ -e "$work/bad/checkpoints" ] && fail "a refused run left checkpoints"

# CogVideoX 1.5 text-to-video LoRA at alpha 8 / rank 4, SAT's sampling at 5 fps of 10 fps clips,
# validation with the dynamic guidance schedule.
expect_rc 0 t2v15 -- "$bin" "${base[@]}" --pretrained_model_name_or_path "$d/cog15" --use_lora \
  --rank 4 --lora_alpha 8 --learning_rate 2e-3 --max_train_steps 8 --use_dynamic_cfg \
  --output_dir "$work/t2v15"
grep_in "$work/t2v15/results.json" '"padded_latent_frames": 4'
grep_in "$work/t2v15/results.json" '"frame_sampling": "sat"'
# CogVideoX 1.5 image-to-video LoRA (ofs 2, DPM), validated from a given first frame.
expect_rc 0 i2v15 -- "$bin" "${base[@]}" --pretrained_model_name_or_path "$d/cog15_i2v" --use_lora \
  --rank 4 --lora_alpha 8 --learning_rate 2e-3 --max_train_steps 8 --noised_image_dropout 0.1 \
  --validation_images "$d/first.png" --output_dir "$work/i2v15"
grep_in "$work/i2v15/results.json" '"image_to_video": true'
# CogVideoX 1.0 image-to-video, fully fine-tuned, validated from the first training clip.
expect_rc 0 i2v-full -- "$bin" "${base[@]}" --pretrained_model_name_or_path "$d/cog_i2v" \
  --learning_rate 5e-4 --max_train_steps 4 --output_dir "$work/i2v-full"

# Video buckets (finetrainers'): the 24-frame clips go to 17×32×32, the 14-frame ones to 9×32×32
# (the tiny 1.5 model's rotary grid holds 32×32 at most); with
# the latent and text caches on disk the run trains the LoRA it trains without them, to the bit,
# and a second run over the same cache encodes nothing.
bucketed=("${base[@]}" --pretrained_model_name_or_path "$d/cog15" --frame_sampling diffusers
          --max_num_frames 17 --video_resolution_buckets 17x32x32 9x32x32 --use_lora --rank 4
          --learning_rate 2e-3
          --max_train_steps 4 --random_flip)
expect_rc 2 buckets-sat -- "$bin" "${bucketed[@]}" --frame_sampling sat --output_dir "$work/bad"
grep_in "$work/buckets-sat.err" "--video_resolution_buckets"
expect_rc 2 buckets-frames -- "$bin" "${bucketed[@]}" --video_resolution_buckets 8x32x32 --output_dir "$work/bad"
grep_in "$work/buckets-frames.err" "4k + 1"
expect_rc 0 buckets -- "$bin" "${bucketed[@]}" --output_dir "$work/buckets"
grep_in "$work/buckets/results.json" '17x32x32: 2 clips'
grep_in "$work/buckets/results.json" '9x32x32: 2 clips'
expect_rc 0 cached -- "$bin" "${bucketed[@]}" --cache_latents --cache_dir "$work/cache" --output_dir "$work/cached"
grep_in "$work/cached.err" "8 encoded now"
expect_rc 0 cached-again -- "$bin" "${bucketed[@]}" --cache_latents --cache_dir "$work/cache" --output_dir "$work/cached-again"
grep_in "$work/cached-again.err" "0 encoded now"
for run in cached cached-again; do
  cmp -s "$work/buckets/pytorch_lora_weights.safetensors" "$work/$run/pytorch_lora_weights.safetensors" ||
    fail "$run trained another LoRA than the run without the cache"
done

"$py" - "$work" >"$work/python.out" 2>&1 <<'PY' || { cat "$work/python.out"; fail "Python checks"; }
import json, math, pathlib, sys
import av
import numpy as np
import torch
from PIL import Image
from diffusers import CogVideoXImageToVideoPipeline, CogVideoXPipeline
from diffusers.utils import logging as dlogging
dlogging.set_verbosity_error()
work = pathlib.Path(sys.argv[1])
d = work / "data"
prompt = "a bag sliding to the left"

def frames_of(run):
    folder = work / run / "validation" / "video-0"
    return np.stack([np.asarray(Image.open(folder / f"frame-{k:04d}.png")) for k in range(9)])

def noise(frames):
    # difftrain's validation noise: a CPU generator seeded with --seed + 7, (1, F', C, h, w).
    g = torch.Generator().manual_seed(3 + 7)
    return g, torch.randn(1, frames, 4, 8, 8, generator=g)

def draw(pipe, frames, **kw):
    g, latents = noise(frames)
    out = pipe(prompt=prompt, num_inference_steps=3, guidance_scale=5.0, height=32, width=32,
               num_frames=9, max_sequence_length=16, latents=latents, generator=g,
               output_type="np", **kw).frames[0]
    return np.round(out * 255).astype(np.int64)

for run in ("t2v15", "i2v15", "i2v-full"):
    r = json.loads((work / run / "results.json").read_text())
    assert r["finished"] and math.isfinite(r["last_loss"]), (run, r)
    assert (r["frames"], r["latent_frames"]) == (9, 3), r
    print(f"{run}: loss {r['first_loss']:.4f} -> {r['last_loss']:.4f}")
    for ext, codec in (("mp4", ("h264", "mpeg4")), ("gif", ("gif",))):
        with av.open(str(work / run / "validation" / f"video-0.{ext}")) as f:
            s = f.streams.video[0]
            got = [fr.to_ndarray(format="rgb24") for fr in f.decode(s)]
        assert s.codec_context.name in codec and len(got) == 9, (run, ext, len(got))
        assert got[0].shape == (32, 32, 3), got[0].shape
        if ext == "gif":
            mine = frames_of(run)
            psnr = 10 * math.log10(255 ** 2 / max(((np.stack(got) - mine) ** 2).mean(), 1e-12))
            assert psnr > 25, (run, psnr)
print("validation MP4s and GIFs: 9 frames each, PyAV plays them")

# 1.5 text-to-video: 3 latent frames padded to 4; the pipeline with the LoRA and dynamic CFG.
pipe = CogVideoXPipeline.from_pretrained(str(d / "cog15"))
pipe.load_lora_weights(str(work / "t2v15"))
assert (pipe.transformer.peft_config["default_0"].r,
        pipe.transformer.peft_config["default_0"].lora_alpha) == (4, 8.0)
mine, theirs = frames_of("t2v15"), draw(pipe, 4, use_dynamic_cfg=True)
diff = np.abs(mine - theirs).max()
print(f"CogVideoX 1.5 LoRA, dynamic CFG: diffusers' pipeline vs difftrain's video, max {diff}/255")
assert diff <= 2, diff
static = draw(pipe, 4)
assert np.abs(static - theirs).max() > 2, "use_dynamic_cfg changed nothing"

# 1.5 image-to-video from first.png (ofs 2, DPM).
image = Image.open(d / "first.png").convert("RGB")
pipe = CogVideoXImageToVideoPipeline.from_pretrained(str(d / "cog15_i2v"))
pipe.load_lora_weights(str(work / "i2v15"))
mine, theirs = frames_of("i2v15"), draw(pipe, 4, image=image)
diff = np.abs(mine - theirs).max()
print(f"CogVideoX 1.5 image-to-video LoRA: diffusers' pipeline vs difftrain's video, max {diff}/255")
assert diff <= 2, diff
report = json.loads((work / "i2v15" / "validation" / "videos.json").read_text())
print(f"first frame against the given image: PSNR {report[0]['first_frame_psnr']:.1f} dB")

# 1.0 image-to-video, full fine-tune from the first training clip's first frame.
full = CogVideoXImageToVideoPipeline.from_pretrained(str(work / "i2v-full"))
fresh = CogVideoXImageToVideoPipeline.from_pretrained(str(d / "cog_i2v"))
trained = dict(full.transformer.named_parameters())
moved = sum(not torch.equal(p, trained[n]) for n, p in fresh.transformer.named_parameters())
assert moved > 0, "the full fine-tuning changed no weight"
with av.open(str(d / "clips" / "videos" / "0.mp4")) as f:
    first = next(f.decode(video=0)).to_ndarray(format="rgb24")
# SAT's crop of the 48×40 frame to 32×32: resized to 38×32 (bicubic), columns 3..35.
t = torch.from_numpy(first).permute(2, 0, 1)[None].float()
t = torch.nn.functional.interpolate(t, size=(32, 38), mode="bicubic", antialias=True,
                                    align_corners=False).clamp(0, 255).round()
image = Image.fromarray(t[0, :, :, 3:35].permute(1, 2, 0).byte().numpy())
mine, theirs = frames_of("i2v-full"), draw(full, 3, image=image)
diff = np.abs(mine - theirs).max()
print(f"CogVideoX image-to-video, full: {moved} tensors changed; the video differs by {diff}/255")
assert diff <= 2, diff
PY
cat "$work/python.out"
[ "$failures" -eq 0 ] && echo "finetune_transformer video end to end: ok" || exit 1
