#!/usr/bin/env bash
# webui_train end to end on the tiny SD 1.x pipeline and the captioned image folder
# (make_text_to_image_data.py): an embedding and a hypernetwork trained by the web UI's loops with
# its prompt templates ([name], [filewords]) and each latent sampling method; the files, their
# .optim sidecars, the periodic copies and the loss log are written; a second run continues the
# file's steps with the sidecar's optimizer state; mistakes are refused by name; the files load as
# the web UI's (torch.load: string_to_param, the hypernetwork's layer keys); the previews are
# written every N steps, and the embedding's PNG after each copy carries that copy as the web UI
# reads it back (its text chunk and its image-data border).
#
#   webui_train.sh PROGRAM PYTHON GOLDEN_DIR WORKDIR [FASHION_MNIST_DIR] [TRAIN_TEXT_TO_IMAGE]
# (the last makes a single-file model, the web UI's layout, to train on as the web UI does)
set -uo pipefail
bin=$1 py=$2 golden=$3 work=$4 fmnist=${5:-/usr/share/datasets/fashion-mnist}
[ -n "$fmnist" ] || fmnist=/usr/share/datasets/fashion-mnist
t2i=${6:-}
rm -rf "$work" && mkdir -p "$work"
# shellcheck source=common.sh
source "$(dirname "$0")/common.sh"
here=$(dirname "$0")
"$py" "$here/make_text_to_image_data.py" "$work/data" "$golden" "$fmnist" >"$work/make.out" 2>&1 ||
  { cat "$work/make.out"; echo "FAIL: making the test data"; exit 1; }
sd=$work/data/sd15
# The web UI's captions: a .txt beside each image ([filewords]), tags separated by commas.
mkdir -p "$work/images"
for f in "$work"/data/images/sneaker_0*; do
  cp "$f" "$work/images/"
  stem=$(basename "${f%.*}")
  echo "sneaker, shoe, white background" >"$work/images/$stem.txt"
done
printf 'a photo of [name], [filewords]\na picture of a [name]\n' >"$work/templates.txt"
base=(--pretrained_model_name_or_path "$sd" --train_data_dir "$work/images" --width 32 --height 32
      --template_file "$work/templates.txt" --batch_size 2 --gradient_step 2 --save_every 5
      --write_csv_every 1 --seed 4 --threads 1)

expect_rc 0 help -- "$bin" --help
grep_in "$work/help.out" "--latent_sampling_method"
expect_rc 2 neither -- "$bin" "${base[@]}" --output_dir "$work/bad"
grep_in "$work/neither.err" "--embedding NAME or --hypernetwork NAME"
expect_rc 2 method -- "$bin" "${base[@]}" --embedding fm --latent_sampling_method sometimes --output_dir "$work/bad"
grep_in "$work/method.err" "--latent_sampling_method"
expect_rc 2 learn-rate -- "$bin" "${base[@]}" --embedding fm --learn_rate "0.005:abc" --output_dir "$work/bad"
expect_rc 2 no-templates -- "$bin" "${base[@]}" --embedding fm --template_file "$work/nowhere.txt" --output_dir "$work/bad"
expect_rc 2 sdxl -- "$bin" "${base[@]}" --embedding fm --pretrained_model_name_or_path "$work/data/sdxl" --output_dir "$work/bad"
grep_in "$work/sdxl.err" "is an SDXL pipeline"
grep_in "$work/sdxl.err" "textual_inversion"
expect_rc 2 device -- "$bin" "${base[@]}" --embedding fm --device gpu --output_dir "$work/bad"
grep_in "$work/device.err" "--device"

# The web UI trains on a single file (its models/Stable-diffusion/*.safetensors): one made from
# the tiny pipeline by train_text_to_image --save_format single_file, its configs from the folder.
if [ -n "$t2i" ]; then
  expect_rc 0 make-single -- "$t2i" --pretrained_model_name_or_path "$sd" --train_data_dir \
    "$work/images" --resolution 32 --train_batch_size 2 --max_train_steps 1 --threads 1 \
    --save_format single_file --output_dir "$work/single"
  expect_rc 0 single -- "$bin" "${base[@]}" --pretrained_model_name_or_path \
    "$work/single/model.safetensors" --single_file_config "$sd" --embedding fm-single \
    --init_text "shoe" --steps 4 --output_dir "$work/single-run"
  [ -s "$work/single-run/embeddings/fm-single.pt" ] ||
    fail "training on a single file wrote no embedding"
  expect_rc 2 single-no-config -- "$bin" "${base[@]}" --pretrained_model_name_or_path \
    "$work/single/model.safetensors" --embedding fm-single --steps 2 --output_dir "$work/bad"
  grep_in "$work/single-no-config.err" "--single_file_config"
fi

expect_rc 0 embedding -- "$bin" "${base[@]}" --embedding fm-sneaker --init_text "shoe" \
  --num_vectors_per_token 2 --learn_rate "0.01:5, 0.005" --steps 10 --latent_sampling_method once \
  --create_image_every 5 --preview_steps 2 --output_dir "$work/run"
expect_rc 0 embedding-more -- "$bin" "${base[@]}" --embedding fm-sneaker --learn_rate "0.01:5, 0.005" \
  --steps 14 --latent_sampling_method random --output_dir "$work/run"
grep_in "$work/run/results.json" '"resumed_optimizer": true'
grep_in "$work/run/results.json" '"final_step": 14'
# The web UI's default modules (768, 320, 640, 1280) fit none of the tiny UNet's widths (text 32,
# blocks 16 and 32): refused before training nothing, naming the widths there are.
expect_rc 2 hn-sizes -- "$bin" "${base[@]}" --hypernetwork fm-none --steps 2 --output_dir "$work/bad-hn"
grep_in "$work/hn-sizes.err" "hypernetwork_layer_sizes 16,32"
# Modules at the text width (cross-attention and the 32-channel self-attention) and at 16 (the
# first block's self-attention), as the web UI's default covers SD 1.x's.
expect_rc 0 hypernetwork -- "$bin" "${base[@]}" --hypernetwork fm-hn --hypernetwork_layer_sizes 32,16 --layer_structure 1,2,1 \
  --activation_func relu --learn_rate 0.0005 --steps 10 --latent_sampling_method deterministic \
  --shuffle_tags --tag_drop_out 0.2 --create_image_every 10 --preview_steps 2 \
  --preview_prompt "a photo of a shoe" --preview_seed 7 --output_dir "$work/hn"
for f in run/embeddings/fm-sneaker.pt run/embeddings/fm-sneaker.pt.optim hn/hypernetworks/fm-hn.pt \
         hn/hypernetworks/fm-hn.pt.optim run/log/embedding/textual_inversion_loss.csv \
         hn/log/hypernetwork/hypernetwork_loss.csv; do
  [ -s "$work/$f" ] || fail "no $f"
done
ls "$work"/run/log/embedding/embeddings/fm-sneaker-5.pt >/dev/null 2>&1 || fail "no periodic copy"
for f in run/log/embedding/images/fm-sneaker-5.png run/log/embedding/images/fm-sneaker-10.png \
         run/log/embedding/image_embeddings/fm-sneaker-5.png \
         run/log/embedding/image_embeddings/fm-sneaker-10.png hn/log/hypernetwork/images/fm-hn-10.png; do
  [ -s "$work/$f" ] || fail "no preview $f"
done
[ ! -e "$work/hn/log/hypernetwork/image_embeddings" ] || fail "a hypernetwork embedded a preview"

# Under torchrun: 2 ranks at --gradient_step 1 train as one process at --gradient_step 2 (each
# sample's noise from its place in the epoch); rank 0 alone writes. Too few micro-batches for the
# ranks are refused by name.
export GLOO_SOCKET_IFNAME=lo
launch=("$(dirname "$py")/torchrun" --standalone --nproc-per-node 2 --no-python "$bin")
dp=(--batch_size 1 --steps 6 --save_every 3 --create_image_every 0 --latent_sampling_method random
    --shuffle_tags --learn_rate 0.02 --rank_timeout 120)
# The hypernetwork pair draws "once": each rank encodes half the images and the ranks exchange the
# latents, each drawn from its image's generator, so they match one process's.
dp_once=("${dp[@]/random/once}")
expect_rc 0 dp-one -- "$bin" "${base[@]}" "${dp[@]}" --gradient_step 2 --embedding fm-dp \
  --output_dir "$work/dp-one"
expect_rc 0 dp-two -- "${launch[@]}" "${base[@]}" "${dp[@]}" --gradient_step 1 --embedding fm-dp \
  --output_dir "$work/dp-two"
grep_in "$work/dp-two/results.json" '"ranks": 2'
[ "$(grep -c "embedding 'fm-dp'" "$work/dp-two.out")" -eq 1 ] || fail "more than one rank reported"
expect_rc 0 dp-hn-one -- "$bin" "${base[@]}" "${dp_once[@]}" --gradient_step 2 \
  --hypernetwork fm-dp-hn --hypernetwork_layer_sizes 32 --activation_func relu --output_dir "$work/dp-one"
expect_rc 0 dp-hn-two -- "${launch[@]}" "${base[@]}" "${dp_once[@]}" --gradient_step 1 \
  --hypernetwork fm-dp-hn --hypernetwork_layer_sizes 32 --activation_func relu --output_dir "$work/dp-two"
n=$(find "$work/images" -name '*.txt' | wc -l)
expect_rc 1 dp-few -- "${launch[@]}" "${base[@]}" "${dp[@]}" --batch_size "$n" --gradient_step 1 \
  --embedding fm-few --output_dir "$work/dp-few"
grep_in "$work/dp-few.err" "fewer than 2 ranks"

"$py" - "$work" "$here/../reference" >"$work/python.out" 2>&1 <<'PY' || { fail "Python check"; }
import json, pathlib, sys
import torch
work = pathlib.Path(sys.argv[1])
e = torch.load(work / "run" / "embeddings" / "fm-sneaker.pt", weights_only=False)
vec = e["string_to_param"]["*"]
assert vec.shape == (2, 32) and e["step"] == 14 and e["name"] == "fm-sneaker", e
first = torch.load(work / "run" / "log" / "embedding" / "embeddings" / "fm-sneaker-5.pt", weights_only=False)
assert not torch.equal(first["string_to_param"]["*"], vec), "the vectors did not move"
hn = torch.load(work / "hn" / "hypernetworks" / "fm-hn.pt", weights_only=False)
assert 32 in hn and 16 in hn and hn["layer_structure"] == [1, 2, 1] and hn["activation_func"] == "relu", list(hn)
assert hn["step"] == 10 and len(hn[32]) == 2, hn["step"]
# The previews: the prompt in the PNG's parameters; the embedding's PNG is the copy of its step,
# read both ways the web UI reads it.
sys.path.insert(0, str(pathlib.Path(sys.argv[2])))
from PIL import Image
from webui_embedding_image import extract_image_data, from_b64
hn_png = Image.open(work / "hn" / "log" / "hypernetwork" / "images" / "fm-hn-10.png")
assert hn_png.text["parameters"].startswith("a photo of a shoe\nSteps: 2, Sampler: DDIM"), hn_png.text
for step in (5, 10):
    png = Image.open(work / "run" / "log" / "embedding" / "image_embeddings" / f"fm-sneaker-{step}.png")
    copy = torch.load(work / "run" / "log" / "embedding" / "embeddings" / f"fm-sneaker-{step}.pt", weights_only=False)
    want = copy["string_to_param"]["*"]
    for data in (from_b64(png.text["sd-ti-embedding"]), extract_image_data(png)):
        got = data["string_to_param"]["*"]
        assert data["name"] == f"fm-sneaker-{step}" and data["step"] == step, (data["name"], data["step"])
        assert torch.equal(got.to(want.dtype), want), (got, want)
# Data parallel = one process with the ranks' micro-batches accumulated; rank 0's copies.
one = torch.load(work / "dp-one" / "embeddings" / "fm-dp.pt", weights_only=False)
two = torch.load(work / "dp-two" / "embeddings" / "fm-dp.pt", weights_only=False)
a, b = one["string_to_param"]["*"], two["string_to_param"]["*"]
assert one["step"] == two["step"] == 6 and torch.allclose(a, b, atol=1e-5), (a - b).abs().max()
start = torch.load(work / "dp-two" / "log" / "embedding" / "embeddings" / "fm-dp-3.pt", weights_only=False)
assert not torch.equal(start["string_to_param"]["*"], b), "the vectors did not move"
h1 = torch.load(work / "dp-one" / "hypernetworks" / "fm-dp-hn.pt", weights_only=False)
h2 = torch.load(work / "dp-two" / "hypernetworks" / "fm-dp-hn.pt", weights_only=False)
worst = max((x[k] - y[k]).abs().max().item() for x, y in zip(h1[32], h2[32]) for k in x)
assert h2["step"] == 6 and worst < 1e-5, worst
print(f"torchrun, 2 ranks = 1 process at twice the accumulation: embedding {(a - b).abs().max():.1e}, hypernetwork {worst:.1e}")
print(f"embedding: 2 vectors at step {e['step']}; hypernetwork: {sum(p.numel() for m in hn[32] for p in m.values())} weights at step {hn['step']}")
PY
cat "$work/python.out"
[ "$failures" -eq 0 ] && echo "webui_train end to end: ok" || exit 1
