#!/usr/bin/env bash
# The Fashion-MNIST example under torchrun with 2 ranks on this machine (Gloo over 127.0.0.1): a
# tiny run finishes, its outputs exist once (rank 0 writes them), the loss log has one row per
# step; a batch the ranks cannot share is refused by every rank before any work; a run paused by
# rank 0 stops on every rank and resumes under torchrun (a changed LR refused unless taken);
# --sharding 2 (ZeRO) trains as DataParallel does, writes its checkpoint as one file per rank
# beside rank 0's, and one process resumes it when allowed to change the number of ranks;
# --sharding 3 trains as DataParallel does too, and its set resumes at stage 1.
#
#   fashion_mnist_distributed.sh PROGRAM TORCHRUN WORKDIR [DATA_DIR]
set -uo pipefail
bin=$1 torchrun=$2 work=$3 data=${4:-/usr/share/datasets/fashion-mnist}
rm -rf "$work" && mkdir -p "$work"
# shellcheck source=common.sh
source "$(dirname "$0")/common.sh"
export GLOO_SOCKET_IFNAME=lo OMP_NUM_THREADS=1

tiny=(--data-dir "$data" --limit 512 --checkpoint-every 2 --keep 2
      --samples-per-class 2 --sample-steps 3 --classifier "$work/classifier.safetensors"
      --classifier-epochs 1 --min-classifier-accuracy 0 --seed 7 --rank-timeout 120)
launch=("$torchrun" --standalone --nproc-per-node 2 --no-python "$bin")

expect_rc 0 two-ranks -- "${launch[@]}" "${tiny[@]}" --batch-size 16 --steps 4 --out "$work/a"
for f in samples.png loss.png loss.csv results.json ema.safetensors checkpoints/checkpoint-4.pt; do
  [ -s "$work/a/$f" ] || fail "the 2-rank run did not write $f"
done
[ "$(wc -l <"$work/a/loss.csv")" -eq 5 ] || fail "loss.csv should have a header and 4 rows"
[ "$(grep -c "class accuracy of the samples" "$work/two-ranks.out")" -eq 1 ] ||
  fail "the results should be reported once"
grep_in "$work/two-ranks.err" "2 ranks"
stray=$(find "$work/a" -name '.*' -type f)
[ -z "$stray" ] || fail "temporary files left behind: $stray"

# Each rank takes batch / 2 images: an odd batch is refused on every rank before any work.
expect_rc 1 odd-batch -- "${launch[@]}" "${tiny[@]}" --steps 4 --batch-size 15 --out "$work/b"
grep_in "$work/odd-batch.err" "not a multiple of the 2 ranks"

# Paused at step 4 by rank 0 (every rank stops at the same step), then resumed under torchrun:
# with another LR it is refused by every rank unless told to take it; with the same one it goes on
# from step 4 to 6.
expect_rc 0 pause -- "${launch[@]}" "${tiny[@]}" --batch-size 16 --steps 6 --stop-at-step 4 \
  --out "$work/p"
grep_in "$work/pause.err" "paused at step 4"
[ -e "$work/p/results.json" ] && fail "a paused run should not sample"
[ -s "$work/p/checkpoints/checkpoint-4.pt" ] || fail "the paused run saved no checkpoint"
expect_rc 1 new-lr -- "${launch[@]}" "${tiny[@]}" --batch-size 16 --steps 6 --lr 5e-3 --resume \
  --out "$work/p"
grep_in "$work/new-lr.err" "take_on_resume.lr"
expect_rc 0 resume -- "${launch[@]}" "${tiny[@]}" --batch-size 16 --steps 6 --resume --out "$work/p"
grep_in "$work/resume.err" "continuing from"
[ "$(wc -l <"$work/p/loss.csv")" -eq 7 ] || fail "the resumed loss.csv should have 6 rows"
grep_in "$work/p/results.json" '"resumed_from": 4'
# The same run, taking a new LR on purpose, from the step-4 checkpoint of a copy.
mkdir -p "$work/q/checkpoints" && cp "$work/p/checkpoints/checkpoint-4.pt" "$work/q/checkpoints/"
expect_rc 0 take-new -- "${launch[@]}" "${tiny[@]}" --batch-size 16 --steps 6 --lr 5e-3 --resume \
  --take-new-settings --out "$work/q"
grep_in "$work/q/results.json" '"resumed_from": 4'

# ZeRO stage 2: the paused DataParallel run above again (same seed, data, settings and pause),
# with the same losses up to float rounding; its checkpoint is a set; one process resumes it.
expect_rc 0 sharded -- "${launch[@]}" "${tiny[@]}" --batch-size 16 --steps 6 --stop-at-step 4 \
  --sharding 2 --out "$work/z"
for f in checkpoints/checkpoint-4.pt checkpoints/checkpoint-4.pt.shard-0-of-2 \
         checkpoints/checkpoint-4.pt.shard-1-of-2; do
  [ -s "$work/z/$f" ] || fail "the stage-2 run did not write $f"
done
"$(dirname "$torchrun")/python" - "$work/p/loss.csv" "$work/z/loss.csv" <<'PY' || fail "stage 2's losses differ from DataParallel's"
import csv, sys
a, z = ([float(r["loss"]) for r in csv.DictReader(open(f))][:4] for f in sys.argv[1:])
worst = max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, z))
print(f"stage 2 vs DataParallel, 4 steps: largest relative loss difference {worst:.1e}")
sys.exit(0 if len(a) == len(z) == 4 and worst <= 1e-4 else 1)
PY
expect_rc 2 one-rank-refused -- "$bin" "${tiny[@]}" --batch-size 16 --steps 6 --resume --out "$work/z"
grep_in "$work/one-rank-refused.err" "2 ranks"
expect_rc 0 one-rank -- "$bin" "${tiny[@]}" --batch-size 16 --steps 6 --resume \
  --allow-world-size-change --out "$work/z"
grep_in "$work/z/results.json" '"resumed_from": 4'
[ "$(wc -l <"$work/z/loss.csv")" -eq 7 ] || fail "the resumed stage-2 loss.csv should have 6 rows"

# ZeRO stage 3 (each UNet block a unit): the same paused run, the same losses; its set resumes
# at stage 1.
expect_rc 0 stage3 -- "${launch[@]}" "${tiny[@]}" --batch-size 16 --steps 6 --stop-at-step 4 \
  --sharding 3 --out "$work/z3"
"$(dirname "$torchrun")/python" - "$work/p/loss.csv" "$work/z3/loss.csv" <<'PY' || fail "stage 3's losses differ from DataParallel's"
import csv, sys
a, z = ([float(r["loss"]) for r in csv.DictReader(open(f))][:4] for f in sys.argv[1:])
worst = max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, z))
print(f"stage 3 vs DataParallel, 4 steps: largest relative loss difference {worst:.1e}")
sys.exit(0 if len(a) == len(z) == 4 and worst <= 1e-4 else 1)
PY
expect_rc 0 stage3-resumed -- "${launch[@]}" "${tiny[@]}" --batch-size 16 --steps 6 --resume \
  --sharding 1 --out "$work/z3"
grep_in "$work/z3/results.json" '"resumed_from": 4'
# Its last set (stage 1: each rank wrote the parameters it steps and their EMA) consolidated into
# a UNet folder: the same tensors as the unet/ the program wrote from the EMA's weights, and
# diffusers loads it.
consolidate="$(dirname "$bin")/consolidate"
expect_rc 0 consolidate -- "$consolidate" "$work/z3/checkpoints/checkpoint-6.pt" "$work/z3/unet-ema" \
  --ema --prefix unet. --config "$work/z3/unet/config.json"
expect_rc 2 consolidate-bad-prefix -- "$consolidate" "$work/z3/checkpoints/checkpoint-6.pt" \
  "$work/z3/x.safetensors" --prefix nothing.
grep_in "$work/consolidate-bad-prefix.err" "no tensor of the checkpoint's model starts with 'nothing.'"
"$(dirname "$torchrun")/python" - "$work/z3" <<'PY' || fail "the consolidated UNet differs from the program's"
import pathlib, sys
import torch
from safetensors.torch import load_file
from diffusers import UNet2DConditionModel
d = pathlib.Path(sys.argv[1])
a = load_file(d / "unet" / "diffusion_pytorch_model.safetensors")
b = load_file(d / "unet-ema" / "diffusion_pytorch_model.safetensors")
assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
assert all(torch.equal(a[k], b[k]) for k in a), "values differ"
UNet2DConditionModel.from_pretrained(d / "unet-ema")
print(f"consolidated set: {len(b)} tensors equal to the program's EMA UNet; diffusers loads it")
PY

[ "$failures" -eq 0 ] && echo "fashion_mnist under torchrun: all checks passed"
exit $((failures > 0))
