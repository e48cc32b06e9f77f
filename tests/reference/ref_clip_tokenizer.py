"""CLIP tokenizer parity: transformers' CLIPTokenizer on the vocabulary Stable Diffusion uses.

The 49,408-token vocabulary and its 48,894 merges are built from open_clip's
bpe_simple_vocab_16e6.txt.gz as open_clip and transformers build them, then written as the tokenizer
folders users have:
  sd15/  vocab.json + merges.txt + tokenizer_config.json + special_tokens_map.json, as SD 1.x's
         (special tokens as AddedToken dicts, model_max_length 77);
  sd2/   the same with "!" as the padding token, as SD 2.x's;
  json/  tokenizer.json + tokenizer_config.json as transformers 5 saves them;
  decoder/ vocab.json + merges.txt + a tokenizer_config.json with added_tokens_decoder, as newer
         hub folders have.
A sweep of generated strings (and real captions) is tokenized by each; the C++ test reads the same
folders and compares every id. open_clip's SimpleTokenizer (transformers 4's slow tokenizer: ftfy,
HTML unescaping) is run on the same strings and the strings where it differs are counted.
"""
import gzip
import json
import pathlib
import random
import shutil

CAPTIONS = [
    "a photo of a cat sitting on a windowsill",
    "A painting of a lighthouse at dusk, oil on canvas, trending on artstation",
    "portrait of a woman, (masterpiece:1.2), best quality, 8k, highly detailed",
    "an astronaut riding a horse on mars, digital art",
    "sks dog in a bucket",
    "The Eiffel Tower at night — long exposure, f/2.8, ISO 100",
    "a <cat-toy> on the beach",
    "pokemon with blue eyes and a red tail",
    "close-up photograph of a hummingbird's wing, 100mm macro",
    "two kids' bikes leaning against a fence; sunny afternoon",
    "Un café à Paris, l'après-midi, photographie argentique",
    "東京の夜景、ネオン、雨",
    "一只在草地上奔跑的小狗",
    "🐱 cute kitten emoji sticker 😺✨",
    "Ελληνικό ΣΠΙΤΙ στη θάλασσα",
    "straße in münchen, İstanbul'da bir kafe",
    "a    photo\twith\n\nodd   whitespace",
    "low quality, blurry, jpeg artifacts, watermark, text, signature",
    "A dog; a cat: a bird! (and a fish?) [maybe] {never}",
    "trending on artstation, unreal engine 5, octane render, 4k uhd",
]

SPECIAL_DICT = lambda content: {  # noqa: E731  an AddedToken as SD 1.x's files write it
    "__type": "AddedToken", "content": content, "lstrip": False, "normalized": True,
    "rstrip": False, "single_word": False}


def build_vocab():
    from open_clip.tokenizer import bytes_to_unicode, default_bpe
    lines = gzip.open(default_bpe()).read().decode("utf-8").split("\n")
    merges = lines[1:49152 - 256 - 2 + 1]
    vocab = list(bytes_to_unicode().values())
    vocab = vocab + [v + "</w>" for v in vocab]
    vocab += ["".join(m.split()) for m in merges]
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    assert len(vocab) == 49408, len(vocab)
    return {t: i for i, t in enumerate(vocab)}, merges


def write_folders(root: pathlib.Path):
    vocab, merges = build_vocab()
    if root.exists():
        shutil.rmtree(root)
    base = root / "sd15"
    base.mkdir(parents=True)
    (base / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (base / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    config = {"add_prefix_space": False, "bos_token": SPECIAL_DICT("<|startoftext|>"),
              "do_lower_case": True, "eos_token": SPECIAL_DICT("<|endoftext|>"),
              "errors": "replace", "model_max_length": 77, "pad_token": "<|endoftext|>",
              "tokenizer_class": "CLIPTokenizer", "unk_token": SPECIAL_DICT("<|endoftext|>")}
    smap = {k: ({kk: vv for kk, vv in v.items() if kk != "__type"} if isinstance(v, dict) else v)
            for k, v in config.items() if k.endswith("_token")}
    (base / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    (base / "special_tokens_map.json").write_text(json.dumps(smap, indent=1))
    sd2 = root / "sd2"
    shutil.copytree(base, sd2)
    for name in ["tokenizer_config.json", "special_tokens_map.json"]:
        j = json.loads((sd2 / name).read_text())
        j["pad_token"] = "!"
        (sd2 / name).write_text(json.dumps(j, indent=1))
    dec = root / "decoder"
    dec.mkdir()
    shutil.copy(base / "vocab.json", dec)
    shutil.copy(base / "merges.txt", dec)
    dconfig = {"added_tokens_decoder": {
        "49406": {"content": "<|startoftext|>", "lstrip": False, "normalized": True,
                  "rstrip": False, "single_word": False, "special": True},
        "49407": {"content": "<|endoftext|>", "lstrip": False, "normalized": False,
                  "rstrip": False, "single_word": False, "special": True}},
        "bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>", "unk_token": "<|endoftext|>", "model_max_length": 77,
        "tokenizer_class": "CLIPTokenizer"}
    (dec / "tokenizer_config.json").write_text(json.dumps(dconfig, indent=1))
    from transformers import CLIPTokenizer
    tok = CLIPTokenizer.from_pretrained(str(base))
    tok.save_pretrained(str(root / "json"))
    cfg = json.loads((root / "json" / "tokenizer_config.json").read_text())
    cfg["model_max_length"] = 77
    (root / "json" / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))


def random_strings(n: int, seed: int = 0):
    rng = random.Random(seed)
    words = ("a photo of the cat dog tree house painting portrait landscape city night rain "
             "beautiful masterpiece quality detailed highly render artstation octane unreal "
             "don't it's we're they've i'm you'll he'd sks ohwx xyz qwerty").split()
    punct = list("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~") + ["...", "—", "–", "’", "“", "”", "«", "»",
                                                          "¿", "¡", "§", "©", "®", "™", "°", "•"]
    emoji = ["😀", "🐱", "👍🏽", "👩‍💻", "🇯🇵", "❤️", "✨", "🔥", "🎨", "😺", "🦄", "👨‍👩‍👧‍👦"]
    cjk = ["东京", "夜景", "猫", "犬", "風景", "写真", "美しい", "한국어", "사진", "ネオン", "雨"]
    accented = ["café", "naïve", "résumé", "Ångström", "São Paulo", "Zürich", "Łódź", "Dvořák",
                "cafe\u0301", "nai\u0308ve", "A\u030angstro\u0308m", "n\u0303", "\u1e9b\u0323"]
    odd_case = ["İstanbul", "STRAßE", "ΣΊΣΥΦΟΣ", "ǅemal", "ﬁsh", "Ａｂｃ", "ＡＢＣ１２３", "Ⅻ", "½", "²"]
    controls = ["\x00", "\x01", "\x07", "\x1b", "\x7f", "\x85", "\u200b", "\u200d", "\ufeff",
                "\u00ad", "\ufffd"]
    spaces = [" ", "  ", "\t", "\n", "\r\n", "\u00a0", "\u2003", "\u3000", "\u2028", "\u1680",
              "\x0b", "\x0c", "\u202f"]
    specials = ["<|startoftext|>", "<|endoftext|>", "<|ENDOFTEXT|>", "<|StartOfText|>",
                "<|endof", "<|endoftext|>!!", "!!<|endoftext|>", "a<|endoftext|>b", "<|>", "!"]
    digits = ["0", "42", "2024", "3.14159", "1,000,000", "٣٤", "१२३", "①②", "0x1F"]

    def piece(kind):
        if kind == 0:
            w = rng.choice(words)
            r = rng.random()
            return w.upper() if r < 0.15 else w.capitalize() if r < 0.35 else w
        if kind == 1:
            return "".join(rng.choice(punct) for _ in range(rng.randint(1, 5)))
        if kind == 2:
            return rng.choice(digits) if rng.random() < 0.5 else str(rng.randint(0, 10**9))
        if kind == 3:
            return rng.choice(emoji)
        if kind == 4:
            return rng.choice(cjk)
        if kind == 5:
            return rng.choice(accented)
        if kind == 6:
            return rng.choice(odd_case)
        if kind == 7:
            return rng.choice(controls)
        if kind == 8:
            return rng.choice(specials)
        if kind == 9:  # any assigned code point of the BMP or the emoji planes
            while True:
                cp = rng.choice([rng.randint(0x20, 0x2FFF), rng.randint(0x3000, 0xD7FF),
                                 rng.randint(0xF900, 0xFFFD), rng.randint(0x1F300, 0x1FAFF)])
                ch = chr(cp)
                import unicodedata
                if unicodedata.category(ch) not in ("Cn", "Cs", "Co"):
                    return ch
        return rng.choice(words) + "'" + rng.choice(["s", "t", "re", "ve", "m", "ll", "d", "S",
                                                     "LL", "x"])

    out = []
    for i in range(n):
        k = i % 12
        if k < 10:  # mostly one category, with other pieces mixed in
            parts = [piece(k if rng.random() < 0.6 else rng.randrange(11))
                     for _ in range(rng.randint(1, 12))]
        elif k == 10:  # far past 77 tokens
            parts = [piece(rng.randrange(11)) for _ in range(rng.randint(60, 200))]
        else:
            parts = [piece(10) for _ in range(rng.randint(1, 6))]
        text = ""
        for p in parts:
            text += p + (rng.choice(spaces) if rng.random() < 0.8 else "")
        out.append(text)
    return out


def generate(out: pathlib.Path):
    from transformers import CLIPTokenizer
    from transformers.utils import logging
    logging.set_verbosity_error()  # "longer than the maximum sequence length" for the long texts
    from open_clip.tokenizer import SimpleTokenizer
    root = out / "clip_tokenizer"
    write_folders(root)
    strings = random_strings(12000) + CAPTIONS
    result = {"strings": strings, "variants": {}}
    for name, count in [("sd15", len(strings)), ("json", len(strings)), ("sd2", 3000),
                        ("decoder", 3000)]:
        tok = CLIPTokenizer.from_pretrained(str(root / name))
        some = strings[:count]
        ids = tok(some, add_special_tokens=True)["input_ids"]
        batch = tok(some[:500], padding="max_length", max_length=tok.model_max_length,
                    truncation=True)
        longest = tok(some[500:700], padding="longest", truncation=True, max_length=40)
        decoded = [tok.decode(x) for x in ids[:500]]
        decoded_skip = [tok.decode(x, skip_special_tokens=True) for x in ids[:500]]
        result["variants"][name] = {
            "count": count, "ids": ids, "pad_token_id": tok.pad_token_id,
            "model_max_length": tok.model_max_length,
            "batch_ids": batch["input_ids"], "batch_mask": batch["attention_mask"],
            "longest_ids": longest["input_ids"], "longest_mask": longest["attention_mask"],
            "decoded": decoded, "decoded_skip": decoded_skip}
    # Textual-inversion names added as diffusers' load_textual_inversion adds them
    # (tokenizer.add_tokens: a multi-vector embedding adds "<name>", "<name>_1", ...).
    tok = CLIPTokenizer.from_pretrained(str(root / "sd15"))
    names = ["<cat-toy>", "<cat-toy>_1", "<cat-toy>_2", "<Fancy-Style>", "sks", "a"]
    tok.add_tokens(names)
    prompts = ["a photo of <cat-toy> <cat-toy>_1 <cat-toy>_2 on a beach",
               "<CAT-TOY> in the style of <fancy-style>, <Fancy-Style>!", "sks dog, asks, a sks",
               "<cat-toy><cat-toy>_1<cat-toy>_2", "<cat-toy>_10 and <cat-toy>_", "a a aa"]
    flags = [{"content": t.content, "id": i, "normalized": t.normalized, "special": t.special,
              "lstrip": t.lstrip, "rstrip": t.rstrip, "single_word": t.single_word}
             for i, t in sorted(tok.added_tokens_decoder.items()) if t.content in names]
    result["added"] = {"names": names, "tokens": flags, "prompts": prompts,
                       "ids": tok(prompts)["input_ids"], "size": len(tok)}
    # open_clip's tokenizer (transformers 4's slow CLIPTokenizer: ftfy, HTML unescaping).
    slow = SimpleTokenizer()
    fast = result["variants"]["sd15"]["ids"]
    differ = [i for i, s in enumerate(strings)
              if [49406] + slow.encode(s) + [49407] != fast[i]]
    result["slow_differs"] = differ
    plain = [i for i, s in enumerate(strings) if "<|" not in s]
    result["slow_differs_plain"] = [i for i in differ if "<|" not in strings[i]]
    result["plain_count"] = len(plain)
    (out / "clip_tokenizer.json").write_text(json.dumps(result, ensure_ascii=False))
