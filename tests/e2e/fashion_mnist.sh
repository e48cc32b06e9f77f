#!/usr/bin/env bash
# The Fashion-MNIST example end to end on a tiny configuration: --help, bad flags and output
# folders, the missing-dataset and corrupted-file errors, a full run (train, checkpoint, sample, grid, score), the refusal to
# overwrite a run, pausing and resuming to the same losses, and Ctrl-C saving a checkpoint that
# --resume continues from.
#
#   fashion_mnist.sh PROGRAM WORKDIR [DATA_DIR]
#   DIFFTRAIN_PYTHON  a Python with torch and diffusers: diffusers loads the run's unet/ folder
set -uo pipefail
bin=$1 work=$2 data=${3:-/usr/share/datasets/fashion-mnist}
rm -rf "$work" && mkdir -p "$work"
# shellcheck source=common.sh
source "$(dirname "$0")/common.sh"

tiny=(--data-dir "$data" --limit 512 --batch-size 16 --checkpoint-every 2 --keep 2
      --samples-per-class 2 --sample-steps 3 --classifier "$work/classifier.safetensors"
      --classifier-epochs 1 --min-classifier-accuracy 0 --seed 7 --threads 1)
# One intra-op thread: runs compared to the bit must sum in the same order (by default the count
# follows the machine's load, which differs between two runs on a loaded test machine).

expect_rc 0 help -- "$bin" --help
grep_in "$work/help.out" "--resume"
grep_in "$work/help.out" "--guidance"

expect_rc 2 missing -- "$bin" --data-dir "$work/no-such-dir" --out "$work/missing"
grep_in "$work/missing.err" "dataset-fashion-mnist"

mkdir -p "$work/corrupt"
for f in "$data"/*; do head -c 3000 "$f" >"$work/corrupt/$(basename "$f")"; done
expect_rc 2 corrupt -- "$bin" --data-dir "$work/corrupt" --out "$work/corrupt-run"
grep_in "$work/corrupt.err" "FormatError"

# Flags and paths checked before any work: out-of-range or non-finite numbers (CLI11's validation
# status 2, one "error:" line), an empty or impossible output folder and a data file that is a folder (status 2).
for bad in "--steps 9223372036854775807" "--lr 1e39" "--clip 1e300" "--p-uncond nan" \
           "--guidance nan" "--ema-decay 2" "--batch-size 0"; do
  # shellcheck disable=SC2086
  expect_rc 2 "flag${bad%% *}" -- "$bin" ${bad} --out "$work/flags"
  grep_in "$work/flag${bad%% *}.err" "must"
done
# CLI11's own findings read as every other mistake: one "error:" line, status 2.
expect_rc 2 unknown-flag -- "$bin" --no-such-flag 3 --out "$work/flags"
grep_in "$work/unknown-flag.err" "^error: .*no-such-flag"
[ "$(wc -l <"$work/unknown-flag.err")" -eq 1 ] || fail "an unknown flag printed more than one line"
expect_rc 2 bad-scheduler -- "$bin" --lr-scheduler cosine_annealing --out "$work/flags"
grep_in "$work/bad-scheduler.err" "lr-scheduler"
expect_rc 2 bad-ema-rule -- "$bin" --ema-rule polyak --out "$work/flags"
grep_in "$work/bad-ema-rule.err" "ema-rule"
expect_rc 2 bad-precision -- "$bin" --mixed_precision fp8 --out "$work/flags"
grep_in "$work/bad-precision.err" "mixed"
expect_rc 2 bad-ema-setting -- "$bin" "${tiny[@]}" --ema-settings '{"decay_rate": 0.9}' --out "$work/flags"
grep_in "$work/bad-ema-setting.err" "decay_rate"
expect_rc 2 empty-out -- "$bin" "${tiny[@]}" --out ""
grep_in "$work/empty-out.err" "ConfigError at --out"
touch "$work/a-file"
expect_rc 2 out-under-file -- "$bin" "${tiny[@]}" --out "$work/a-file/run"
grep_in "$work/out-under-file.err" "IoError"
mkdir -p "$work/folder-data"
for f in "$data"/*; do mkdir -p "$work/folder-data/$(basename "$f")"; done
expect_rc 2 folder-data -- "$bin" "${tiny[@]:2}" --data-dir "$work/folder-data" --out "$work/fd"
grep_in "$work/folder-data.err" "is a folder, not a file"

# A whole run.
expect_rc 0 full -- "$bin" "${tiny[@]}" --steps 6 --out "$work/a"
for f in samples.png loss.png lr.png loss.csv results.json ema.safetensors checkpoints/checkpoint-6.pt \
         unet/config.json unet/diffusion_pytorch_model.safetensors; do
  [ -s "$work/a/$f" ] || fail "the run did not write $f"
done
# Its TensorBoard event file, and progress lines (stderr is not a terminal: a line per 10 %).
[ "$(ls "$work/a/tensorboard" | grep -c '^events\.out\.tfevents\.')" -eq 1 ] ||
  fail "one event file expected in $work/a/tensorboard"
grep_in "$work/full.err" "train 6/6 \[#"
# Every long phase shows progress off a terminal too: sampling, scoring, and the classifier when
# this run trained it.
grep_in "$work/full.err" "sample [0-9]*/[0-9]* \[#"
grep_in "$work/full.err" "score [0-9]*/[0-9]* \[#"
if grep -q "test accuracy (trained" "$work/full.err"; then
  grep_in "$work/full.err" "classifier [0-9]*/[0-9]* \[#"
fi
grep_in "$work/a/results.json" '"class_accuracy"'
grep_in "$work/a/results.json" '"frechet_distance"'
grep_in "$work/full.out" "class accuracy of the samples"
[ "$(ls "$work/a/checkpoints" | wc -l)" -eq 2 ] || fail "keep 2 left $(ls "$work/a/checkpoints")"
[ "$(wc -l <"$work/a/loss.csv")" -eq 7 ] || fail "loss.csv should have a header and 6 rows"

# The UNet folder is diffusers' own model: from_pretrained loads it strictly, its weights are the
# EMA weights, and it denoises with the class tokens the run saved beside it.
if [ -n "${DIFFTRAIN_PYTHON:-}" ]; then
  "$DIFFTRAIN_PYTHON" - "$work/a" >"$work/diffusers.out" 2>&1 <<'PY' || { fail "diffusers check"; cat "$work/diffusers.out"; }
import sys
import torch
from diffusers import UNet2DConditionModel
from safetensors.torch import load_file
run = sys.argv[1]
unet = UNet2DConditionModel.from_pretrained(run + "/unet")
ema = load_file(run + "/ema.safetensors")
sd = unet.state_dict()
assert {"unet." + k for k in sd} == {k for k in ema if k.startswith("unet.")}
for k, v in sd.items():
    assert torch.equal(v, ema["unet." + k]), k
table = ema["context_emb.weight"]                     # (classes + 1, tokens x 2C)
width = unet.config.block_out_channels[-1]               # the context width, 2C
labels = torch.tensor([0, 3, 9, 10])
tokens = table[labels].view(4, -1, width)
with torch.no_grad():
    y = unet(torch.randn(4, 1, 28, 28), torch.tensor([10, 200, 500, 900]),
             encoder_hidden_states=tokens, class_labels=labels).sample
assert y.shape == (4, 1, 28, 28) and torch.isfinite(y).all(), y.shape
print("diffusers loads the run's UNet:", sum(p.numel() for p in unet.parameters()), "parameters")
PY
fi

# --model dit: diffusers' DiT trained with flow matching; a run pauses and resumes to the same
# losses, writes transformer/ (which diffusers loads: its weights are the EMA weights), and the
# other model's flags are refused by name before any work.
dit=(--model dit --dit-width 32 --dit-heads 2 --dit-depth 2 --dit-patch 7)
expect_rc 0 dit -- "$bin" "${tiny[@]}" "${dit[@]}" --steps 4 --out "$work/dit"
for f in transformer/config.json transformer/diffusion_pytorch_model.safetensors samples.png; do
  [ -s "$work/dit/$f" ] || fail "the DiT run did not write $f"
done
[ -e "$work/dit/unet" ] && fail "the DiT run wrote a unet/ folder"
grep_in "$work/dit.err" "DiT with [0-9]* parameters"
grep_in "$work/dit/results.json" '"model": "dit"'
grep_in "$work/dit/results.json" '"sampler": "euler"'
grep_in "$work/dit/results.json" '"prediction_type": "flow_matching"'
expect_rc 0 dit-pause -- "$bin" "${tiny[@]}" "${dit[@]}" --steps 4 --stop-at-step 2 --out "$work/dit2"
expect_rc 0 dit-resume -- "$bin" "${tiny[@]}" "${dit[@]}" --steps 4 --resume --out "$work/dit2"
cmp -s "$work/dit/loss.csv" "$work/dit2/loss.csv" || fail "the resumed DiT's losses differ"
expect_rc 2 dit-unet-flag -- "$bin" "${tiny[@]}" "${dit[@]}" --prediction-type epsilon --out "$work/x"
grep_in "$work/dit-unet-flag.err" "applies to --model unet"
expect_rc 2 unet-dit-flag -- "$bin" "${tiny[@]}" --dit-depth 3 --out "$work/x"
grep_in "$work/unet-dit-flag.err" "applies to --model dit"
expect_rc 2 dit-sampler -- "$bin" "${tiny[@]}" "${dit[@]}" --sampler ddim --out "$work/x"
grep_in "$work/dit-sampler.err" "euler"
expect_rc 2 dit-patch -- "$bin" "${tiny[@]}" --model dit --dit-patch 3 --out "$work/x"
grep_in "$work/dit-patch.err" "must divide 28"
if [ -n "${DIFFTRAIN_PYTHON:-}" ]; then
  "$DIFFTRAIN_PYTHON" - "$work/dit" >"$work/diffusers-dit.out" 2>&1 <<'PY' || { fail "diffusers DiT check"; cat "$work/diffusers-dit.out"; }
import sys
import torch
from diffusers import DiTTransformer2DModel
from safetensors.torch import load_file
run = sys.argv[1]
dit = DiTTransformer2DModel.from_pretrained(run + "/transformer").eval()
ema = load_file(run + "/ema.safetensors")
sd = dit.state_dict()
assert {"dit." + k for k in sd} == {k for k in ema if k.startswith("dit.")}
for k, v in sd.items():
    assert torch.equal(v, ema["dit." + k]), k
with torch.no_grad():
    y = dit(torch.randn(3, 1, 28, 28), timestep=torch.tensor([10, 500, 990]),
            class_labels=torch.tensor([0, 9, 10])).sample
assert y.shape == (3, 1, 28, 28) and torch.isfinite(y).all(), y.shape
print("diffusers loads the run's DiT:", sum(p.numel() for p in dit.parameters()), "parameters")
PY
fi

# --model flux-mini: diffusers' FluxTransformer2DModel on class captions, flow matching; its
# transformer/ loads in diffusers and holds the EMA weights; the UNet's and the DiT's flags and
# the noise-schedule samplers are refused by name.
expect_rc 0 flux -- "$bin" "${tiny[@]}" --model flux-mini --steps 4 --out "$work/flux"
grep_in "$work/flux.err" "Flux-mini with [0-9]* parameters"
grep_in "$work/flux/results.json" '"prediction_type": "flow_matching"'
expect_rc 2 flux-dit-flag -- "$bin" "${tiny[@]}" --model flux-mini --dit-depth 3 --out "$work/x"
grep_in "$work/flux-dit-flag.err" "applies to --model dit"
expect_rc 2 flux-sampler -- "$bin" "${tiny[@]}" --model flux-mini --sampler dpm++ --out "$work/x"
grep_in "$work/flux-sampler.err" "euler"
if [ -n "${DIFFTRAIN_PYTHON:-}" ]; then
  "$DIFFTRAIN_PYTHON" - "$work/flux" >"$work/diffusers-flux.out" 2>&1 <<'PY' || { fail "diffusers Flux-mini check"; cat "$work/diffusers-flux.out"; }
import sys
import torch
from diffusers import FluxTransformer2DModel
from safetensors.torch import load_file
run = sys.argv[1]
flux = FluxTransformer2DModel.from_pretrained(run + "/transformer").eval()
ema = load_file(run + "/ema.safetensors")
for k, v in flux.state_dict().items():
    assert torch.equal(v, ema["flux.transformer." + k]), k
# The caption "a photo of a sneaker" (label 7): its word tokens (numbered in order of first use
# over the ten captions, padded with 0 to the longest), their mean the pooled vector.
names = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker",
         "Bag", "Ankle boot"]
vocab = {}
for name in names:
    for w in ("a photo of a " + name.lower()).replace("/", " ").split():
        vocab.setdefault(w, len(vocab) + 1)
assert ema["flux.token_emb.weight"].shape[0] == len(vocab) + 1
longest = max(len(("a photo of a " + n).replace("/", " ").split()) for n in names)
ids = torch.tensor([vocab[w] for w in "a photo of a sneaker".split()] + [0])  # padded to 6
assert ids.numel() == longest
states = ema["flux.token_emb.weight"][ids].unsqueeze(0)
rows, cols = torch.meshgrid(torch.arange(7.0), torch.arange(7.0), indexing="ij")
img_ids = torch.stack([torch.zeros(49), rows.reshape(-1), cols.reshape(-1)], -1)
with torch.no_grad():
    y = flux(hidden_states=torch.randn(1, 49, 16), encoder_hidden_states=states,
             pooled_projections=states.mean(1), timestep=torch.tensor([0.5]), img_ids=img_ids,
             txt_ids=torch.zeros(ids.numel(), 3)).sample
assert y.shape == (1, 49, 16) and torch.isfinite(y).all(), y.shape
print("diffusers loads the run's Flux-mini:", sum(p.numel() for p in flux.parameters()), "parameters")
PY
fi

# A second run in the same place must not replace the first one's checkpoints.
expect_rc 2 again -- "$bin" "${tiny[@]}" --steps 6 --out "$work/a"
grep_in "$work/again.err" "--resume"

# Pause at step 3, resume to 6: the same losses, step for step, as the uninterrupted run.
expect_rc 0 pause -- "$bin" "${tiny[@]}" --steps 6 --stop-at-step 3 --out "$work/b"
grep_in "$work/pause.err" "paused at step 3"
[ -e "$work/b/results.json" ] && fail "a paused run should not sample"
expect_rc 0 resume -- "$bin" "${tiny[@]}" --steps 6 --resume --out "$work/b"
grep_in "$work/resume.err" "step 3"
cmp -s "$work/a/loss.csv" "$work/b/loss.csv" || {
  fail "resumed losses differ"; diff "$work/a/loss.csv" "$work/b/loss.csv"; }
cmp -s "$work/a/samples.png" "$work/b/samples.png" || fail "resumed samples differ"
# The resumed run adds an event file (its restart marker drops the paused run's later steps).
[ "$(ls "$work/b/tensorboard" | grep -c '^events\.out\.tfevents\.')" -eq 2 ] ||
  fail "two event files expected after a resume"
# A folder named with --tensorboard may hold other runs: a fresh run adds its file beside them.
mkdir -p "$work/shared-tb" && echo other >"$work/shared-tb/events.out.tfevents.1.other"
expect_rc 0 shared-tb -- "$bin" "${tiny[@]}" --steps 2 --tensorboard "$work/shared-tb" --out "$work/shared-run"
[ -s "$work/shared-tb/events.out.tfevents.1.other" ] || fail "another run's event file was removed"
[ "$(ls "$work/shared-tb" | grep -c '^events\.out\.tfevents\.')" -eq 2 ] || fail "no event file added"
expect_rc 0 no-tb -- "$bin" "${tiny[@]}" --steps 2 --no-tensorboard --progress-lines 0 --out "$work/no-tb"
[ -e "$work/no-tb/tensorboard" ] && fail "--no-tensorboard wrote a TensorBoard folder"
grep -q "train 2/2" "$work/no-tb.err" && fail "--progress-lines 0 printed progress"
# --profile-steps: the window after 10 warm-up steps, its table on stderr and a Chrome trace.
expect_rc 0 profile -- "$bin" "${tiny[@]}" --steps 13 --profile-steps 2 --no-tensorboard --out "$work/prof"
grep_in "$work/profile.err" "| difftrain::backward |"
grep_in "$work/profile.err" "2 steps, "
grep_in "$work/prof/profile.json" "difftrain::optimizer_step"
# diffusers' --resume_from_checkpoint with a file: the run goes on from that checkpoint's step.
expect_rc 0 resume-file -- "$bin" "${tiny[@]}" --steps 6 --overwrite \
  --resume_from_checkpoint "$work/b/checkpoints/checkpoint-4.pt" --out "$work/b2"
grep_in "$work/resume-file.err" "checkpoint-4.pt (step 4)"
# A checkpoint of the fused AdamW resumes under LibTorch's per-parameter one (same state).
expect_rc 0 resume-other-kernel -- "$bin" "${tiny[@]}" --steps 6 --overwrite --adam-kernel \
  per_parameter --resume_from_checkpoint "$work/b/checkpoints/checkpoint-4.pt" --out "$work/b4"
grep_in "$work/resume-other-kernel.err" "checkpoint-4.pt (step 4)"
# ... and under the multi-tensor one.
expect_rc 0 resume-foreach-kernel -- "$bin" "${tiny[@]}" --steps 6 --overwrite --adam-kernel \
  foreach --resume_from_checkpoint "$work/b/checkpoints/checkpoint-4.pt" --out "$work/b5"
grep_in "$work/resume-foreach-kernel.err" "checkpoint-4.pt (step 4)"
expect_rc 2 resume-missing -- "$bin" "${tiny[@]}" --steps 6 \
  --resume_from_checkpoint "$work/b/checkpoints/checkpoint-5.pt" --out "$work/b3"
grep_in "$work/resume-missing.err" "checkpoint-5.pt"
# diffusers' training flags: v-prediction, min-SNR, accumulation, Adam settings, a logging folder.
expect_rc 0 diffusers-flags -- "$bin" "${tiny[@]}" --steps 2 --prediction_type v_prediction \
  --snr_gamma 5 --gradient_accumulation_steps 2 --adam_beta1 0.85 --adam_beta2 0.99 \
  --adam_epsilon 1e-6 --logging_dir "$work/logs" --out "$work/df"
grep_in "$work/df/results.json" '"prediction_type": "v_prediction"'
grep_in "$work/df/results.json" '"gradient_accumulation_steps": 2'
[ "$(wc -l <"$work/logs/loss.csv")" -eq 3 ] || fail "the loss log is not in --logging_dir"
expect_rc 2 bad-beta -- "$bin" --adam_beta2 1.5 --out "$work/flags"
expect_rc 2 bad-kernel -- "$bin" --adam-kernel apex --out "$work/flags"
grep_in "$work/bad-kernel.err" "--adam-kernel"

# diffusers' flag names, and a config file whose values the command line overrides; the schedule
# chosen by name.
cat >"$work/run.toml" <<'TOML'
max_train_steps = 5
learning_rate = 0.002
lr_scheduler = "linear"
TOML
expect_rc 0 config -- "$bin" "${tiny[@]}" --config "$work/run.toml" --max_train_steps 3 \
  --output_dir "$work/cfg"
grep_in "$work/cfg/results.json" '"lr_scheduler": "linear"'
grep_in "$work/cfg/results.json" '"steps": 3'
grep_in "$work/cfg/results.json" '"lr": 0.002'
printf 'no_such_option = 1\n' >"$work/bad.toml"
expect_rc 2 bad-config -- "$bin" --config "$work/bad.toml" --out "$work/flags"
grep_in "$work/bad-config.err" "no_such_option"

# A stray file whose step does not fit in 64 bits is not a checkpoint: the run ignores it.
mkdir -p "$work/stray/checkpoints"
echo stray >"$work/stray/checkpoints/checkpoint-99999999999999999999999.pt"
expect_rc 0 stray -- "$bin" "${tiny[@]}" --steps 2 --out "$work/stray"
# The EMA rule and the precision chosen on the command line, recorded in results.json.
expect_rc 0 runtime-choices -- "$bin" "${tiny[@]}" --steps 2 --ema-rule ema_pytorch \
  --ema-settings '{"update_after_step": 0, "update_every": 1}' --mixed_precision bf16 --out "$work/rt"
grep_in "$work/rt/results.json" '"mixed_precision": "bf16"'
grep_in "$work/rt/results.json" '"rule": "ema_pytorch"'

# Ctrl-C: a checkpoint, status 130, and --resume goes on from it.
"$bin" "${tiny[@]}" --steps 100000 --out "$work/c" >"$work/sigint.out" 2>"$work/sigint.err" &
pid=$!
for _ in $(seq 600); do
  [ "$( (wc -l <"$work/c/loss.csv") 2>/dev/null || echo 0)" -ge 4 ] && break
  sleep 0.1
done
kill -INT "$pid"
wait "$pid"
rc=$?
[ "$rc" -eq 130 ] || { fail "Ctrl-C: exit $rc, expected 130"; cat "$work/sigint.err"; }
grep_in "$work/sigint.err" "interrupted at step"
step=$(sed -n 's/.*interrupted at step \([0-9]*\).*/\1/p' "$work/sigint.err")
[ -s "$work/c/checkpoints/checkpoint-$step.pt" ] || fail "no checkpoint for step $step"
expect_rc 0 sigint-resume -- "$bin" "${tiny[@]}" --steps 100000 --stop-at-step $((step + 2)) \
  --resume --out "$work/c"
grep_in "$work/sigint-resume.err" "paused at step $((step + 2))"

[ "$failures" -eq 0 ] && echo "fashion_mnist end to end: all checks passed"
exit "$failures"
