#!/usr/bin/env bash
# textual_inversion end to end on the tiny SD 1.x pipeline and the sneakers of the captioned image
# folder (make_text_to_image_data.py): mistakes refused by name before any work; a two-vector word
# trains; only its rows of the token table move (the checkpoint's table equals the base's
# elsewhere, to the bit); a run stopped half way and resumed ends with the same vectors; diffusers'
# load_textual_inversion reads learned_embeds.safetensors and generates with the word, and the
# web UI's .pt holds the same vectors. On the tiny SDXL pipeline both encoders learn the word:
# diffusers loads learned_embeds.safetensors and learned_embeds_2.safetensors into its two
# tokenizers and encoders and generates, and the web UI's file holds clip_l and clip_g. Under
# torchrun with 2 ranks (each its own batches of 2): DataParallel straight through equals a run
# stopped and resumed under torchrun, to the bit; ZeRO stage 2 ends where DataParallel ends; only
# the word's rows moved; rank 0 alone writes the outputs.
#
#   textual_inversion.sh PROGRAM PYTHON GOLDEN_DIR WORKDIR [FASHION_MNIST_DIR]
set -uo pipefail
bin=$1 py=$2 golden=$3 work=$4 fmnist=${5:-/usr/share/datasets/fashion-mnist}
rm -rf "$work" && mkdir -p "$work"
# shellcheck source=common.sh
source "$(dirname "$0")/common.sh"
here=$(dirname "$0")
"$py" "$here/make_text_to_image_data.py" "$work/data" "$golden" "$fmnist" >"$work/make.out" 2>&1 ||
  { cat "$work/make.out"; echo "FAIL: making the test data"; exit 1; }
sd=$work/data/sd15
mkdir -p "$work/sneakers" && cp "$work"/data/images/sneaker_* "$work/sneakers/"
base=(--pretrained_model_name_or_path "$sd" --train_data_dir "$work/sneakers" --resolution 32
      --repeats 4 --train_batch_size 4 --learning_rate 5e-3 --lr_warmup_steps 0 --seed 2
      --placeholder_token "<fm-sneaker>" --initializer_token shoe --num_vectors 2
      --num_inference_steps 3 --num_validation_images 2 --threads 1)  # bit-equal runs: same threads

expect_rc 0 help -- "$bin" --help
grep_in "$work/help.out" "--placeholder_token"
expect_rc 2 long-initializer -- "$bin" "${base[@]}" --initializer_token "running shoes" --output_dir "$work/bad"
grep_in "$work/long-initializer.err" "single token"
expect_rc 2 known-word -- "$bin" "${base[@]}" --placeholder_token "shoe</w>" --output_dir "$work/bad"
grep_in "$work/known-word.err" "already contains"
expect_rc 2 property -- "$bin" "${base[@]}" --learnable_property colour --output_dir "$work/bad"
grep_in "$work/property.err" "--learnable_property"
expect_rc 0 xl -- "$bin" "${base[@]}" --pretrained_model_name_or_path "$work/data/sdxl" \
  --max_train_steps 6 --save_steps 3 --output_dir "$work/xl"
for f in learned_embeds.safetensors learned_embeds_2.safetensors learned_embeds-steps-3.safetensors \
         learned_embeds_2-steps-3.safetensors fm-sneaker.safetensors; do
  [ -s "$work/xl/$f" ] || fail "the SDXL run did not write $f"
done

expect_rc 0 run -- "$bin" "${base[@]}" --max_train_steps 20 --save_steps 10 --checkpointing_steps 10 \
  --validation_prompt "a photo of <fm-sneaker>" --output_dir "$work/run"
for f in learned_embeds.safetensors learned_embeds-steps-10.safetensors fm-sneaker.pt validation.png; do
  [ -s "$work/run/$f" ] || fail "the run did not write $f"
done
# The folder is reported as every program reports it (its prompts come from templates).
n=$(ls "$work/sneakers" | wc -l)
grep_in "$work/run.err" "$n images ($n with repeats), 0 skipped"
grep_in "$work/run.err" "$n images have no caption of their own: $n train under their file names"
expect_rc 130 stopped -- "$bin" "${base[@]}" --max_train_steps 20 --checkpointing_steps 10 --stop_at 10 \
  --output_dir "$work/resumed"
expect_rc 0 resumed -- "$bin" "${base[@]}" --max_train_steps 20 --checkpointing_steps 10 \
  --resume_from_checkpoint latest --output_dir "$work/resumed"

# kohya's noise and loss options (train_textual_inversion.py takes them): offset noise, input
# perturbation and the Huber loss train the word; stopped and resumed, the same embedding. Caption
# options are refused (the prompts are templates).
ko=("${base[@]}" --max_train_steps 6 --checkpointing_steps 3 --save_steps 0 --noise_offset 0.05
    --ip_noise_gamma 0.1 --loss_type huber --huber_schedule exponential --huber_c 0.2)
expect_rc 0 kohya -- "$bin" "${ko[@]}" --output_dir "$work/kohya"
grep_in "$work/kohya/results.json" '"loss_type": "huber"'
expect_rc 130 kohya-stopped -- "$bin" "${ko[@]}" --stop_at 3 --output_dir "$work/kohya-resumed"
expect_rc 0 kohya-resumed -- "$bin" "${ko[@]}" --resume_from_checkpoint latest --output_dir "$work/kohya-resumed"
cmp -s "$work/kohya/learned_embeds.safetensors" "$work/kohya-resumed/learned_embeds.safetensors" ||
  fail "the resumed run with kohya's options ended with another embedding"
expect_rc 2 kohya-captions -- "$bin" "${base[@]}" --shuffle_caption --output_dir "$work/bad"
grep_in "$work/kohya-captions.err" "templates"

export GLOO_SOCKET_IFNAME=lo
launch=("$(dirname "$py")/torchrun" --standalone --nproc-per-node 2 --no-python "$bin")
ranks=("${base[@]}" --train_batch_size 2 --max_train_steps 8 --checkpointing_steps 4 --save_steps 0
       --rank_timeout 120)
expect_rc 0 dp -- "${launch[@]}" "${ranks[@]}" --output_dir "$work/dp"
grep_in "$work/dp/results.json" '"ranks": 2'
expect_rc 1 dp-stopped -- "${launch[@]}" "${ranks[@]}" --stop_at 4 --output_dir "$work/dp-resumed"
expect_rc 0 dp-resumed -- "${launch[@]}" "${ranks[@]}" --resume_from_checkpoint latest \
  --output_dir "$work/dp-resumed"
grep_in "$work/dp-resumed/results.json" '"resumed_from": 4'
expect_rc 0 zero2 -- "${launch[@]}" "${ranks[@]}" --sharding 2 --output_dir "$work/zero2"
[ "$(grep -c "textual inversion of" "$work/dp.out")" -eq 1 ] || fail "more than one rank reported"

"$py" - "$work" "$sd" >"$work/python.out" 2>&1 <<'PY' || { fail "Python check"; }
import pathlib, sys
import numpy as np
import torch
from safetensors.torch import load_file
from diffusers import StableDiffusionPipeline
from diffusers.utils import logging as dlogging
dlogging.set_verbosity_error()
work, sd = pathlib.Path(sys.argv[1]), sys.argv[2]
learned = load_file(work / "run" / "learned_embeds.safetensors")
assert list(learned) == ["<fm-sneaker>"] and learned["<fm-sneaker>"].shape == (2, 32), learned
resumed = load_file(work / "resumed" / "learned_embeds.safetensors")
assert torch.equal(learned["<fm-sneaker>"], resumed["<fm-sneaker>"]), "the resumed run's vectors differ"
pipe = StableDiffusionPipeline.from_pretrained(sd, safety_checker=None)
table = pipe.text_encoder.get_input_embeddings().weight.detach().clone()
shoe = pipe.tokenizer.encode("shoe", add_special_tokens=False)
assert len(shoe) == 1
assert not torch.allclose(learned["<fm-sneaker>"][0], table[shoe[0]]), "the vectors did not train"
# Only the new rows moved: the checkpoint's token table equals the base's everywhere else.
ckpt = torch.load(work / "run" / "checkpoints" / "checkpoint-20.pt", weights_only=False)
trained = ckpt["model"]["text_encoder.text_model.embeddings.token_embedding.weight"]
assert trained.shape[0] == table.shape[0] + 2
assert torch.equal(trained[: table.shape[0]], table), "rows other than the word's changed"
assert torch.equal(trained[table.shape[0]:], learned["<fm-sneaker>"])
# 2 ranks: stopped and resumed equals straight through; stage 2 equals DataParallel; the vectors
# trained and no other row moved.
dp = load_file(work / "dp" / "learned_embeds.safetensors")["<fm-sneaker>"]
assert torch.equal(dp, load_file(work / "dp-resumed" / "learned_embeds.safetensors")["<fm-sneaker>"]), \
    "the 2-rank run stopped and resumed differs"
zero = load_file(work / "zero2" / "learned_embeds.safetensors")["<fm-sneaker>"]
worst = float((dp - zero).abs().max())
assert worst <= 1e-6, f"stage 2 ends {worst} from DataParallel"
assert not torch.allclose(dp[0], table[shoe[0]]), "the 2-rank vectors did not train"
ckpt = torch.load(work / "dp" / "checkpoints" / "checkpoint-8.pt", weights_only=False)
assert torch.equal(ckpt["model"]["text_encoder.text_model.embeddings.token_embedding.weight"][: table.shape[0]], table)
print(f"torchrun, 2 ranks: resumed = straight through; stage 2 ends {worst:.1e} from DataParallel")
webui = torch.load(work / "run" / "fm-sneaker.pt", weights_only=False)
assert torch.equal(webui["string_to_param"]["*"], learned["<fm-sneaker>"]) and webui["step"] == 20
plain = pipe("a photo of a shoe", num_inference_steps=2, height=32, width=32, output_type="np",
             generator=torch.Generator().manual_seed(0)).images
pipe.load_textual_inversion(str(work / "run"))
assert pipe.tokenizer.convert_tokens_to_ids(["<fm-sneaker>", "<fm-sneaker>_1"]) == [49408, 49409]
out = pipe("a photo of <fm-sneaker>", num_inference_steps=2, height=32, width=32, output_type="np",
           generator=torch.Generator().manual_seed(0)).images
assert out.shape == (1, 32, 32, 3) and np.isfinite(out).all() and not np.allclose(out, plain)
from diffusers import StableDiffusionXLPipeline
xl = StableDiffusionXLPipeline.from_pretrained(work / "data" / "sdxl")
one = load_file(work / "xl" / "learned_embeds.safetensors")["<fm-sneaker>"]
two = load_file(work / "xl" / "learned_embeds_2.safetensors")["<fm-sneaker>"]
shoe1 = xl.text_encoder.get_input_embeddings().weight[xl.tokenizer.encode("shoe", add_special_tokens=False)[0]]
shoe2 = xl.text_encoder_2.get_input_embeddings().weight[xl.tokenizer_2.encode("shoe", add_special_tokens=False)[0]]
assert one.shape[0] == two.shape[0] == 2 and one.shape[1] == shoe1.shape[0] and two.shape[1] == shoe2.shape[0]
assert not torch.allclose(one[0], shoe1) and not torch.allclose(two[0], shoe2), "an SDXL side did not train"
webui_xl = load_file(work / "xl" / "fm-sneaker.safetensors")
assert torch.equal(webui_xl["clip_l"], one) and torch.equal(webui_xl["clip_g"], two), list(webui_xl)
xl.load_textual_inversion(str(work / "xl" / "learned_embeds.safetensors"), token="<fm-sneaker>",
                          text_encoder=xl.text_encoder, tokenizer=xl.tokenizer)
xl.load_textual_inversion(str(work / "xl" / "learned_embeds_2.safetensors"), token="<fm-sneaker>",
                          text_encoder=xl.text_encoder_2, tokenizer=xl.tokenizer_2)
img = xl("a photo of <fm-sneaker>", num_inference_steps=2, height=32, width=32, output_type="np",
         generator=torch.Generator().manual_seed(0)).images
assert img.shape == (1, 32, 32, 3) and np.isfinite(img).all()
print("load_textual_inversion reads the word (2 vectors) and generates with it; the web UI file "
      "holds the same vectors; no other row moved; resumed = uninterrupted; SDXL: both encoders "
      "learned the word, diffusers loads both files and generates, the web UI file holds both")
PY
cat "$work/python.out"
[ "$failures" -eq 0 ] && echo "textual_inversion end to end: ok" || exit 1
