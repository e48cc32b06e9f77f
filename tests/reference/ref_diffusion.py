"""Golden values from diffusers' schedulers and training utilities: noise-schedule tables, add_noise,
get_velocity, compute_snr, min-SNR weights, SD3 weighting, timestep densities, DREAM, classifier-free
guidance with rescale, and whole sampling runs of DDPM, DDIM and flow-matching Euler where every
step's output is recorded. The "model" is a fixed function of (sample, t), the same in the C++ test.
"""
import json
import math
import warnings

import numpy as np
import torch
from diffusers import (DDIMScheduler, DDPMScheduler, DPMSolverMultistepScheduler, EulerDiscreteScheduler,
                       FlowMatchEulerDiscreteScheduler)
from diffusers.training_utils import (compute_density_for_timestep_sampling, compute_dream_and_update_latents,
                                      compute_loss_weighting_for_sd3, compute_snr)


def fake_model(x, t):
    return 0.5 * torch.tanh(x) + float(t) * 1e-4


def flat(t):
    return t.detach().double().flatten().tolist()


def initial_sample():
    return torch.linspace(-1.5, 1.5, 2 * 3 * 4 * 4, dtype=torch.float32).reshape(2, 3, 4, 4).sin() * 1.3


def run_sampler(sched, steps, seed, use_generator=True, **step_kwargs):
    sched.set_timesteps(steps)
    x = initial_sample()
    g = torch.Generator().manual_seed(seed)
    trace = []
    for t in sched.timesteps:
        out = fake_model(x, t)
        kwargs = dict(step_kwargs)
        if use_generator:
            kwargs["generator"] = g
        x = sched.step(out, t, x, **kwargs).prev_sample
        trace.append(flat(x))
    return {"timesteps": [float(t) for t in sched.timesteps], "trace": trace}


def run_euler(sched, steps):
    sched.set_timesteps(steps)
    x = initial_sample()
    trace = []
    for t in sched.timesteps:
        out = fake_model(sched.scale_model_input(x, t), t)
        x = sched.step(out, t, x).prev_sample
        trace.append(flat(x))
    return {"timesteps": [float(t) for t in sched.timesteps], "sigmas": flat(sched.sigmas), "trace": trace,
            "init_noise_sigma": float(sched.init_noise_sigma)}


def generate(out):
    warnings.filterwarnings("ignore")
    tables = {}
    for name in ["linear", "scaled_linear", "squaredcos_cap_v2", "sigmoid"]:
        for rescale in [False, True]:
            s = DDPMScheduler(beta_schedule=name, rescale_betas_zero_snr=rescale, beta_start=0.00085, beta_end=0.012)
            tables[f"{name}/{rescale}"] = {"betas": flat(s.betas), "alphas_cumprod": flat(s.alphas_cumprod)}

    sched = DDPMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012)
    x0 = initial_sample()
    noise = torch.cos(torch.arange(x0.numel(), dtype=torch.float32)).reshape(x0.shape)
    timesteps = torch.tensor([3, 999], dtype=torch.long)
    snr = compute_snr(sched, torch.tensor([0, 1, 10, 250, 500, 999]))
    min_snr = {}
    for gamma in [1.0, 5.0]:
        snr_t = compute_snr(sched, torch.tensor([0, 10, 500, 999]))
        w = torch.stack([snr_t, gamma * torch.ones_like(snr_t)], dim=1).min(dim=1)[0]
        min_snr[f"epsilon/{gamma}"] = flat(w / snr_t)
        min_snr[f"v_prediction/{gamma}"] = flat(w / (snr_t + 1))
    sigmas = torch.tensor([0.05, 0.3, 0.7, 0.99])
    density = {
        "uniform": flat(compute_density_for_timestep_sampling("uniform", 6, generator=torch.Generator().manual_seed(3))),
        "logit_normal": flat(compute_density_for_timestep_sampling(
            "logit_normal", 6, logit_mean=0.2, logit_std=1.1, generator=torch.Generator().manual_seed(4))),
        "mode": flat(compute_density_for_timestep_sampling("mode", 6, mode_scale=1.29,
                                                           generator=torch.Generator().manual_seed(5))),
    }

    class FakeUnet:
        def __call__(self, noisy, t, encoder_hidden_states):
            class Out:
                sample = 0.3 * noisy + t.float().reshape(-1, 1, 1, 1) * 1e-4
            return Out()

    noisy = sched.add_noise(x0, noise, timesteps)
    target = noise.clone()
    dream_noisy, dream_target = compute_dream_and_update_latents(
        FakeUnet(), sched, timesteps, noise, noisy, target, None, dream_detail_preservation=0.8)

    cond = initial_sample() * 0.7 + 0.1
    uncond = initial_sample() * -0.2
    cfg = uncond + 7.5 * (cond - uncond)
    std_text = cond.std(dim=list(range(1, cond.ndim)), keepdim=True)
    std_cfg = cfg.std(dim=list(range(1, cfg.ndim)), keepdim=True)
    rescaled = 0.7 * (cfg * (std_text / std_cfg)) + 0.3 * cfg

    samplers = {
        "ddpm_eps_leading": run_sampler(DDPMScheduler(beta_schedule="scaled_linear", beta_start=0.00085,
                                                      beta_end=0.012), 25, seed=11),
        "ddpm_v_trailing_large": run_sampler(DDPMScheduler(prediction_type="v_prediction", timestep_spacing="trailing",
                                                           variance_type="fixed_large", clip_sample=False), 20, seed=12),
        "ddim_eps_leading": run_sampler(DDIMScheduler(beta_schedule="scaled_linear", beta_start=0.00085,
                                                      beta_end=0.012, clip_sample=False, set_alpha_to_one=False,
                                                      steps_offset=1), 50, seed=0, use_generator=False),
        "ddim_v_trailing_eta": run_sampler(DDIMScheduler(prediction_type="v_prediction", timestep_spacing="trailing",
                                                         rescale_betas_zero_snr=True), 30, seed=13, eta=0.5),
        "ddim_sample_linspace_threshold": run_sampler(DDIMScheduler(prediction_type="sample", timestep_spacing="linspace",
                                                                    thresholding=True, sample_max_value=1.2), 15, seed=0,
                                                      use_generator=False),
        "euler_eps_linspace": run_euler(EulerDiscreteScheduler(beta_schedule="scaled_linear", beta_start=0.00085,
                                                               beta_end=0.012), 30),
        "euler_v_karras_leading": run_euler(EulerDiscreteScheduler(prediction_type="v_prediction", use_karras_sigmas=True,
                                                                   timestep_spacing="leading", steps_offset=1), 25),
        "dpm_eps_20": run_sampler(DPMSolverMultistepScheduler(beta_schedule="scaled_linear", beta_start=0.00085,
                                                              beta_end=0.012), 20, seed=0, use_generator=False),
        "dpm_v_karras_12": run_sampler(DPMSolverMultistepScheduler(prediction_type="v_prediction",
                                                                   use_karras_sigmas=True), 12, seed=0,
                                       use_generator=False),
        "flow_match_shift3": run_sampler(FlowMatchEulerDiscreteScheduler(shift=3.0), 28, seed=0, use_generator=False),
    }
    fm = FlowMatchEulerDiscreteScheduler(shift=3.0)
    indices = torch.tensor([0, 10, 500, 999])
    flow = {"sigmas": flat(fm.sigmas[indices]), "timesteps": flat(fm.timesteps[indices])}

    (out / "diffusion.json").write_text(json.dumps({
        "tables": tables, "x0": flat(x0), "noise": flat(noise), "timesteps": timesteps.tolist(),
        "add_noise": flat(noisy), "velocity": flat(sched.get_velocity(x0, noise, timesteps)),
        "snr": flat(snr), "min_snr": min_snr,
        "sd3": {"sigma_sqrt": flat(compute_loss_weighting_for_sd3("sigma_sqrt", sigmas)),
                "cosmap": flat(compute_loss_weighting_for_sd3("cosmap", sigmas))},
        "density": density, "dream": {"noisy": flat(dream_noisy), "target": flat(dream_target)},
        "cfg": {"cond": flat(cond), "uncond": flat(uncond), "plain": flat(cfg), "rescaled": flat(rescaled)},
        "samplers": samplers, "flow": flow,
    }))
