#!/usr/bin/env bash
# The adapters example end to end on a tiny configuration: bad flags are typed errors, a whole run
# writes every file, the adapter files load in Python (names, shapes, metadata, sidecar hashes),
# the periodic copies and loss logs exist, and a second run reuses the cached base model.
#
#   fashion_mnist_adapters.sh PROGRAM PYTHON CHECK_SCRIPT WORKDIR [DATA_DIR]
set -uo pipefail
bin=$1 py=$2 check=$3 work=$4 data=${5:-/usr/share/datasets/fashion-mnist}
rm -rf "$work" && mkdir -p "$work"
# shellcheck source=common.sh
source "$(dirname "$0")/common.sh"

tiny=(--data-dir "$data" --limit 2000 --base-steps 8 --batch-size 16 --adapter-images 40
      --adapter-steps 6 --adapter-batch 8 --save-every 3 --samples 10 --sample-steps 3
      --classifier "$work/classifier.safetensors" --classifier-epochs 1
      --min-classifier-accuracy 0 --seed 3)

expect_rc 0 help -- "$bin" --help
grep_in "$work/help.out" "--lora-rank"
expect_rc 2 bad-class -- "$bin" "${tiny[@]}" --new-class 12 --out "$work/bad"
grep_in "$work/bad-class.err" "--new-class: must lie in \[0, 9\]"
expect_rc 2 bad-init -- "$bin" "${tiny[@]}" --init-word "ankle boot" --out "$work/bad"
grep_in "$work/bad-init.err" "--init-word"
expect_rc 2 bad-method -- "$bin" "${tiny[@]}" --methods embedding,dreambooth --out "$work/bad"
grep_in "$work/bad-method.err" "--methods"
expect_rc 2 bad-lr -- "$bin" "${tiny[@]}" --embedding-lr "0.1:x" --out "$work/bad"
grep_in "$work/bad-lr.err" "step string"
# Refused before any work: no classifier was trained for it.
expect_rc 2 negative-lr -- "$bin" "${tiny[@]}" --hypernetwork-lr "-0.01" --out "$work/neg"
grep_in "$work/negative-lr.err" "--hypernetwork-lr"
[ ! -e "$work/neg" ] || fail "the run started work before checking the LR"
expect_rc 2 bad-device -- "$bin" "${tiny[@]}" --device tpu --out "$work/dev"
grep_in "$work/bad-device.err" "--device"
# On a machine with CUDA the whole run goes there (scripts/gpu-check.sh runs this script);
# elsewhere asking for it is a typed error before any work.
if "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  expect_rc 0 cuda-run -- "$bin" "${tiny[@]}" --device cuda --out "$work/cuda"
  [ -s "$work/cuda/results.json" ] || fail "the CUDA run wrote no results"
else
  expect_rc 2 no-cuda -- "$bin" "${tiny[@]}" --device cuda --out "$work/cuda"
  grep_in "$work/no-cuda.err" "no CUDA device"
fi
expect_rc 0 diffusers-flags -- "$bin" --help
grep_in "$work/diffusers-flags.out" "--learning_rate"

expect_rc 0 full -- "$bin" "${tiny[@]}" --out "$work/a"
for f in samples.png results.json base.safetensors adapters/ankle-boot.pt adapters/ankle-boot.pt.optim \
         adapters/ankle-boot-hn.pt adapters/ankle-boot-hn.pt.optim adapters/ankle-boot-lora.safetensors \
         log/embedding/textual_inversion_loss.csv log/embedding/embeddings/ankle-boot-6.pt \
         log/hypernetwork/hypernetwork_loss.csv log/hypernetwork/hypernetworks/ankle-boot-hn-3.pt; do
  [ -s "$work/a/$f" ] || fail "the run did not write $f"
done
for m in base embedding hypernetwork lora; do grep_in "$work/full.out" "^$m "; done
# A TensorBoard run per training.
for m in base embedding hypernetwork lora; do
  ls "$work/a/tensorboard/$m"/events.out.tfevents.* >/dev/null 2>&1 || fail "no event file for $m"
done
[ "$(wc -l <"$work/a/log/embedding/textual_inversion_loss.csv")" -eq 7 ] || fail "embedding log rows"
"$py" "$check" --example "$work/a" >"$work/python.out" 2>&1 || { fail "Python check"; cat "$work/python.out"; }

# By default the new class is captioned only by the word its kind shares ("shoe", which captions
# half the sandals and sneakers too), and the embedding starts from that word.
grep_in "$work/full.err" "captioned only as 'shoe'"
grep_in "$work/a/results.json" '"held_out_images": "generic"'
grep_in "$work/a/results.json" '"init_word": "shoe"'
# The untrained embedding is scored too (what training added is the difference).
grep_in "$work/full.out" "^embedding_start "
"$py" -c 'import json, sys; a = json.load(open(sys.argv[1]))["new_class_accuracy"]
sys.exit(0 if set(a) == {"base", "embedding_start", "embedding", "hypernetwork", "lora"}
         and all(0 <= v <= 1 for v in a.values()) else 1)' "$work/a/results.json" ||
  fail "results.json's new_class_accuracy lacks a method or holds a share outside [0, 1]"
grep_in "$work/a/results.json" '"unconditional_side": "base"'
grep_in "$work/a/results.json" '"adapter_seed": 3'

# LyCORIS' LoHa and LoKr in place of LoRA (on the same base model): each writes its LyCORIS file,
# scores its row and logs its run.
expect_rc 0 lycoris -- "$bin" "${tiny[@]}" --methods loha,lokr --out "$work/a"
for m in loha lokr; do
  [ -s "$work/a/adapters/ankle-boot-$m.safetensors" ] || fail "the run did not write its $m file"
  grep_in "$work/lycoris.out" "^$m "
  grep_in "$work/a/results.json" "\"${m}_layers\""
done
"$py" - "$work/a/adapters" <<'PY' || fail "the LoHa/LoKr files are not in LyCORIS' layout"
import sys
from safetensors.torch import load_file
for m, key in (("loha", ".hada_w1_a"), ("lokr", ".lokr_w1")):
    t = load_file(f"{sys.argv[1]}/ankle-boot-{m}.safetensors")
    assert all(k.startswith("lora_unet_") for k in t) and any(k.endswith(key) for k in t), m
    assert any(k.endswith(".alpha") for k in t), m
PY
# Another adapter seed on the cached base model: only the adapters train again.
expect_rc 2 bad-adapter-seed -- "$bin" "${tiny[@]}" --adapter-seed -2 --out "$work/bad"
grep_in "$work/bad-adapter-seed.err" "--adapter-seed"
expect_rc 0 again -- "$bin" "${tiny[@]}" --adapter-seed 4 --methods embedding --out "$work/a"
grep_in "$work/again.err" "base: cached"
grep_in "$work/a/results.json" '"adapter_seed": 4'
expect_rc 2 bad-side -- "$bin" "${tiny[@]}" --unconditional-side none --out "$work/bad"
grep_in "$work/bad-side.err" "--unconditional-side: none not in"
# The new class's images never seen: another base model (its settings differ, so the cached one is
# not taken); the hypernetwork on guidance's unconditional side too, as the web UI has it.
expect_rc 2 bad-held-out -- "$bin" "${tiny[@]}" --held-out-images hidden --out "$work/bad"
grep_in "$work/bad-held-out.err" "--held-out-images: hidden not in"
expect_rc 0 unseen -- "$bin" "${tiny[@]}" --held-out-images unseen --methods hypernetwork \
  --unconditional-side adapted --out "$work/a"
grep_in "$work/unseen.err" "retraining"
grep_in "$work/unseen.err" "(Ankle boot unseen)"
grep_in "$work/a/results.json" '"held_out_images": "unseen"'
grep_in "$work/a/results.json" '"unconditional_side": "adapted"'
# A class of its own kind has no broader word: the default setting refuses it by name.
expect_rc 2 generic-alone -- "$bin" "${tiny[@]}" --new-class 1 --out "$work/bad"
grep_in "$work/generic-alone.err" "shares no broader word"
# The new class seen with the empty prompt only: a third base model, the embedding from "sneaker".
expect_rc 0 uncaptioned -- "$bin" "${tiny[@]}" --held-out-images uncaptioned --methods embedding \
  --out "$work/a"
grep_in "$work/uncaptioned.err" "retraining"
grep_in "$work/uncaptioned.err" "seen with the empty prompt only"
grep_in "$work/a/results.json" '"held_out_images": "uncaptioned"'
grep_in "$work/a/results.json" '"init_word": "sneaker"'

[ "$failures" -eq 0 ] && echo "fashion_mnist_adapters end to end: all checks passed"
exit "$failures"
