"""The Python side of t5_tokenizer_vs_hf_tokenizers: Hugging Face's Rust tokenizer (the backend of
transformers' T5Tokenizer) encoding a list of captions on one thread. Usage:
python_t5_tokenizer.py DIR; trains a T5-layout SentencePiece Unigram model (4,000 pieces, nmt_nfkc)
and writes it with the captions (texts.json) into DIR when they are not there, and prints
{"seconds_per_step": ...} for one pass over the captions."""
import json
import os
import pathlib
import sys
import time

os.environ["RAYON_NUM_THREADS"] = "1"  # one core, as the C++ side
os.environ["TOKENIZERS_PARALLELISM"] = "false"
here = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(here.parent / "tests" / "reference"))
sys.path.insert(0, str(here))


def main():
    folder = pathlib.Path(sys.argv[1])
    if not (folder / "t5" / "spiece.model").exists() or not (folder / "texts.json").exists():
        import python_tokenizer
        import ref_clip_tokenizer as clip_ref
        import ref_t5_tokenizer as ref
        texts = python_tokenizer.captions(2000)
        corpus = [s.replace("\n", " ") for s in clip_ref.random_strings(4000, seed=7)]
        model = ref.train(corpus + texts, vocab_size=4000, normalization_rule_name="nmt_nfkc")
        (folder / "t5").mkdir(parents=True, exist_ok=True)
        (folder / "t5" / "spiece.model").write_bytes(model)
        (folder / "texts.json").write_text(json.dumps(texts, ensure_ascii=False))
    from transformers import T5Tokenizer
    from transformers.utils import logging
    logging.set_verbosity_error()
    texts = json.loads((folder / "texts.json").read_text())
    tok = T5Tokenizer.from_pretrained(str(folder / "t5")).backend_tokenizer
    tok.encode_batch(texts)
    steps, start = 0, time.perf_counter()
    while steps < 3 or time.perf_counter() - start < 1.0:
        tok.encode_batch(texts)  # the batch call: no Python call per text
        steps += 1
    print(json.dumps({"seconds_per_step": (time.perf_counter() - start) / steps}))


if __name__ == "__main__":
    main()
