"""Golden values for the caption, noise and loss options of today's LoRA trainers, as kohya's
sd-scripts defines them (library/train_util.py's process_caption and
get_huber_threshold_if_needed / conditional_loss, custom_train_functions.py's apply_noise_offset,
pyramid_noise_like, apply_debiased_estimation, add_v_prediction_like_loss,
scale_v_prediction_loss_like_noise_prediction, apply_masked_loss).

The functions below are those definitions, written against their arguments instead of kohya's
dataset and args objects. Every random draw they make is recorded in order (Python's
random.random() and random._randbelow(n) for the captions and pyramid scales, every torch.randn
tensor for the noise), and difftrain replays the same draws: the sweeps compare the results
exactly (captions) or to float32 rounding (tensors).
"""
import json
import math
import random

import torch
from diffusers import DDPMScheduler
from safetensors.torch import save_file


# ---- kohya's definitions ----------------------------------------------------------------------

def process_caption(caption, o, epoch, step, max_train_steps, rng):
    if o["caption_prefix"]:
        caption = o["caption_prefix"] + " " + caption
    if o["caption_suffix"]:
        caption = caption + " " + o["caption_suffix"]
    is_drop_out = o["caption_dropout_rate"] > 0 and rng.random() < o["caption_dropout_rate"]
    is_drop_out = is_drop_out or (o["caption_dropout_every_n_epochs"] > 0
                                  and epoch % o["caption_dropout_every_n_epochs"] == 0)
    if is_drop_out:
        return ""
    if o["enable_wildcard"]:
        if "\n" in caption:
            caption = rng.choice(caption.split("\n"))
        replacer1, replacer2 = "⦅", "⦆"
        while replacer1 in caption or replacer2 in caption:
            replacer1 += "⦅"
            replacer2 += "⦆"
        caption = caption.replace("{{", replacer1).replace("}}", replacer2)
        import re
        caption = re.sub(r"\{([^}]+)\}", lambda m: rng.choice(m.group(1).split("|")), caption)
        caption = caption.replace(replacer1, "{").replace(replacer2, "}")
    else:
        caption = caption.split("\n")[0]
    sep = o["caption_separator"]
    warmup_step = o["token_warmup_step"]
    if o["shuffle_caption"] or warmup_step > 0 or o["caption_tag_dropout_rate"] > 0:
        fixed_tokens, flex_tokens, fixed_suffix_tokens = [], [], []
        kts = o["keep_tokens_separator"]
        if kts and kts in caption:
            fixed_part, flex_part = caption.split(kts, 1)
            if kts in flex_part:
                flex_part, fixed_suffix_part = flex_part.split(kts, 1)
                fixed_suffix_tokens = [t.strip() for t in fixed_suffix_part.split(sep) if t.strip()]
            fixed_tokens = [t.strip() for t in fixed_part.split(sep) if t.strip()]
            flex_tokens = [t.strip() for t in flex_part.split(sep) if t.strip()]
        else:
            tokens = [t.strip() for t in caption.strip().split(sep)]
            flex_tokens = tokens[:]
            if o["keep_tokens"] > 0:
                fixed_tokens = flex_tokens[:o["keep_tokens"]]
                flex_tokens = tokens[o["keep_tokens"]:]
        if warmup_step < 1:
            warmup_step = math.floor(warmup_step * max_train_steps)
        if warmup_step and step < warmup_step:
            tokens_len = math.floor(step * ((len(flex_tokens) - o["token_warmup_min"]) / warmup_step)) \
                + o["token_warmup_min"]
            flex_tokens = flex_tokens[:tokens_len]

        def dropout_tags(tokens):
            if o["caption_tag_dropout_rate"] <= 0:
                return tokens
            return [t for t in tokens if rng.random() >= o["caption_tag_dropout_rate"]]

        if o["shuffle_caption"]:
            rng.shuffle(flex_tokens)
        flex_tokens = dropout_tags(flex_tokens)
        caption = ", ".join(fixed_tokens + flex_tokens + fixed_suffix_tokens)
    if o["secondary_separator"]:
        caption = caption.replace(o["secondary_separator"], sep)
    return caption


def apply_noise_offset(latents, noise, noise_offset, adaptive_noise_scale, randn):
    if adaptive_noise_scale is not None:
        latent_mean = torch.abs(latents.mean(dim=(2, 3), keepdim=True))
        noise_offset = noise_offset + adaptive_noise_scale * latent_mean
        noise_offset = torch.clamp(noise_offset, 0.0, None)
    return noise + noise_offset * randn((latents.shape[0], latents.shape[1], 1, 1))


def pyramid_noise_like(noise, iterations, discount, rng, randn):
    b, c, w, h = noise.shape
    u = torch.nn.Upsample(size=(w, h), mode="bilinear")
    for i in range(iterations):
        r = rng.random() * 2 + 2
        wn, hn = max(1, int(w / (r**i))), max(1, int(h / (r**i)))
        noise += u(randn((b, c, wn, hn))) * discount**i
        if wn == 1 or hn == 1:
            break
    return noise / noise.std()


def huber_threshold(schedule, huber_c, huber_scale, timesteps, noise_scheduler):
    b_size = timesteps.shape[0]
    if schedule == "exponential":
        alpha = -math.log(huber_c) / noise_scheduler.config.num_train_timesteps
        return torch.exp(-alpha * timesteps) * huber_scale
    if schedule == "snr":
        alphas_cumprod = torch.index_select(noise_scheduler.alphas_cumprod, 0, timesteps.cpu())
        sigmas = ((1.0 - alphas_cumprod) / alphas_cumprod) ** 0.5
        return (1 - huber_c) / (1 + sigmas) ** 2 + huber_c
    return torch.full((b_size,), huber_c * huber_scale)


def conditional_loss(model_pred, target, loss_type, huber_c=None):
    if loss_type == "l2":
        return torch.nn.functional.mse_loss(model_pred, target, reduction="none")
    if loss_type == "l1":
        return torch.nn.functional.l1_loss(model_pred, target, reduction="none")
    huber_c = huber_c.view(-1, *([1] * (model_pred.ndim - 1)))
    if loss_type == "huber":
        return 2 * huber_c * (torch.sqrt((model_pred - target) ** 2 + huber_c**2) - huber_c)
    return 2 * (torch.sqrt((model_pred - target) ** 2 + huber_c**2) - huber_c)


def all_snr(noise_scheduler):
    a = noise_scheduler.alphas_cumprod
    return (torch.sqrt(a) / torch.sqrt(1.0 - a)) ** 2


def debiased(loss, timesteps, snr_table, v_prediction=False):
    snr_t = torch.stack([snr_table[t] for t in timesteps])
    snr_t = torch.minimum(snr_t, torch.ones_like(snr_t) * 1000)
    weight = 1 / (snr_t + 1) if v_prediction else 1 / torch.sqrt(snr_t)
    return weight * loss


def snr_scale(timesteps, snr_table):
    snr_t = torch.stack([snr_table[t] for t in timesteps])
    snr_t = torch.minimum(snr_t, torch.ones_like(snr_t) * 1000)
    return snr_t / (snr_t + 1)


def masked(loss, alpha_masks):
    mask = alpha_masks.to(dtype=loss.dtype).unsqueeze(1)
    mask = torch.nn.functional.interpolate(mask, size=loss.shape[2:], mode="area")
    return loss * mask


# ---- recording the draws ----------------------------------------------------------------------

class Recorder(random.Random):
    """Python's generator, every random() and _randbelow(n) written down in order."""

    def __init__(self, seed):
        super().__init__(seed)
        self.log = []

    def random(self):
        v = super().random()
        self.log.append(["r", v])
        return v

    def _randbelow(self, n):
        v = super()._randbelow(n)
        self.log.append(["b", n, v])
        return v


class TensorDraws:
    def __init__(self, seed):
        self.g = torch.Generator().manual_seed(seed)
        self.drawn = []

    def __call__(self, shape):
        t = torch.randn(shape, generator=self.g)
        self.drawn.append(t)
        return t


TAGS = ["1girl", "solo", "long hair", "smile", "looking at viewer", "blue eyes", "outdoors",
        "sky", "cloud", "tree", "dress", "red ribbon", "holding", "sks dog", "a photo of",
        "masterpiece", "best quality", "été", "猫", "night", "  spaced  ", "ribbon"]


def caption_sweep(rng):
    out = []
    for i in range(600):
        n = rng.randint(0, 9)
        tags = [rng.choice(TAGS) for _ in range(n)]
        sep = ", " if i % 5 else ","
        caption = sep.join(tags)
        kind = i % 12
        if kind == 1:
            caption = "sks dog ||| " + caption
        elif kind == 2:
            caption = "front, tag ||| " + caption + " ||| suffix one, suffix two"
        elif kind == 3:
            caption = caption + "\nsecond line, other\nthird line"
        elif kind == 4:
            caption = "a {red|blue|green} car, {{literal}}, " + caption
        elif kind == 5:
            caption = caption.replace(", ", " _ ", 2)
        elif kind == 6:
            caption = " ,  , " + caption + ",,"
        out.append(caption)
    return out


OPTION_SETS = [
    dict(shuffle_caption=True),
    dict(shuffle_caption=True, keep_tokens=1),
    dict(shuffle_caption=True, keep_tokens=3, caption_tag_dropout_rate=0.3),
    dict(shuffle_caption=True, keep_tokens_separator="|||"),
    dict(caption_tag_dropout_rate=0.5, keep_tokens_separator="|||", keep_tokens=2),
    dict(caption_dropout_rate=0.25, shuffle_caption=True),
    dict(caption_dropout_every_n_epochs=3),
    dict(enable_wildcard=True, shuffle_caption=True),
    dict(enable_wildcard=True),
    dict(caption_prefix="photo of", caption_suffix="4k", secondary_separator=" _ "),
    dict(secondary_separator=" _ ", shuffle_caption=True, caption_separator=","),
    dict(token_warmup_step=0.5, token_warmup_min=2, shuffle_caption=True),
    dict(token_warmup_step=40, token_warmup_min=1),
    dict(caption_separator=";", shuffle_caption=True),
    dict(),
]

DEFAULTS = dict(caption_prefix="", caption_suffix="", caption_dropout_rate=0.0,
                caption_dropout_every_n_epochs=0, caption_tag_dropout_rate=0.0,
                shuffle_caption=False, keep_tokens=0, keep_tokens_separator="",
                caption_separator=",", secondary_separator="", enable_wildcard=False,
                token_warmup_min=1, token_warmup_step=0)


def generate(out):
    root = out / "kohya_options"
    root.mkdir(parents=True, exist_ok=True)
    sweep_rng = random.Random(7)
    captions = caption_sweep(sweep_rng)
    cases = []
    for k, extra in enumerate(OPTION_SETS):
        o = dict(DEFAULTS, **extra)
        rng = Recorder(100 + k)
        results = []
        for i, c in enumerate(captions):
            epoch, step = 1 + i % 4, (i * 7) % 100
            results.append(process_caption(c, o, epoch, step, 100, rng))
        cases.append({"options": o, "results": results, "draws": rng.log})
    (root / "captions.json").write_text(json.dumps(
        {"captions": captions, "max_train_steps": 100, "cases": cases}, ensure_ascii=False))

    # Noise: offset (plain and adaptive) and pyramid noise over shapes and settings.
    tensors, noise_cases = {}, []
    g = torch.Generator().manual_seed(3)
    shapes = [(2, 4, 8, 8), (1, 4, 13, 7), (3, 2, 5, 16), (2, 4, 64, 48)]
    settings = [(0.1, None, 6, 0.3), (0.0357, 0.00357, 10, 0.1), (0.05, -0.02, 3, 0.8),
                (0.2, 0.5, 1, 0.4)]
    for i, (shape, (offset, adaptive, iterations, discount)) in enumerate(
            [(s, st) for s in shapes for st in settings]):
        latents = torch.randn(shape, generator=g) * 1.5 + 0.3
        noise = torch.randn(shape, generator=g)
        draws = TensorDraws(50 + i)
        offset_out = apply_noise_offset(latents, noise, offset, adaptive, draws)
        rng = Recorder(70 + i)
        pyramid_out = pyramid_noise_like(noise.clone(), iterations, discount, rng, draws)
        tensors[f"noise.{i}.latents"] = latents
        tensors[f"noise.{i}.noise"] = noise
        tensors[f"noise.{i}.offset_out"] = offset_out
        tensors[f"noise.{i}.pyramid_out"] = pyramid_out
        for j, t in enumerate(draws.drawn):
            tensors[f"noise.{i}.draw.{j}"] = t
        noise_cases.append({"offset": offset, "adaptive": adaptive, "iterations": iterations,
                            "discount": discount, "draws": len(draws.drawn),
                            "uniform": [v for kind, v in rng.log]})

    # Losses: thresholds of every schedule, every loss type, the SNR weights, masks.
    sched = DDPMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear")
    snr_table = all_snr(sched)
    loss_cases = []
    for i, (schedule, c, scale) in enumerate([(s, c, sc) for s in ("constant", "exponential", "snr")
                                              for c in (0.1, 0.5, 1.0) for sc in (1.0, 2.5)]):
        t = torch.randint(0, 1000, (6,), generator=g)
        t[0] = 0
        t[1] = 999
        thr = huber_threshold(schedule, c, scale, t, sched).float()
        pred = torch.randn(6, 4, 5, 7, generator=g) * 2
        target = torch.randn(6, 4, 5, 7, generator=g)
        tensors[f"loss.{i}.t"] = t
        tensors[f"loss.{i}.threshold"] = thr
        tensors[f"loss.{i}.pred"] = pred
        tensors[f"loss.{i}.target"] = target
        for kind in ("l2", "l1", "huber", "smooth_l1"):
            tensors[f"loss.{i}.{kind}"] = conditional_loss(pred, target, kind, thr)
        per_sample = conditional_loss(pred, target, "l2").mean(dim=(1, 2, 3))
        tensors[f"loss.{i}.debiased"] = debiased(per_sample, t, snr_table)
        tensors[f"loss.{i}.debiased_v"] = debiased(per_sample, t, snr_table, True)
        tensors[f"loss.{i}.v_like"] = per_sample + per_sample / snr_scale(t, snr_table) * 0.1
        tensors[f"loss.{i}.v_scaled"] = per_sample * snr_scale(t, snr_table)
        masks = torch.rand(6, 40, 56, generator=g)
        tensors[f"loss.{i}.masks"] = masks
        tensors[f"loss.{i}.masked"] = masked(conditional_loss(pred, target, "l2"), masks)
        loss_cases.append({"schedule": schedule, "huber_c": c, "huber_scale": scale})
    # Flow matching (kohya's SD3/Flux paths): float timesteps σ·N, the schedules without ᾱ.
    from diffusers import FlowMatchEulerDiscreteScheduler
    flow = FlowMatchEulerDiscreteScheduler(shift=3.0)
    flow_cases = []
    for i, (schedule, c, scale) in enumerate([(s, c, sc) for s in ("constant", "exponential")
                                              for c in (0.1, 0.5, 1.0) for sc in (1.0, 2.5)]):
        t = torch.rand(6, generator=g) * 1000
        t[0], t[1] = 0.0, 1000.0
        tensors[f"flow.{i}.t"] = t
        tensors[f"flow.{i}.threshold"] = huber_threshold(schedule, c, scale, t, flow).float()
        flow_cases.append({"schedule": schedule, "huber_c": c, "huber_scale": scale})
    save_file({k: v.contiguous() for k, v in tensors.items()}, root / "tensors.safetensors")
    (root / "index.json").write_text(json.dumps({"noise": noise_cases, "loss": loss_cases,
                                                 "flow": flow_cases}))


if __name__ == "__main__":
    import pathlib
    import sys
    generate(pathlib.Path(sys.argv[1]))
