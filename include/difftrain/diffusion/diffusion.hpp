#pragma once
// Umbrella header of the diffusion layer.

#include "difftrain/diffusion/cogvideox_ddim.hpp"
#include "difftrain/diffusion/cogvideox_dpm.hpp"
#include "difftrain/diffusion/ddim.hpp"
#include "difftrain/diffusion/ddpm.hpp"
#include "difftrain/diffusion/dpm_solver.hpp"
#include "difftrain/diffusion/euler.hpp"
#include "difftrain/diffusion/flow_matching.hpp"
#include "difftrain/diffusion/guidance.hpp"
#include "difftrain/diffusion/heun.hpp"
#include "difftrain/diffusion/noise_schedule.hpp"
#include "difftrain/diffusion/sample.hpp"
#include "difftrain/diffusion/sampler_common.hpp"
#include "difftrain/diffusion/weighting.hpp"
