/* The respaced DDPM schedule of the MAR diffusion head (mar.md 6.1-6.3):
 * cosine base schedule with 1000 steps, respaced to `n_steps`, every table
 * built in float64. */
#ifndef MC_DIFFUSION_H
#define MC_DIFFUSION_H

#include <stdint.h>

#include "../backend/ops.h"

#define MC_DIFFUSION_BASE_STEPS 1000
#define MC_DIFFUSION_MAX_STEPS 1000

typedef struct mc_diffusion {
    int n_steps;
    int32_t timesteps[MC_DIFFUSION_MAX_STEPS]; /* tau_j, the index the network sees */
    double betas[MC_DIFFUSION_MAX_STEPS];
    double alphas_cumprod[MC_DIFFUSION_MAX_STEPS];
    double sqrt_recip_alphas_cumprod[MC_DIFFUSION_MAX_STEPS];
    double sqrt_recipm1_alphas_cumprod[MC_DIFFUSION_MAX_STEPS];
    double posterior_variance[MC_DIFFUSION_MAX_STEPS];
    double posterior_log_variance_clipped[MC_DIFFUSION_MAX_STEPS];
    double posterior_mean_coef1[MC_DIFFUSION_MAX_STEPS];
    double posterior_mean_coef2[MC_DIFFUSION_MAX_STEPS];
    double log_betas[MC_DIFFUSION_MAX_STEPS];
} mc_diffusion;

/* n_steps in [1, 1000] ("100" in every released config). */
mc_status mc_diffusion_init(mc_diffusion *d, int n_steps, mc_err *err);

/* The same respacing with DiSA's clip of the kept timesteps (disa.md): every
 * kept timestep t becomes min(t, clip) and the kept set stays a set, so the
 * timesteps above `clip` collapse into one and d->n_steps may be smaller than
 * `n_steps` (50 steps, clip 950: 48). clip in [0, 999]; 999 clips nothing, and
 * mc_diffusion_init is this function with clip 999. */
mc_status mc_diffusion_init_clipped(mc_diffusion *d, int n_steps, int clip, mc_err *err);

/* The float32 coefficients of reverse step j with the given noise scale. */
mc_ddpm_coefs mc_diffusion_coefs(const mc_diffusion *d, int j, float noise_scale);

#endif
