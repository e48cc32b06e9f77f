"""The Python side of clip_tokenizer_vs_hf_tokenizers: Hugging Face's Rust tokenizer (the backend
of transformers' CLIPTokenizer) encoding a list of captions on one thread. Usage:
python_tokenizer.py DIR; writes SD's CLIP tokenizer folder and the captions (texts.json) into DIR
when they are not there, and prints {"seconds_per_step": ...} for one pass over the captions."""
import json
import os
import pathlib
import random
import sys
import time

os.environ["RAYON_NUM_THREADS"] = "1"  # one core, as the C++ side
os.environ["TOKENIZERS_PARALLELISM"] = "false"
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests" / "reference"))


def captions(n):
    import ref_clip_tokenizer as ref
    rng = random.Random(1)
    out = []
    for i in range(n):
        words = [rng.choice(ref.CAPTIONS).split() for _ in range(2)]
        out.append(" ".join(words[0][: rng.randint(3, 12)] + words[1][: rng.randint(0, 10)]))
    return out


def main():
    folder = pathlib.Path(sys.argv[1])
    if not (folder / "sd15" / "merges.txt").exists() or not (folder / "texts.json").exists():
        import ref_clip_tokenizer as ref
        ref.write_folders(folder)
        (folder / "texts.json").write_text(json.dumps(captions(2000), ensure_ascii=False))
    from transformers import CLIPTokenizer
    texts = json.loads((folder / "texts.json").read_text())
    tok = CLIPTokenizer.from_pretrained(str(folder / "sd15")).backend_tokenizer
    tok.encode_batch(texts)
    steps, start = 0, time.perf_counter()
    while steps < 3 or time.perf_counter() - start < 1.0:
        tok.encode_batch(texts)  # the batch call: no Python call per text
        steps += 1
    print(json.dumps({"seconds_per_step": (time.perf_counter() - start) / steps}))


if __name__ == "__main__":
    main()
