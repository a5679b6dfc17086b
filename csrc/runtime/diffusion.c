#include "diffusion.h"

#include <math.h>

static double cosine_alpha_bar(double t) {
    double c = cos((t + 0.008) / 1.008 * 3.14159265358979323846 / 2.0);
    return c * c;
}

mc_status mc_diffusion_init(mc_diffusion *d, int n_steps, mc_err *err) {
    return mc_diffusion_init_clipped(d, n_steps, MC_DIFFUSION_BASE_STEPS - 1, err);
}

mc_status mc_diffusion_init_clipped(mc_diffusion *d, int n_steps, int clip, mc_err *err) {
    if (n_steps < 1 || n_steps > MC_DIFFUSION_MAX_STEPS)
        return mc_fail(err, MC_ERR_VALUE, "diffusion_steps must be in 1..%d, got %d",
                       MC_DIFFUSION_MAX_STEPS, n_steps);
    if (clip < 0 || clip > MC_DIFFUSION_BASE_STEPS - 1)
        return mc_fail(err, MC_ERR_VALUE, "clip must be in 0..%d, got %d", MC_DIFFUSION_BASE_STEPS - 1, clip);
    const int T = MC_DIFFUSION_BASE_STEPS;
    double base_cumprod[MC_DIFFUSION_BASE_STEPS];
    double running = 1.0;
    for (int i = 0; i < T; i++) {
        double beta = 1.0 - cosine_alpha_bar((double)(i + 1) / T) / cosine_alpha_bar((double)i / T);
        if (beta > 0.999)
            beta = 0.999;
        running *= 1.0 - beta;
        base_cumprod[i] = running;
    }
    /* space_timesteps(1000, "n"): Python round (half to even, which is
     * nearbyint's default mode) of a repeatedly incremented float. */
    double stride = n_steps > 1 ? (double)(T - 1) / (double)(n_steps - 1) : 1.0;
    double cursor = 0.0;
    int kept = 0;
    for (int j = 0; j < n_steps; j++) {
        int32_t t = (int32_t)nearbyint(cursor);
        cursor += stride;
        /* The timesteps rise with j, so clipped duplicates are adjacent. */
        if (t > clip)
            t = (int32_t)clip;
        if (kept == 0 || d->timesteps[kept - 1] != t)
            d->timesteps[kept++] = t;
    }
    n_steps = kept;
    d->n_steps = n_steps;
    double last = 1.0;
    for (int j = 0; j < n_steps; j++) {
        double ac = base_cumprod[d->timesteps[j]];
        d->betas[j] = 1.0 - ac / last;
        last = ac;
    }
    running = 1.0;
    for (int j = 0; j < n_steps; j++) {
        running *= 1.0 - d->betas[j];
        d->alphas_cumprod[j] = running;
    }
    for (int j = 0; j < n_steps; j++) {
        double ac = d->alphas_cumprod[j];
        double ac_prev = j == 0 ? 1.0 : d->alphas_cumprod[j - 1];
        d->sqrt_recip_alphas_cumprod[j] = sqrt(1.0 / ac);
        d->sqrt_recipm1_alphas_cumprod[j] = sqrt(1.0 / ac - 1.0);
        d->posterior_variance[j] = d->betas[j] * (1.0 - ac_prev) / (1.0 - ac);
        d->posterior_mean_coef1[j] = d->betas[j] * sqrt(ac_prev) / (1.0 - ac);
        d->posterior_mean_coef2[j] = (1.0 - ac_prev) * sqrt(1.0 - d->betas[j]) / (1.0 - ac);
        d->log_betas[j] = log(d->betas[j]);
    }
    for (int j = 0; j < n_steps; j++) {
        int src = (j == 0 && n_steps > 1) ? 1 : j;
        d->posterior_log_variance_clipped[j] = log(d->posterior_variance[src]);
    }
    return MC_OK;
}

mc_ddpm_coefs mc_diffusion_coefs(const mc_diffusion *d, int j, float noise_scale) {
    mc_ddpm_coefs c = {
        .sqrt_recip_alphas_cumprod = (float)d->sqrt_recip_alphas_cumprod[j],
        .sqrt_recipm1_alphas_cumprod = (float)d->sqrt_recipm1_alphas_cumprod[j],
        .posterior_mean_coef1 = (float)d->posterior_mean_coef1[j],
        .posterior_mean_coef2 = (float)d->posterior_mean_coef2[j],
        .log_beta = (float)d->log_betas[j],
        .posterior_log_variance = (float)d->posterior_log_variance_clipped[j],
        .noise_scale = noise_scale,
    };
    return c;
}
