"""The web UI's textual-inversion training loop (seed 001, train_embedding), restated on a small
problem: only the embedding's vectors train (AdamW, no weight decay), the learning rate and the
clipping limit come from step strings consulted at every micro-batch, gradients accumulate over
`gradient_step` micro-batches of the loss divided by it, and an epoch's micro-batches that cannot
fill a step are dropped. The frozen "model" maps the vectors through fixed matrices; batch j of
epoch e holds items (j*bs + k + 3e) mod n. The web UI shuffles its data, so its order on resuming is
not defined; difftrain continues the epoch count (epoch = step // steps per epoch), and so does
this restatement."""
import json

import torch

from ref_schedule import LearnRateScheduler


def problem():
    g = torch.Generator().manual_seed(5)
    return {"vec": torch.randn(3, 4, generator=g), "w": torch.randn(4, 5, generator=g),
            "a": torch.randn(10, 3, generator=g), "y": torch.randn(10, 5, generator=g)}


def train(p, vec, learn_rate, clip_mode, clip_value, batch_size, gradient_step, steps, initial_step):
    n = p["a"].shape[0]
    vec = vec.clone().requires_grad_(True)
    scheduler = LearnRateScheduler(learn_rate, steps, initial_step)
    clip = {"norm": torch.nn.utils.clip_grad_norm_, "value": torch.nn.utils.clip_grad_value_}.get(clip_mode)
    if clip:
        clip_sched = LearnRateScheduler(clip_value, steps, initial_step)
    optimizer = torch.optim.AdamW([vec], lr=scheduler.learn_rate, weight_decay=0.0)
    batches = n // batch_size
    max_steps_per_epoch = batches - batches % gradient_step
    step = initial_step
    first_epoch = initial_step // (max_steps_per_epoch // gradient_step)
    losses, lrs = [], []
    _loss_step = 0.0
    finished = False
    for epoch in range((steps - initial_step) * gradient_step):
        if finished:
            break
        for j in range(batches):
            if j == max_steps_per_epoch:
                break
            if scheduler.step(step):  # LearnRateScheduler.apply
                for pg in optimizer.param_groups:
                    pg["lr"] = scheduler.learn_rate
            if scheduler.finished:
                finished = True
                break
            if clip:
                clip_sched.step(step)
            idx = [(j * batch_size + k + 3 * (first_epoch + epoch)) % n for k in range(batch_size)]
            pred = p["a"][idx] @ vec @ p["w"]
            loss = torch.nn.functional.mse_loss(pred, p["y"][idx]) / gradient_step
            _loss_step += loss.item()
            loss.backward()
            if (j + 1) % gradient_step != 0:
                continue
            if clip:
                clip([vec], clip_sched.learn_rate)
            optimizer.step()
            step += 1
            optimizer.zero_grad(set_to_none=True)
            losses.append(_loss_step)
            lrs.append(optimizer.param_groups[0]["lr"])
            _loss_step = 0.0
    return vec.detach(), losses, lrs, step


CASES = [
    dict(name="norm", learn_rate="0.05:3, 0.02:7, 0.005", clip_mode="norm", clip_value="0.5:4, 1.0",
         batch_size=2, gradient_step=2, steps=9, initial_step=0),
    dict(name="value_resumed", learn_rate="0.1:2, 0.03:5, 0.01:8", clip_mode="value", clip_value="0.05",
         batch_size=3, gradient_step=1, steps=12, initial_step=3),
    dict(name="ends_with_schedule", learn_rate="0.02:4", clip_mode="disabled", clip_value="0.1",
         batch_size=4, gradient_step=1, steps=10, initial_step=0),
]


def generate(out):
    p = problem()
    cases = {}
    for c in CASES:
        args = {k: v for k, v in c.items() if k != "name"}
        vec, losses, lrs, step = train(p, p["vec"], **args)
        cases[c["name"]] = dict(args, final=vec.flatten().tolist(), losses=losses, lrs=lrs, final_step=step)
    json.dump({"problem": {k: v.flatten().tolist() for k, v in p.items()}, "cases": cases},
              open(out / "webui_training.json", "w"), indent=1)
