"""Golden LR curves from the real schedulers: torch.optim.lr_scheduler, diffusers' get_scheduler
family, timm's schedulers, pytorch-warmup (as DALLE2's trainers combine it with torch's), and the two
references that cannot be installed (CogVideoX's LR lambdas and the web UI's step strings), copied
here from their sources. Two parameter groups with different base LRs, hundreds of steps, past
restarts, cycle ends and the last step.
"""
import json
import math
import warnings

import numpy as np
import pytorch_warmup
import torch
from diffusers.optimization import (get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup,
                                    get_cosine_with_hard_restarts_schedule_with_warmup,
                                    get_linear_schedule_with_warmup, get_polynomial_decay_schedule_with_warmup,
                                    get_scheduler)
from timm.scheduler import (CosineLRScheduler, MultiStepLRScheduler, PolyLRScheduler, StepLRScheduler,
                            TanhLRScheduler)
from timm.scheduler.wsd_lr import WSDLRScheduler
from torch.optim import lr_scheduler as tls

BASES = [0.1, 0.02]
N = 400


def optimizer(kind="sgd", betas=(0.9, 0.999)):
    groups = [{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": b} for b in BASES]
    if kind == "adam":
        return torch.optim.Adam(groups, lr=BASES[0], betas=betas)
    return torch.optim.SGD(groups, lr=BASES[0])


def lrs(opt):
    return [g["lr"] for g in opt.param_groups]


def run_torch(make, n=N, kind="sgd"):
    opt = optimizer(kind)
    sched = make(opt)
    out = []
    for _ in range(n):
        out.append(lrs(opt))
        opt.step()
        sched.step()
    return out


def run_timm(make, n=N):
    sched = make(optimizer())
    return [sched._get_lr(t) for t in range(n)]


def run_warmup(make_sched, make_warmup, n=N, kind="sgd", betas=(0.9, 0.999), group_beta2s=None):
    # The DALLE2 trainer's pattern: optimizer.step(); with warmup.dampening(): scheduler.step()
    opt = optimizer(kind, betas)
    if group_beta2s is not None:  # per-group betas, which the untuned and RAdam warm-ups read
        for group, b2 in zip(opt.param_groups, group_beta2s):
            group["betas"] = (0.9, b2)
    sched = make_sched(opt)
    warm = make_warmup(opt)
    out = []
    for _ in range(n):
        out.append(lrs(opt))
        opt.step()
        with warm.dampening():
            sched.step()
    return out


# ---- CogVideoX's sgm/lr_scheduler.py (seed 003), verbatim formulas ----------------------------
class LambdaWarmUpCosineScheduler:
    def __init__(self, warm_up_steps, lr_min, lr_max, lr_start, max_decay_steps):
        self.lr_warm_up_steps, self.lr_start, self.lr_min = warm_up_steps, lr_start, lr_min
        self.lr_max, self.lr_max_decay_steps = lr_max, max_decay_steps

    def __call__(self, n):
        if n < self.lr_warm_up_steps:
            return (self.lr_max - self.lr_start) / self.lr_warm_up_steps * n + self.lr_start
        t = (n - self.lr_warm_up_steps) / (self.lr_max_decay_steps - self.lr_warm_up_steps)
        t = min(t, 1.0)
        return self.lr_min + 0.5 * (self.lr_max - self.lr_min) * (1 + np.cos(t * np.pi))


class LambdaWarmUpCosineScheduler2:
    def __init__(self, warm_up_steps, f_min, f_max, f_start, cycle_lengths):
        self.lr_warm_up_steps, self.f_start, self.f_min, self.f_max = warm_up_steps, f_start, f_min, f_max
        self.cycle_lengths = cycle_lengths
        self.cum_cycles = np.cumsum([0] + list(self.cycle_lengths))

    def find_in_interval(self, n):
        interval = 0
        for cl in self.cum_cycles[1:]:
            if n <= cl:
                return interval
            interval += 1

    def __call__(self, n):
        cycle = self.find_in_interval(n)
        n = n - self.cum_cycles[cycle]
        if n < self.lr_warm_up_steps[cycle]:
            return (self.f_max[cycle] - self.f_start[cycle]) / self.lr_warm_up_steps[cycle] * n + self.f_start[cycle]
        t = (n - self.lr_warm_up_steps[cycle]) / (self.cycle_lengths[cycle] - self.lr_warm_up_steps[cycle])
        t = min(t, 1.0)
        return self.f_min[cycle] + 0.5 * (self.f_max[cycle] - self.f_min[cycle]) * (1 + np.cos(t * np.pi))


class LambdaLinearScheduler(LambdaWarmUpCosineScheduler2):
    def __call__(self, n):
        cycle = self.find_in_interval(n)
        n = n - self.cum_cycles[cycle]
        if n < self.lr_warm_up_steps[cycle]:
            return (self.f_max[cycle] - self.f_start[cycle]) / self.lr_warm_up_steps[cycle] * n + self.f_start[cycle]
        return self.f_min[cycle] + (self.f_max[cycle] - self.f_min[cycle]) * (self.cycle_lengths[cycle] - n) / (
            self.cycle_lengths[cycle])


# ---- the web UI's modules/textual_inversion/learn_schedule.py ------------------------------------
class LearnScheduleIterator:
    def __init__(self, learn_rate, max_steps, cur_step=0):
        pairs = learn_rate.split(',')
        self.rates = []
        self.it = 0
        self.maxit = 0
        try:
            for pair in pairs:
                if not pair.strip():
                    continue
                tmp = pair.split(':')
                if len(tmp) == 2:
                    step = int(tmp[1])
                    if step > cur_step:
                        self.rates.append((float(tmp[0]), min(step, max_steps)))
                        self.maxit += 1
                        if step > max_steps:
                            return
                    elif step == -1:
                        self.rates.append((float(tmp[0]), max_steps))
                        self.maxit += 1
                        return
                else:
                    self.rates.append((float(tmp[0]), max_steps))
                    self.maxit += 1
                    return
            assert self.rates
        except (ValueError, AssertionError) as e:
            raise Exception('Invalid learning rate schedule.') from e

    def __iter__(self):
        return self

    def __next__(self):
        if self.it < self.maxit:
            self.it += 1
            return self.rates[self.it - 1]
        else:
            raise StopIteration


class LearnRateScheduler:
    def __init__(self, learn_rate, max_steps, cur_step=0):
        self.schedules = LearnScheduleIterator(learn_rate, max_steps, cur_step)
        (self.learn_rate, self.end_step) = next(self.schedules)
        self.finished = False

    def step(self, step_number):
        if step_number < self.end_step:
            return False
        try:
            (self.learn_rate, self.end_step) = next(self.schedules)
        except StopIteration:
            self.finished = True
            return False
        return True


def run_step_string(text, max_steps, start_step=0, consults=1, n=N):
    s = LearnRateScheduler(text, max_steps, start_step)
    out = []
    for step in range(start_step, start_step + n):
        for _ in range(consults):  # the web UI consults once per micro-batch
            s.step(step)
        out.append([s.learn_rate] * len(BASES))
    return out


def lambda_lr(fn):
    return lambda opt: tls.LambdaLR(opt, fn)


def plateau_case():
    opt = optimizer()
    sched = tls.ReduceLROnPlateau(opt, mode="min", factor=0.5, patience=3, threshold=1e-3, cooldown=2,
                                  min_lr=[1e-3, 1e-3])
    metrics = [1.0 / (1 + i) if i < 20 else 0.05 + 0.001 * ((i * 7) % 5) for i in range(120)]
    out = []
    for m in metrics:
        sched.step(m)
        out.append(lrs(opt))
    return {"metrics": metrics, "lrs": out}


def generate(out):
    warnings.filterwarnings("ignore")
    cases = {
        # torch
        "cosine_annealing": run_torch(lambda o: tls.CosineAnnealingLR(o, T_max=100, eta_min=0.001)),
        "cosine_warm_restarts": run_torch(lambda o: tls.CosineAnnealingWarmRestarts(o, T_0=30, eta_min=0.002)),
        "cosine_warm_restarts_mult": run_torch(lambda o: tls.CosineAnnealingWarmRestarts(o, T_0=7, T_mult=2)),
        "polynomial_lr": run_torch(lambda o: tls.PolynomialLR(o, total_iters=150, power=1.7)),
        "polynomial_lr_linear": run_torch(lambda o: tls.PolynomialLR(o, total_iters=40)),
        "constant_lr": run_torch(lambda o: tls.ConstantLR(o, factor=0.5, total_iters=40)),
        "linear_lr": run_torch(lambda o: tls.LinearLR(o, start_factor=0.25, end_factor=1.0, total_iters=40)),
        "exponential": run_torch(lambda o: tls.ExponentialLR(o, gamma=0.98)),
        "step": run_torch(lambda o: tls.StepLR(o, step_size=30, gamma=0.5)),
        "multistep": run_torch(lambda o: tls.MultiStepLR(o, milestones=[50, 120, 120, 200], gamma=0.3)),
        "one_cycle": run_torch(lambda o: tls.OneCycleLR(o, max_lr=BASES, total_steps=N), n=N),
        "one_cycle_three_phase_linear": run_torch(
            lambda o: tls.OneCycleLR(o, max_lr=BASES, total_steps=350, pct_start=0.25, anneal_strategy="linear",
                                     div_factor=10.0, final_div_factor=100.0, three_phase=True), n=350),
        # diffusers
        "constant": run_torch(lambda o: get_scheduler("constant", o)),
        "constant_with_warmup": run_torch(lambda o: get_constant_schedule_with_warmup(o, 25)),
        "linear": run_torch(lambda o: get_scheduler("linear", o, num_warmup_steps=30, num_training_steps=300)),
        "linear_f": run_torch(lambda o: get_linear_schedule_with_warmup(o, 30, 300, f_min=0.1, f_max=0.9)),
        "cosine": run_torch(lambda o: get_scheduler("cosine", o, num_warmup_steps=30, num_training_steps=300)),
        "cosine_cycles": run_torch(lambda o: get_cosine_schedule_with_warmup(o, 20, 300, num_cycles=1.5)),
        "cosine_with_restarts": run_torch(
            lambda o: get_cosine_with_hard_restarts_schedule_with_warmup(o, 20, 300, num_cycles=3)),
        "polynomial": run_torch(
            lambda o: get_polynomial_decay_schedule_with_warmup(o, 20, 300, lr_end=1e-4, power=2.0)),
        "polynomial_by_name": run_torch(
            lambda o: get_scheduler("polynomial", o, num_warmup_steps=10, num_training_steps=250, power=3.0)),
        "piecewise_constant": run_torch(lambda o: get_scheduler("piecewise_constant", o,
                                                                step_rules="1:10,0.1:20,0.01:30,0.005")),
        # timm
        "timm_cosine": run_timm(lambda o: CosineLRScheduler(
            o, t_initial=100, lr_min=1e-4, cycle_mul=1.5, cycle_decay=0.7, cycle_limit=3, warmup_t=10,
            warmup_lr_init=1e-5, k_decay=1.2)),
        "timm_cosine_prefix": run_timm(lambda o: CosineLRScheduler(
            o, t_initial=90, lr_min=1e-5, cycle_decay=0.5, cycle_limit=4, warmup_t=15, warmup_lr_init=1e-4,
            warmup_prefix=True)),
        "timm_tanh": run_timm(lambda o: TanhLRScheduler(
            o, t_initial=120, lr_min=1e-5, cycle_limit=3, cycle_decay=0.8, warmup_t=12, warmup_lr_init=1e-4)),
        "timm_tanh_prefix": run_timm(lambda o: TanhLRScheduler(
            o, t_initial=100, lb=-6.0, ub=4.0, cycle_mul=2.0, cycle_limit=2, warmup_t=10, warmup_prefix=True)),
        "timm_poly": run_timm(lambda o: PolyLRScheduler(
            o, t_initial=150, power=2.0, lr_min=1e-5, cycle_limit=2, cycle_decay=0.5, warmup_t=8, k_decay=0.8)),
        "timm_step": run_timm(lambda o: StepLRScheduler(o, decay_t=30, decay_rate=0.5, warmup_t=5,
                                                        warmup_lr_init=1e-4)),
        "timm_multistep": run_timm(lambda o: MultiStepLRScheduler(o, decay_t=[40, 90, 150], decay_rate=0.5,
                                                                  warmup_t=5, warmup_lr_init=1e-4)),
        "timm_wsd": run_timm(lambda o: WSDLRScheduler(o, t_initial=300, decay_t=60, lr_min=1e-5, warmup_t=20,
                                                      warmup_lr_init=1e-6)),
        "timm_wsd_rsqrt_cosine": run_timm(lambda o: WSDLRScheduler(
            o, t_initial=300, decay_t=100, stable_fn="rsqrt", decay_fn="cosine", warmup_t=25)),
        "timm_wsd_power_exp": run_timm(lambda o: WSDLRScheduler(
            o, t_initial=250, decay_t=80, stable_fn="power", stable_power=0.3, stable_timescale=40.0,
            decay_fn="exp", decay_ratio=0.05)),
        # pytorch-warmup, as DALLE2's trainers use it
        "linear_warmup+cosine_annealing": run_warmup(
            lambda o: tls.CosineAnnealingLR(o, T_max=300), lambda o: pytorch_warmup.LinearWarmup(o, 30)),
        "exponential_warmup+constant": run_warmup(
            lambda o: tls.LambdaLR(o, lambda _: 1.0), lambda o: pytorch_warmup.ExponentialWarmup(o, 20)),
        "untuned_linear_warmup+constant": run_warmup(
            lambda o: tls.LambdaLR(o, lambda _: 1.0), lambda o: pytorch_warmup.UntunedLinearWarmup(o),
            kind="adam", betas=(0.9, 0.99)),
        "untuned_exponential_warmup+exponential": run_warmup(
            lambda o: tls.ExponentialLR(o, gamma=0.995), lambda o: pytorch_warmup.UntunedExponentialWarmup(o),
            kind="adam", betas=(0.9, 0.99)),
        "radam_warmup+step": run_warmup(
            lambda o: tls.StepLR(o, step_size=100, gamma=0.5), lambda o: pytorch_warmup.RAdamWarmup(o),
            kind="adam", betas=(0.9, 0.999)),
        # pytorch-warmup with a period or β₂ per parameter group
        "linear_warmup_per_group+cosine_annealing": run_warmup(
            lambda o: tls.CosineAnnealingLR(o, T_max=300), lambda o: pytorch_warmup.LinearWarmup(o, [30, 75])),
        "exponential_warmup_per_group+constant": run_warmup(
            lambda o: tls.LambdaLR(o, lambda _: 1.0), lambda o: pytorch_warmup.ExponentialWarmup(o, [50, 12])),
        "untuned_linear_warmup_per_group+constant": run_warmup(
            lambda o: tls.LambdaLR(o, lambda _: 1.0), lambda o: pytorch_warmup.UntunedLinearWarmup(o),
            kind="adam", group_beta2s=[0.99, 0.995]),
        "untuned_exponential_warmup_per_group+exponential": run_warmup(
            lambda o: tls.ExponentialLR(o, gamma=0.995), lambda o: pytorch_warmup.UntunedExponentialWarmup(o),
            kind="adam", group_beta2s=[0.98, 0.995]),
        "radam_warmup_per_group+step": run_warmup(
            lambda o: tls.StepLR(o, step_size=100, gamma=0.5), lambda o: pytorch_warmup.RAdamWarmup(o),
            kind="adam", group_beta2s=[0.999, 0.99]),
        # CogVideoX
        "warmup_cosine": run_torch(lambda_lr(LambdaWarmUpCosineScheduler(50, 0.01, 1.0, 0.001, 300))),
        "warmup_cosine_cycles": run_torch(lambda_lr(LambdaWarmUpCosineScheduler2(
            [20, 10, 0], [0.1, 0.05, 0.01], [1.0, 0.8, 0.5], [0.0, 0.1, 0.5], [150, 120, 200])), n=N),
        "warmup_linear_cycles": run_torch(lambda_lr(LambdaLinearScheduler(
            [25, 10], [0.0, 0.1], [1.0, 0.6], [0.01, 0.2], [200, 200]))),
        # the web UI's step strings
        "step_string": run_step_string("0.005:100, 1e-5:250, 1e-6", 380),
        "step_string_resumed": run_step_string("0.005:100, 1e-5:250, 1e-6:300, 1e-7", 380, start_step=150),
        "step_string_accumulated": run_step_string("0.1:10, 0.01:10, 0.001:11, 1e-4:30, 5e-5", 380, consults=3),
        "step_string_minus_one": run_step_string("0.02:50, 0.001:-1, 0.5:9999", 380),
        "step_string_past_max": run_step_string("0.3:20, 0.2:1000, 0.1", 300),
    }
    (out / "schedule.json").write_text(json.dumps({
        "bases": BASES, "cases": cases, "plateau": plateau_case(),
    }))
