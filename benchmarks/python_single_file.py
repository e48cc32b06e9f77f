"""The Python side of single_file_load_vs_diffusers: diffusers' StableDiffusionPipeline.from_single_file
reading a single file with its configs from a folder (`config=`), the tokenizer and scheduler
handed in already loaded, so the time is the UNet's, VAE's and text encoder's. Usage:
python_single_file.py FILE CONFIG_FOLDER; completes the folder (tokenizer, scheduler,
model_index.json) when they are not there and prints {"seconds_per_step": ...} for one load (the
fastest of three, after one untimed)."""
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests" / "reference"))


def complete(folder):
    from diffusers import DDIMScheduler
    if not (folder / "tokenizer" / "merges.txt").exists():
        import ref_clip_tokenizer as ref
        ref.write_folders(folder / "tokenizers")
        (folder / "tokenizers" / "sd15").rename(folder / "tokenizer")
    DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear").save_config(
        folder / "scheduler")
    (folder / "model_index.json").write_text(json.dumps({
        "_class_name": "StableDiffusionPipeline", "_diffusers_version": "0.42.1",
        "unet": ["diffusers", "UNet2DConditionModel"], "vae": ["diffusers", "AutoencoderKL"],
        "text_encoder": ["transformers", "CLIPTextModel"], "tokenizer": ["transformers", "CLIPTokenizer"],
        "scheduler": ["diffusers", "DDIMScheduler"], "safety_checker": [None, None],
        "feature_extractor": [None, None], "image_encoder": [None, None],
        "requires_safety_checker": False}))


def main():
    import torch
    from diffusers import DDIMScheduler, StableDiffusionPipeline
    from diffusers.utils import logging as diffusers_logging
    from transformers import CLIPTokenizer
    diffusers_logging.set_verbosity_error()
    torch.set_num_threads(1)
    file, folder = sys.argv[1], pathlib.Path(sys.argv[2])
    complete(folder)
    tok = CLIPTokenizer.from_pretrained(str(folder / "tokenizer"))
    sched = DDIMScheduler.from_pretrained(str(folder / "scheduler"))

    def load():
        return StableDiffusionPipeline.from_single_file(
            file, config=str(folder), local_files_only=True, tokenizer=tok, scheduler=sched,
            safety_checker=None, requires_safety_checker=False)

    load()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        pipe = load()
        best = min(best, time.perf_counter() - start)
        del pipe
    print(json.dumps({"seconds_per_step": best}))


if __name__ == "__main__":
    main()
