"""Sweeps over the samplers' configuration spaces, against diffusers.

1. Timesteps of every spacing for every step count 1..N (N = 1000 and 999) for DDPM, DDIM, Euler
   and DPM-Solver++: stored as digests (count, first, last, sequential float64 sums of the values and
   of (i + 1)·value) so a C++ test can check all of them exactly and name the step count that differs.
   σ tables (Euler, DPM-Solver++) the same way, compared to 1e-6.
2. Every beta schedule x zero terminal SNR x prediction type x spacing (x Karras σ where offered), 10
   and 25 steps, for each sampler: the sample after the first and after the last step.
3. CogVideoX's DDIM and DPM schedulers over every beta schedule x zero terminal SNR x SNR shift
   (1, 3, 0.5) x prediction x spacing at 10 and 25 steps (DPM's second-order steps and its two noise
   draws per step from one generator): the ᾱ table, a digest of the sample after every step and
   the first and last samples.
"""
import inspect
import itertools
import json
import math
import warnings

import numpy as np
import torch
from diffusers import (CogVideoXDDIMScheduler, CogVideoXDPMScheduler, DDIMScheduler, DDPMScheduler, DPMSolverMultistepScheduler, EulerAncestralDiscreteScheduler,
                       EulerDiscreteScheduler, FlowMatchEulerDiscreteScheduler, HeunDiscreteScheduler)

SPACINGS = ["leading", "trailing", "linspace"]
PREDICTIONS = ["epsilon", "v_prediction", "sample"]


def digest(values):
    v = np.asarray(values, dtype=np.float64)
    idx = np.arange(1, len(v) + 1, dtype=np.float64)
    return [len(v), float(v[0]) if len(v) else 0.0, float(v[-1]) if len(v) else 0.0,
            float(np.cumsum(v)[-1]) if len(v) else 0.0, float(np.cumsum(v * idx)[-1]) if len(v) else 0.0]


def timestep_sweep():
    out = {}
    for N in (1000, 999):
        for spacing in SPACINGS:
            makers = {
                "ddpm": lambda: DDPMScheduler(num_train_timesteps=N, timestep_spacing=spacing, steps_offset=0),
                "ddim": lambda: DDIMScheduler(num_train_timesteps=N, timestep_spacing=spacing, steps_offset=0),
                "euler": lambda: EulerDiscreteScheduler(num_train_timesteps=N, timestep_spacing=spacing),
                "dpm": lambda: DPMSolverMultistepScheduler(num_train_timesteps=N, timestep_spacing=spacing),
            }
            for name, make in makers.items():
                s = make()
                ts, sig = [], []
                for n in range(1, N + 1):
                    s.set_timesteps(n)
                    t = s.timesteps.double().numpy()
                    sigmas = s.sigmas.double().numpy() if name in ("euler", "dpm") else None
                    if spacing == "trailing" and len(t) == n + 1:
                        # diffusers' extra trailing -1 (see sampler_common.hpp): the first n values
                        t = t[:n]
                        if sigmas is not None:
                            sigmas = np.concatenate([sigmas[:n], sigmas[-1:]])
                    ts.append(digest(t))
                    if sigmas is not None:
                        sig.append(digest(sigmas))
                out[f"{name}/{spacing}/{N}"] = {"timesteps": ts, "sigmas": sig}
    return out


def fake_model(x, t):
    return 0.5 * torch.tanh(x) + float(t) * 1e-4


def initial_sample():
    return torch.linspace(-1.5, 1.5, 2 * 3 * 4 * 4, dtype=torch.float32).reshape(2, 3, 4, 4).sin() * 1.3


def finite_json(values):
    # JSON has no NaN or infinity (zero terminal SNR with ε prediction divides by ᾱ = 0 in DDPM and
    # DDIM): they are written as the strings "nan", "inf" and "-inf".
    return [v if math.isfinite(v) else ("nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")) for v in values]


def run(sched, steps, seed, scaled=False, **step_kwargs):
    try:
        return run_unchecked(sched, steps, seed, scaled, **step_kwargs)
    except IndexError as e:  # diffusers' own failure (a repeated first timestep): nothing to compare
        return {"error": str(e)}


def run_unchecked(sched, steps, seed, scaled=False, **step_kwargs):
    sched.set_timesteps(steps)
    x = initial_sample()
    if scaled:
        x = x * sched.init_noise_sigma
    g = torch.Generator().manual_seed(seed)
    first = None
    for t in sched.timesteps:
        inp = sched.scale_model_input(x, t) if scaled else x
        kwargs = dict(step_kwargs)
        if "generator" in inspect.signature(sched.step).parameters:
            kwargs["generator"] = g
        x = sched.step(fake_model(inp, t), t, x, **kwargs).prev_sample
        if first is None:
            first = finite_json(x.double().flatten().tolist())
    return {"timesteps": [float(v) for v in sched.timesteps], "first": first,
            "last": finite_json(x.double().flatten().tolist())}


def sampler_sweep():
    # Explicit β range: the schedulers' defaults differ (Heun's linear is SD's 0.00085…0.012).
    betas = {"linear": {"beta_start": 0.0001, "beta_end": 0.02},
             "scaled_linear": {"beta_start": 0.00085, "beta_end": 0.012}, "squaredcos_cap_v2": {},
             "sigmoid": {"beta_start": 0.0001, "beta_end": 0.02}}  # sigmoid: DDPM only, as in diffusers
    out = {}
    for (beta, extra), snr, pred, spacing, steps in itertools.product(
            betas.items(), (False, True), PREDICTIONS, SPACINGS, (10, 25)):
        common = dict(beta_schedule=beta, rescale_betas_zero_snr=snr, prediction_type=pred, timestep_spacing=spacing,
                      **extra)
        key = f"{beta}/{snr}/{pred}/{spacing}/{steps}"
        out[f"ddpm/{key}"] = run(DDPMScheduler(clip_sample=False, **common), steps, seed=1)
        if beta == "sigmoid":
            continue
        out[f"ddim/{key}"] = run(DDIMScheduler(clip_sample=False, **common), steps, seed=2, eta=0.3)
        for karras in (False, True):
            out[f"euler/{key}/{karras}"] = run(EulerDiscreteScheduler(use_karras_sigmas=karras, **common), steps, 3,
                                               scaled=True)
        if not snr:  # diffusers' Heun has no zero-SNR rescale
            heun_common = {k: v for k, v in common.items() if k != "rescale_betas_zero_snr"}
            for karras in (False, True):
                out[f"heun/{key}/{karras}"] = run(HeunDiscreteScheduler(use_karras_sigmas=karras, **heun_common),
                                                  steps, 0, scaled=True)
        if pred != "sample":
            out[f"euler_ancestral/{key}"] = run(EulerAncestralDiscreteScheduler(**common), steps, 4, scaled=True)
        dpm_grid = [(k, o, "dpmsolver++") for k in (False, True) for o in (1, 2, 3)] + [
            (False, 2, "sde-dpmsolver++"), (True, 3, "sde-dpmsolver++")]
        for karras, order, algo in dpm_grid:
            out[f"dpm/{key}/{karras}/{order}/{algo}"] = run(DPMSolverMultistepScheduler(
                use_karras_sigmas=karras, solver_order=order, algorithm_type=algo, **common), steps, 5)
    # Options beyond the grid.
    for name, kwargs in {
        "sigma_min": dict(final_sigmas_type="sigma_min"),
        "euler_at_final": dict(euler_at_final=True, solver_order=3),
        "no_lower_order_final": dict(lower_order_final=False, solver_order=3),
        "heun": dict(solver_type="heun"),
        "heun_sde": dict(solver_type="heun", algorithm_type="sde-dpmsolver++"),
        # Third order with heun: heun changes only the second-order steps (warm-up, final).
        "heun_sde3": dict(solver_type="heun", algorithm_type="sde-dpmsolver++", solver_order=3),
        "lambda_clip": dict(beta_schedule="squaredcos_cap_v2", lambda_min_clipped=-5.1),
        "lambda_clip_trailing": dict(beta_schedule="squaredcos_cap_v2", lambda_min_clipped=-5.1,
                                     timestep_spacing="trailing"),
        "leading_offset": dict(timestep_spacing="leading", steps_offset=1),
        "thresholding": dict(thresholding=True, sample_max_value=1.1, prediction_type="sample"),
    }.items():
        for steps in (8, 20):
            out[f"dpm_option/{name}/{steps}"] = run(DPMSolverMultistepScheduler(**kwargs), steps, 6)
    for name, kwargs in {
        "churn": dict(s_churn=1.5, s_tmin=0.2, s_tmax=8.0),
        "churn_noise": dict(s_churn=40.0, s_noise=1.003),
    }.items():
        for steps in (10, 30):
            out[f"euler_churn/{name}/{steps}"] = run(EulerDiscreteScheduler(), steps, 7, scaled=True, **kwargs)
    out["euler_option/sigma_min/12"] = run(EulerDiscreteScheduler(final_sigmas_type="sigma_min"), 12, 8, scaled=True)
    return out


def flow_matching():
    out = {}
    configs = {
        "shift1": (dict(), None), "shift3": (dict(shift=3.0), None), "shift0.7": (dict(shift=0.7), None),
        "terminal": (dict(shift=3.0, shift_terminal=0.1), None),
        "dynamic_exp": (dict(use_dynamic_shifting=True), 1.15),
        "dynamic_exp_low": (dict(use_dynamic_shifting=True), 0.3),
        "dynamic_linear": (dict(use_dynamic_shifting=True, time_shift_type="linear"), 2.5),
        "dynamic_terminal": (dict(use_dynamic_shifting=True, shift_terminal=0.02), 0.9),
        "n999": (dict(num_train_timesteps=999, shift=2.0), None),
        # FluxPipeline's σ's, given: linspace(1, 1/n, n), shifted by μ
        "given_flux": (dict(use_dynamic_shifting=True), 0.8),
        "given_shift3": (dict(shift=3.0), None),
    }
    for name, (kw, mu) in configs.items():
        for steps in (1, 4, 28, 50):
            if steps == 1 and "shift_terminal" in kw:
                continue  # diffusers divides 0 by 0 (one σ, 1 − σ = 0): NaN; difftrain refuses it
            s = FlowMatchEulerDiscreteScheduler(**kw)
            if name.startswith("given"):
                s.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
            else:
                s.set_timesteps(steps, mu=mu) if mu is not None else s.set_timesteps(steps)
            x = initial_sample()
            trace = []
            for t in s.timesteps:
                x = s.step(fake_model(x, t), t, x).prev_sample
                trace.append(x.double().flatten().tolist())
            out[f"{name}/{steps}"] = {"timesteps": s.timesteps.double().tolist(), "sigmas": s.sigmas.double().tolist(),
                                      "first": trace[0], "last": trace[-1], "mu": mu}
    return out


def cogvideox_run(sched, steps, seed):
    """The CogVideoX pipeline's loop: the DPM scheduler takes the previous x̂₀ and timestep."""
    sched.set_timesteps(steps)
    x = initial_sample()
    g = torch.Generator().manual_seed(seed)
    old = None
    trace = []
    ts = sched.timesteps
    for i, t in enumerate(ts):
        out = fake_model(x, t)
        if isinstance(sched, CogVideoXDPMScheduler):
            x, old = sched.step(out, old, t, ts[i - 1] if i > 0 else None, x, generator=g,
                                return_dict=False)
        else:
            x = sched.step(out, t, x).prev_sample
        v = x.double().flatten()
        if i == 0:
            first = finite_json(v.tolist())
        # Every step as a digest (its sum, its absolute sum and three values) to name the first
        # step that differs; the first and the last sample whole.
        trace.append(finite_json([v.sum().item(), v.abs().sum().item(), v[0].item(), v[37].item(),
                                  v[-1].item()]))
    return {"timesteps": [int(v) for v in ts], "trace": trace, "first": first,
            "last": finite_json(x.double().flatten().tolist())}


def cogvideox():
    betas = {"linear": {"beta_start": 0.0001, "beta_end": 0.02},
             "scaled_linear": {"beta_start": 0.00085, "beta_end": 0.012}, "squaredcos_cap_v2": {}}
    out = {"tables": {}, "runs": {}}
    for (beta, extra), snr, shift in itertools.product(betas.items(), (False, True), (1.0, 3.0, 0.5)):
        common = dict(beta_schedule=beta, rescale_betas_zero_snr=snr, snr_shift_scale=shift, **extra)
        table = CogVideoXDDIMScheduler(**common).alphas_cumprod
        out["tables"][f"{beta}/{snr}/{shift}"] = table.double().tolist()
        for pred, spacing, steps in itertools.product(PREDICTIONS, SPACINGS, (10, 25)):
            key = f"{beta}/{snr}/{shift}/{pred}/{spacing}/{steps}"
            kw = dict(common, prediction_type=pred, timestep_spacing=spacing)
            out["runs"][f"ddim/{key}"] = cogvideox_run(CogVideoXDDIMScheduler(**kw), steps, 0)
            out["runs"][f"dpm/{key}"] = cogvideox_run(CogVideoXDPMScheduler(**kw), steps, 11)
    # CogVideoX-2B's own scheduler config (and set_alpha_to_one false, steps_offset 1).
    for name, kw in {"cogvideox_2b": dict(prediction_type="v_prediction", rescale_betas_zero_snr=True,
                                          timestep_spacing="trailing", snr_shift_scale=3.0),
                     "final_alpha": dict(set_alpha_to_one=False, steps_offset=1,
                                         prediction_type="v_prediction")}.items():
        out["runs"][f"ddim_option/{name}/50"] = cogvideox_run(CogVideoXDDIMScheduler(**kw), 50, 0)
        out["runs"][f"dpm_option/{name}/50"] = cogvideox_run(CogVideoXDPMScheduler(**kw), 50, 12)
    return out


def cogvideox_loss():
    """CogVideoX's training loss as diffusers' train_cogvideox_lora.py computes it (v-prediction),
    on the schedules CogVideoX's configs use (SNR shift 1 and 3, zero terminal SNR or not), with
    timesteps at both ends and between."""
    g = torch.Generator().manual_seed(21)
    cases = []
    for snr, shift in itertools.product((False, True), (1.0, 3.0)):
        sched = CogVideoXDPMScheduler(beta_schedule="scaled_linear", beta_start=0.00085,
                                      beta_end=0.012, rescale_betas_zero_snr=snr,
                                      snr_shift_scale=shift, prediction_type="v_prediction")
        latents = torch.randn(3, 3, 4, 2, 2, generator=g)   # (B, F, C, h, w)
        noise = torch.randn(latents.shape, generator=g)
        output = torch.randn(latents.shape, generator=g)
        timesteps = torch.tensor([0, 531, 999])
        noisy = sched.add_noise(latents, noise, timesteps)
        model_pred = sched.get_velocity(output, noisy, timesteps)
        weights = 1 / (1 - sched.alphas_cumprod[timesteps])
        while len(weights.shape) < len(model_pred.shape):
            weights = weights.unsqueeze(-1)
        loss = torch.mean((weights * (model_pred - latents) ** 2).reshape(3, -1), dim=1).mean()
        cases.append({"zero_snr": snr, "snr_shift_scale": shift,
                      "latents": latents.flatten().tolist(), "noise": noise.flatten().tolist(),
                      "output": output.flatten().tolist(), "timesteps": timesteps.tolist(),
                      "noisy": noisy.flatten().tolist(), "loss": loss.item()})
    return cases


def ddpm_learned():
    out = {}
    for variance in ("learned", "learned_range"):
        s = DDPMScheduler(variance_type=variance, clip_sample=False)
        s.set_timesteps(12)
        x = initial_sample()
        g = torch.Generator().manual_seed(9)
        trace = []
        for t in s.timesteps:
            eps = fake_model(x, t)
            var = (torch.cos(x * 3.0) * 0.9) if variance == "learned_range" else (0.01 + 0.02 * torch.sigmoid(x))
            x = s.step(torch.cat([eps, var], dim=1), t, x, generator=g).prev_sample
            trace.append(x.double().flatten().tolist())
        out[variance] = {"timesteps": s.timesteps.tolist(), "trace": trace}
    return out


def generate(out):
    warnings.filterwarnings("ignore")
    ts = timestep_sweep()
    sw = sampler_sweep()
    (out / "sampler_sweeps.json").write_text(json.dumps({
        "timesteps": ts, "samplers": sw, "ddpm_learned": ddpm_learned(), "flow": flow_matching(),
        "cogvideox": cogvideox(), "cogvideox_loss": cogvideox_loss()},
        allow_nan=False))
