"""T5 tokenizer parity: transformers' T5Tokenizer on SentencePiece Unigram models trained here.

Two models are trained with sentencepiece's own trainer on a generated corpus (words, punctuation,
digits, accented and CJK text, emoji), laid out as T5's (<pad>=0, </s>=1, <unk>=2, no <s>):
  t5      nmt_nfkc normalization (T5's), 2,000 pieces, 100 sentinels;
  sym     nfkc_cf (case folded), user-defined pieces "<sep>" and "@@", a control piece "<ctrl>",
          10 sentinels.
Each is written as the folders users have:
  <name>_model/  spiece.model + tokenizer_config.json (what T5's hub folders hold);
  <name>_json/   tokenizer.json + tokenizer_config.json as transformers 5 saves them;
  <name>_both/   both (SD3's tokenizer_3), where transformers reads tokenizer.json.
A sweep of generated strings (the CLIP sweep's kinds plus T5's own: sentinels, "▁" written
literally, runs of white space) is tokenized by each; the C++ test compares every id.
SentencePiece's own encoder is run on the same strings and the strings where it differs counted.
"""
import io
import json
import pathlib
import random
import shutil

import ref_clip_tokenizer as clip_ref


def t5_strings(n: int, seed: int):
    rng = random.Random(seed)
    base = clip_ref.random_strings(n, seed=seed)
    extra = ["<extra_id_0>", "<extra_id_99>", "<extra_id_9>", "<extra_id_100>", "</s>", "<pad>",
             "<unk>", "<s>", "＜pad＞", "▁", "▁▁", "a▁b", "▁word", "<sep>", "@@", "<ctrl>",
             "<SEP>", "   ", "\t\t", " \u3000 ", "x" * 40, "ｆｕｌｌ　ｗｉｄｔｈ", "①", "ﬀ", "㍻",
             "Ⅷ", "¼", "e\u0301\u0301", "\u0301", "한\u1100", "\U0001F9D1\u200D\U0001F9B0"]
    out = []
    for s in base:
        if rng.random() < 0.5:
            words = s.split(" ")
            for _ in range(rng.randint(1, 4)):
                words.insert(rng.randint(0, len(words)), rng.choice(extra))
            s = rng.choice([" ", "", "  "]).join(words)
        out.append(s)
    return out


def train(corpus, **options):
    import sentencepiece as spm
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus), model_writer=model, model_type="unigram", pad_id=0,
        eos_id=1, unk_id=2, bos_id=-1, character_coverage=0.98, num_threads=1,
        hard_vocab_limit=False, minloglevel=2, **options)
    return model.getvalue()


def write_folders(root: pathlib.Path, name: str, model: bytes, extra_ids: int):
    from transformers import T5Tokenizer
    folder = root / f"{name}_model"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "spiece.model").write_bytes(model)
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "T5Tokenizer", "extra_ids": extra_ids, "model_max_length": 512,
         "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}, indent=1))
    tok = T5Tokenizer.from_pretrained(str(folder))
    tok.save_pretrained(str(root / f"{name}_json"))
    both = root / f"{name}_both"
    shutil.copytree(root / f"{name}_json", both, dirs_exist_ok=True)
    shutil.copy(folder / "spiece.model", both / "spiece.model")


def generate(out: pathlib.Path):
    import sentencepiece as spm
    from transformers import T5Tokenizer
    from transformers.utils import logging
    logging.set_verbosity_error()
    root = out / "t5_tokenizer"
    if root.exists():
        shutil.rmtree(root)
    corpus = [s.replace("\n", " ") for s in clip_ref.random_strings(4000, seed=7)]
    corpus += clip_ref.CAPTIONS * 5
    models = {
        "t5": (train(corpus, vocab_size=2000, normalization_rule_name="nmt_nfkc"), 100),
        "sym": (train(corpus, vocab_size=1500, normalization_rule_name="nfkc_cf",
                      user_defined_symbols=["<sep>", "@@"], control_symbols=["<ctrl>"]), 10),
    }
    strings = t5_strings(12000, seed=11) + clip_ref.CAPTIONS
    result = {"strings": strings, "variants": {}}
    for name, (model, extra_ids) in models.items():
        write_folders(root, name, model, extra_ids)
        for layout, count in [("model", len(strings)), ("json", len(strings)), ("both", 2000)]:
            tok = T5Tokenizer.from_pretrained(str(root / f"{name}_{layout}"))
            some = strings[:count]
            ids = tok(some)["input_ids"]
            batch = tok(some[:500], padding="max_length", max_length=64, truncation=True)
            longest = tok(some[500:700], padding="longest", truncation=True, max_length=40)
            plain = tok(some[700:900], add_special_tokens=False)["input_ids"]
            result["variants"][f"{name}_{layout}"] = {
                "count": count, "ids": ids, "size": len(tok), "eos": tok.eos_token_id,
                "pad": tok.pad_token_id, "unk": tok.unk_token_id,
                "model_max_length": tok.model_max_length,
                "added": [[i, t.content, t.special, t.normalized]
                          for i, t in sorted(tok.added_tokens_decoder.items())],
                "batch_ids": batch["input_ids"], "batch_mask": batch["attention_mask"],
                "longest_ids": longest["input_ids"], "longest_mask": longest["attention_mask"],
                "plain_ids": plain,
                "decoded": [tok.decode(x) for x in ids[:500]],
                "decoded_skip": [tok.decode(x, skip_special_tokens=True) for x in ids[:500]]}
        sp = spm.SentencePieceProcessor(model_proto=model)
        fast = result["variants"][f"{name}_model"]["ids"]
        result["variants"][f"{name}_model"]["sentencepiece_differs"] = sum(
            sp.encode(s) + [1] != fast[i] for i, s in enumerate(strings))
    (out / "t5_tokenizer.json").write_text(json.dumps(result, ensure_ascii=False))
    prompt_embeds(out, root)
    sd3_encode_prompt(out, root)
    flux_encode_prompt(out)


def prompt_embeds(out: pathlib.Path, root: pathlib.Path):
    """SD3's and Flux's _get_t5_prompt_embeds (called on stand-ins for the pipelines) with the
    t5 tokenizer and a tiny random T5 v1.1 encoder of its vocabulary."""
    import types
    from diffusers import FluxPipeline, StableDiffusion3Pipeline
    from diffusers.utils import logging as dlogging
    dlogging.set_verbosity_error()  # the pipelines warn of the truncated long prompt
    from safetensors.torch import save_file
    from transformers import T5Config, T5EncoderModel, T5Tokenizer
    torch_ = __import__("torch")
    tok = T5Tokenizer.from_pretrained(str(root / "t5_both"))
    torch_.manual_seed(5)
    encoder = T5EncoderModel(T5Config(vocab_size=len(tok), d_model=16, d_kv=4, d_ff=24,
                                      num_layers=2, num_heads=4, feed_forward_proj="gated-gelu",
                                      dropout_rate=0.0)).eval()
    encoder.save_pretrained(root / "t5_prompt_encoder")
    long = " ".join(clip_ref.CAPTIONS) * 3
    prompts = ["a photo of a cat", "An astronaut riding a horse <extra_id_0>", long]
    cases = {"sd3": (StableDiffusion3Pipeline, 256, 2, "tokenizer_3", "text_encoder_3"),
             "sd3_short": (StableDiffusion3Pipeline, 77, 1, "tokenizer_3", "text_encoder_3"),
             "flux": (FluxPipeline, 512, 1, "tokenizer_2", "text_encoder_2")}
    outputs, meta = {}, {"prompts": prompts, "cases": {}}
    for name, (cls, length, n, tok_attr, enc_attr) in cases.items():
        pipe = types.SimpleNamespace(**{tok_attr: tok, enc_attr: encoder, "text_encoder": encoder,
                                        "tokenizer_max_length": 77, "_execution_device": "cpu"})
        with torch_.no_grad():
            embeds = cls._get_t5_prompt_embeds(pipe, prompt=prompts, num_images_per_prompt=n,
                                               max_sequence_length=length,
                                               device=torch_.device("cpu"))
        outputs[name] = embeds.contiguous()
        meta["cases"][name] = {"max_sequence_length": length, "num_images_per_prompt": n}
    save_file(outputs, root / "t5_prompt_embeds.safetensors")
    (out / "t5_prompt.json").write_text(json.dumps(meta))


def sd3_encode_prompt(out: pathlib.Path, root: pathlib.Path):
    """StableDiffusion3Pipeline.encode_prompt (called on a stand-in holding its three encoders):
    two tiny CLIPTextModelWithProjection with the SD 1.5 and the "!"-padding SD 2 CLIP tokenizers,
    and a tiny T5 of the t5 tokenizer's vocabulary wider than both CLIPs together; prompts short
    and long, default and given negatives, clip_skip, prompt_2 and prompt_3, two images per
    prompt, and a pipeline without T5 (zeros of joint_attention_dim)."""
    import types
    from diffusers import StableDiffusion3Pipeline
    from diffusers.utils import logging as dlogging
    dlogging.set_verbosity_error()
    from safetensors.torch import save_file
    from transformers import (CLIPTextConfig, CLIPTextModelWithProjection, CLIPTokenizer,
                              T5Config, T5EncoderModel, T5Tokenizer)
    torch_ = __import__("torch")
    folder = out / "sd3_encode_prompt"
    folder.mkdir(parents=True, exist_ok=True)
    common = dict(vocab_size=49408, max_position_embeddings=77, bos_token_id=49406,
                  eos_token_id=49407, pad_token_id=1)
    torch_.manual_seed(6)
    te1 = CLIPTextModelWithProjection(CLIPTextConfig(
        hidden_size=32, intermediate_size=37, num_hidden_layers=3, num_attention_heads=4,
        projection_dim=16, hidden_act="quick_gelu", **common)).eval()
    te2 = CLIPTextModelWithProjection(CLIPTextConfig(
        hidden_size=40, intermediate_size=48, num_hidden_layers=3, num_attention_heads=5,
        projection_dim=24, hidden_act="gelu", **common)).eval()
    tok3 = T5Tokenizer.from_pretrained(str(root / "t5_both"))
    te3 = T5EncoderModel(T5Config(vocab_size=len(tok3), d_model=80, d_kv=8, d_ff=24, num_layers=2,
                                  num_heads=4, feed_forward_proj="gated-gelu",
                                  dropout_rate=0.0)).eval()
    te1.save_pretrained(folder / "text_encoder")
    te2.save_pretrained(folder / "text_encoder_2")
    te3.save_pretrained(folder / "text_encoder_3")
    clip_root = out / "clip_tokenizer"
    tok1 = CLIPTokenizer.from_pretrained(str(clip_root / "sd15"))
    tok2 = CLIPTokenizer.from_pretrained(str(clip_root / "sd2"))

    def stand_in(with_t5):
        pipe = types.SimpleNamespace(
            tokenizer=tok1, tokenizer_2=tok2, tokenizer_3=tok3 if with_t5 else None,
            text_encoder=te1, text_encoder_2=te2, text_encoder_3=te3 if with_t5 else None,
            tokenizer_max_length=77, _execution_device="cpu",
            transformer=types.SimpleNamespace(config=types.SimpleNamespace(joint_attention_dim=96)))
        for method in ("_get_clip_prompt_embeds", "_get_t5_prompt_embeds", "encode_prompt"):
            setattr(pipe, method, types.MethodType(getattr(StableDiffusion3Pipeline, method), pipe))
        return pipe

    long = " ".join(clip_ref.CAPTIONS) * 2
    prompts = ["a photo of a cat", long]
    cases = {
        "plain": (True, dict()),
        "negative_skip_images": (True, dict(negative_prompt=["blurry", "dark, (bad)"], clip_skip=1,
                                            num_images_per_prompt=2, max_sequence_length=77,
                                            prompt_2=["an oil painting", "a watercolor"],
                                            prompt_3=["a cat in the style of <extra_id_0>", "x"])),
        "negative_2_and_3": (True, dict(negative_prompt=["ugly"], negative_prompt_2=["grainy"],
                                        negative_prompt_3=["noisy", "flat"],
                                        max_sequence_length=30)),
        "no_t5_no_guidance": (False, dict(do_classifier_free_guidance=False,
                                          max_sequence_length=20)),
    }
    tensors, meta = {}, {"prompts": prompts, "joint_attention_dim": 96, "cases": {}}
    for name, (with_t5, kw) in cases.items():
        kw = dict(kw)
        guidance = kw.pop("do_classifier_free_guidance", True)
        n = kw.get("num_images_per_prompt", 1)
        if len(kw.get("negative_prompt", [None, None])) == 1:
            kw["negative_prompt"] = kw["negative_prompt"] * 2
            kw["negative_prompt_2"] = kw["negative_prompt_2"] * 2
        with torch_.no_grad():
            pe, npe, pooled, npooled = stand_in(with_t5).encode_prompt(
                prompt=prompts, prompt_2=kw.pop("prompt_2", None), prompt_3=kw.pop("prompt_3", None),
                device=torch_.device("cpu"), do_classifier_free_guidance=guidance, **kw)
        tensors[name + ".prompt_embeds"] = pe.contiguous()
        tensors[name + ".pooled_prompt_embeds"] = pooled.contiguous()
        if npe is not None:
            tensors[name + ".negative_prompt_embeds"] = npe.contiguous()
            tensors[name + ".negative_pooled_prompt_embeds"] = npooled.contiguous()
        meta["cases"][name] = {"t5": with_t5, "guidance": guidance, "num_images_per_prompt": n,
                               **{k: v for k, v in cases[name][1].items()
                                  if k != "do_classifier_free_guidance"}}
    save_file(tensors, folder / "outputs.safetensors")
    (out / "sd3_encode_prompt.json").write_text(json.dumps(meta))


def flux_encode_prompt(out: pathlib.Path):
    """FluxPipeline.encode_prompt (on a stand-in holding its two encoders): a tiny CLIPTextModel
    (its pooler output is Flux's pooled conditioning) with the SD 1.5 CLIP tokenizer, and the tiny
    T5 of sd3_encode_prompt; dev's 512 and schnell's 256 T5 tokens, prompt_2, two images per
    prompt."""
    import types
    from diffusers import FluxPipeline
    from safetensors.torch import save_file
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5Tokenizer
    torch_ = __import__("torch")
    folder = out / "flux_encode_prompt"
    folder.mkdir(parents=True, exist_ok=True)
    torch_.manual_seed(8)
    te1 = CLIPTextModel(CLIPTextConfig(
        hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
        hidden_act="quick_gelu", vocab_size=49408, max_position_embeddings=77, bos_token_id=49406,
        eos_token_id=49407, pad_token_id=1)).eval()
    te1.save_pretrained(folder / "text_encoder")
    te2 = T5EncoderModel.from_pretrained(out / "sd3_encode_prompt" / "text_encoder_3").eval()
    tok1 = CLIPTokenizer.from_pretrained(str(out / "clip_tokenizer" / "sd15"))
    tok2 = T5Tokenizer.from_pretrained(str(out / "t5_tokenizer" / "t5_both"))
    pipe = types.SimpleNamespace(tokenizer=tok1, tokenizer_2=tok2, text_encoder=te1,
                                 text_encoder_2=te2, tokenizer_max_length=77,
                                 _execution_device="cpu")
    for method in ("_get_clip_prompt_embeds", "_get_t5_prompt_embeds", "encode_prompt"):
        setattr(pipe, method, types.MethodType(getattr(FluxPipeline, method), pipe))
    long = " ".join(clip_ref.CAPTIONS) * 2
    prompts = ["a photo of a cat", long]
    cases = {"dev": dict(max_sequence_length=512),
             "schnell_two_images": dict(max_sequence_length=256, num_images_per_prompt=2),
             "prompt_2": dict(max_sequence_length=40, prompt_2=["a cat <extra_id_0>", "a dog"])}
    tensors, meta = {}, {"prompts": prompts, "cases": {}}
    for name, kw in cases.items():
        with torch_.no_grad():
            pe, pooled, text_ids = pipe.encode_prompt(prompt=prompts, device=torch_.device("cpu"),
                                                      **kw)
        tensors[name + ".prompt_embeds"] = pe.contiguous()
        tensors[name + ".pooled_prompt_embeds"] = pooled.contiguous()
        tensors[name + ".text_ids"] = text_ids.contiguous()
        meta["cases"][name] = kw
    save_file(tensors, folder / "outputs.safetensors")
    (out / "flux_encode_prompt.json").write_text(json.dumps(meta))
