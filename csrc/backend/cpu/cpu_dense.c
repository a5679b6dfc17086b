/* Row-wise CPU ops. Each keeps the plain loop as its reference form; the
 * loops are written so GCC vectorises them and OpenMP splits rows. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../../core/philox.h"
#include "../op_checks.h"
#include "../sampling_inline.h"
#include "cpu_internal.h"

/* The tanh approximation in float32, the operation order of PyTorch's
 * gelu(approximate='tanh'): inner = sqrt(2/pi) * (x + 0.044715 * x^3). */
float mc_gelu_tanh(float x) {
    const float cube = x * x * x;
    const float inner = 0.79788456080286535588f * (x + 0.044715f * cube);
    return 0.5f * x * (1.0f + tanhf(inner));
}

mc_status mc_cpu_gemm(mc_backend *be, int trans_a, int trans_b, int64_t m, int64_t n, int64_t k,
                      float alpha, const float *a, int64_t lda, const float *b, int64_t ldb,
                      float beta, float *c, int64_t ldc, mc_err *err) {
    (void)be;
    (void)err;
    mc_cpu_sgemm(mc_cpu_threads(be), mc_cpu_gemm_split_of(be),
                 trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return MC_OK;
}

static void apply_act_rows(mc_backend *be, mc_act act, float *y, int64_t ldy, int64_t rows, int64_t dim) {
    if (act == MC_ACT_NONE)
        return;
    const mc_cpu_isa isa = mc_cpu_isa_of(be);
#pragma omp parallel for schedule(static) num_threads(mc_cpu_threads(be)) if (rows * dim >= MC_PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        float *row = y + r * ldy;
        if (act == MC_ACT_GELU)
            mc_cpu_gelu_erf_array(isa, row, row, dim); /* the bits of mc_gelu_erf */
        else if (act == MC_ACT_GELU_TANH)
            for (int64_t i = 0; i < dim; i++)
                row[i] = mc_gelu_tanh(row[i]);
        else
            mc_cpu_silu_array(isa, row, row, dim); /* the bits of mc_silu */
    }
}

/* Scratch slots of linear: the widened 16-bit operands, or the small-row
 * path's packed x (no op keeps scratch across calls, so these may overlap
 * other ops' slots). */
#define MC_LINEAR_W_SLOT 0
#define MC_LINEAR_X_SLOT 1

/* The float32 values of a 16-bit weight, and x rounded to the same type:
 * the arithmetic the CUDA backend's 16-bit GEMM does, with products summed
 * in float32. This widens the whole matrix on every call, so it serves
 * only calls with more rows than the small-row path takes (where sgemm's
 * arithmetic dominates the widening); with few rows 16-bit weights go
 * through the small-row kernel, which widens in registers. */
static mc_status widen_linear_operands(mc_backend *be, const float *x, int64_t ldx, int64_t rows,
                                       int64_t in, const void *w, int64_t out, const float **x_used,
                                       const float **w_used, mc_err *err) {
    const mc_wtype wt = be->linear_wtype;
    float *wf = mc_cpu_scratch(be, MC_LINEAR_W_SLOT, (size_t)(out * in), "a 16-bit linear weight widened", err);
    float *xf = mc_cpu_scratch(be, MC_LINEAR_X_SLOT, (size_t)(rows * in), "a 16-bit linear's rounded input", err);
    if (wf == NULL || xf == NULL)
        return err->status;
    const uint16_t *wh = w;
    const int threads = mc_cpu_threads(be);
#pragma omp parallel for schedule(static) num_threads(threads) if (out * in >= MC_PARALLEL_MIN_ELEMS)
    for (int64_t i = 0; i < out * in; i++)
        wf[i] = mc_wtype_unpack(wt, wh[i]);
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * in >= MC_PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < in; i++)
            xf[r * in + i] = mc_wtype_round(wt, x[r * ldx + i]);
    *x_used = xf;
    *w_used = wf;
    return MC_OK;
}

/* The packed x of both small-row paths is sized for the most rows either
 * takes, not for this call's rows: the scratch then reaches its size at the
 * first call of each input width, and a later run with other row counts
 * (another CFG, batch or scale) never grows it inside the loop
 * (test_var_generate checks). */
static size_t smallrow_x_floats(mc_backend *be, int64_t in) {
    const int panel_max = mc_cpu_panel_max(be), smallrow_max = mc_cpu_smallrow_max(be);
    return (size_t)((panel_max > smallrow_max ? panel_max : smallrow_max) * mc_smallrow_ldxp(in));
}

int mc_cpu_linear_takes_small_rows(mc_backend *be, const void *w, int64_t rows, int64_t in, int64_t out) {
    const float *panels = NULL;
    if (rows <= mc_cpu_panel_max(be) && mc_cpu_panels_for(be, w, out, in, 0, &panels, NULL) == 1)
        return 1;
    return rows <= mc_cpu_smallrow_max(be);
}

mc_status mc_cpu_linear_plan_of(mc_backend *be, const float *x, int64_t ldx, int64_t rows, int64_t in,
                                const void *w, const float *bias, int64_t out, mc_act act, float beta, float *y,
                                int64_t ldy, mc_linear_plan *plan, mc_err *err) {
    plan->path = MC_LINEAR_BLAS;
    plan->isa = mc_cpu_isa_of(be);
    const int64_t ldxp = mc_smallrow_ldxp(in);
    if (rows <= mc_cpu_panel_max(be)) {
        /* A bound fp32 weight: its column panels (cpu_panels.c), made at
         * load (again here after a write into the weight dropped them); the
         * plain ISA reads W itself. The run transposes x into xt's blocks. */
        const float *panels = NULL;
        const int panel_order = mc_cpu_panels_for(be, w, out, in, plan->isa != MC_CPU_ISA_PLAIN, &panels, err);
        if (panel_order < 0)
            return err->status;
        if (panel_order) {
            float *xt = NULL;
            if (plan->isa != MC_CPU_ISA_PLAIN) {
                xt = mc_cpu_scratch(be, MC_LINEAR_X_SLOT, smallrow_x_floats(be, in),
                                    "the small-row linear's transposed input", err);
                if (xt == NULL)
                    return err->status;
            }
            plan->path = MC_LINEAR_PANELS;
            plan->panel = (mc_panel_job){.x = x, .ldx = ldx, .xt = xt, .w = w, .panels = panels, .rows = rows,
                                         .in = in, .out = out, .bias = bias, .act = act, .beta = beta, .y = y,
                                         .ldy = ldy};
            return MC_OK;
        }
    }
    if (rows <= mc_cpu_smallrow_max(be)) {
        /* The lane kernel (cpu_smallrow.c): 16-bit weights, and fp32 ones
         * without panels. x is copied once (rounded to a 16-bit weight type,
         * padded to whole vectors). */
        static const float no_inputs = 0.0f; /* in == 0: never read, but not NULL */
        const float *xp = &no_inputs;
        if (ldxp > 0) {
            float *packed = mc_cpu_scratch(be, MC_LINEAR_X_SLOT, smallrow_x_floats(be, in),
                                           "the small-row linear's packed input", err);
            if (packed == NULL)
                return err->status;
            mc_cpu_smallrow_pack_x(be->linear_wtype, x, ldx, rows, in, ldxp, packed);
            xp = packed;
        }
        plan->path = MC_LINEAR_LANES;
        plan->lane = (mc_smallrow_job){.wt = be->linear_wtype, .xp = xp, .ldxp = ldxp, .rows = rows, .in = in,
                                       .out = out, .w = w, .bias = bias, .act = act, .beta = beta, .y = y,
                                       .ldy = ldy};
    }
    return MC_OK;
}

void mc_cpu_linear_team_body(const mc_linear_plan *plan, int tid, int team) {
    if (plan->path == MC_LINEAR_PANELS)
        mc_cpu_panel_team_body(plan->isa, &plan->panel, tid, team);
    else if (plan->path == MC_LINEAR_LANES)
        mc_cpu_smallrow_team_body(plan->isa, &plan->lane, tid, team);
}

mc_status mc_cpu_linear(mc_backend *be, const float *x, int64_t ldx, int64_t rows, int64_t in,
                        const void *w, const float *bias, int64_t out, mc_act act, float beta,
                        float *y, int64_t ldy, mc_err *err) {
    if (rows == 0)
        return MC_OK;
    if (beta != 0.0f && act != MC_ACT_NONE)
        return mc_fail(err, MC_ERR_INTERNAL, "linear: activation with accumulation is not defined");
    mc_linear_plan plan;
    MC_TRY(mc_cpu_linear_plan_of(be, x, ldx, rows, in, w, bias, out, act, beta, y, ldy, &plan, err));
    if (plan.path == MC_LINEAR_PANELS) {
        mc_cpu_panel_run(plan.isa, mc_cpu_threads(be), &plan.panel);
        return MC_OK;
    }
    if (plan.path == MC_LINEAR_LANES) {
        mc_cpu_smallrow_run(plan.isa, mc_cpu_threads(be), &plan.lane);
        return MC_OK;
    }
    const float *xg = x, *wg = w;
    int64_t ldxg = ldx;
    if (be->linear_wtype != MC_WTYPE_F32) {
        MC_TRY(widen_linear_operands(be, x, ldx, rows, in, w, out, &xg, &wg, err));
        ldxg = in;
    }
    /* Bias first, then GEMM with beta = 1, so the bias costs one pass. */
    if (bias != NULL) {
#pragma omp parallel for schedule(static) num_threads(mc_cpu_threads(be)) if (rows * out >= MC_PARALLEL_MIN_ELEMS)
        for (int64_t r = 0; r < rows; r++) {
            float *row = y + r * ldy;
            if (beta != 0.0f)
                for (int64_t i = 0; i < out; i++)
                    row[i] += bias[i];
            else
                for (int64_t i = 0; i < out; i++)
                    row[i] = bias[i];
        }
        beta = 1.0f;
    }
    mc_cpu_sgemm(mc_cpu_threads(be), mc_cpu_gemm_split_of(be),
                 0, 1, rows, out, in, 1.0f, xg, ldxg, wg, in, beta, y, ldy);
    apply_act_rows(be, act, y, ldy, rows, out);
    return MC_OK;
}

/* The sum over a row of (x[i] - mean), or of its squares, in double: lane
 * i % 8 adds its elements in increasing i, then the lanes in a fixed tree.
 * Eight independent sums let GCC vectorise the loop (one serial chain of
 * double adds was 1.6% of a batch-1 MAR-B profile), in one order whatever
 * the vector width. */
enum { ROW_SUM_LANES = 8 };
static double row_sum_f64(const float *x, int64_t n, double mean, int squares) {
    double lane[ROW_SUM_LANES] = {0};
    int64_t i = 0;
    for (; i + ROW_SUM_LANES <= n; i += ROW_SUM_LANES)
        for (int l = 0; l < ROW_SUM_LANES; l++) {
            const double d = (double)x[i + l] - mean;
            lane[l] += squares ? d * d : d;
        }
    for (int l = 0; i < n; i++, l++) {
        const double d = (double)x[i] - mean;
        lane[l] += squares ? d * d : d;
    }
    return ((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]));
}

mc_status mc_cpu_layernorm(mc_backend *be, const float *x, int64_t ldx, int64_t rows, int64_t dim,
                           const float *w, const float *b, float eps, const float *shift,
                           const float *scale, int64_t ld_mod, int64_t mod_period, float *y, int64_t ldy,
                           mc_err *err) {
    (void)be;
    if ((shift == NULL) != (scale == NULL))
        return mc_fail(err, MC_ERR_INTERNAL, "layernorm: shift and scale go together");
    if (mod_period < 1)
        return mc_fail(err, MC_ERR_INTERNAL, "layernorm: mod_period %lld is not positive", (long long)mod_period);
#pragma omp parallel for schedule(static) num_threads(mc_cpu_threads(be)) if (rows * dim >= MC_PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * ldx;
        float *yr = y + r * ldy;
        /* Two-pass statistics in double: rows are short, and double sums make
         * the float result all but independent of summation order on every
         * backend. */
        const double mean = row_sum_f64(xr, dim, 0.0, 0) / (double)dim;
        const double sq = row_sum_f64(xr, dim, mean, 1);
        const double inv = 1.0 / sqrt(sq / (double)dim + (double)eps);
        for (int64_t i = 0; i < dim; i++)
            yr[i] = (float)(((double)xr[i] - mean) * inv);
        if (w != NULL)
            for (int64_t i = 0; i < dim; i++)
                yr[i] = yr[i] * w[i] + (b != NULL ? b[i] : 0.0f);
        if (scale != NULL) {
            const float *sh = shift + (r / mod_period) * ld_mod, *sc = scale + (r / mod_period) * ld_mod;
            for (int64_t i = 0; i < dim; i++)
                yr[i] = yr[i] * (1.0f + sc[i]) + sh[i];
        }
    }
    return MC_OK;
}

mc_status mc_cpu_activation(mc_backend *be, mc_act act, float *x, int64_t ld, int64_t rows,
                            int64_t dim, mc_err *err) {
    (void)be;
    (void)err;
    apply_act_rows(be, act, x, ld, rows, dim);
    return MC_OK;
}

mc_status mc_cpu_add_rows(mc_backend *be, float *y, int64_t ldy, int64_t rows, int64_t dim,
                          const float *v, int64_t ldv, int64_t period, mc_err *err) {
    (void)be;
    if (period <= 0)
        return mc_fail(err, MC_ERR_INTERNAL, "add_rows: period must be positive");
#pragma omp parallel for schedule(static) num_threads(mc_cpu_threads(be)) if (rows * dim >= MC_PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        float *yr = y + r * ldy;
        const float *vr = v + (r % period) * ldv;
        for (int64_t i = 0; i < dim; i++)
            yr[i] += vr[i];
    }
    return MC_OK;
}

mc_status mc_cpu_gated_add(mc_backend *be, float *y, int64_t ldy, const float *u, int64_t ldu,
                           const float *gate, int64_t ldg, int64_t gate_period, int64_t rows, int64_t dim,
                           mc_err *err) {
    (void)be;
    if (gate_period < 1)
        return mc_fail(err, MC_ERR_INTERNAL, "gated_add: gate_period %lld is not positive", (long long)gate_period);
#pragma omp parallel for schedule(static) num_threads(mc_cpu_threads(be)) if (rows * dim >= MC_PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        float *yr = y + r * ldy;
        const float *ur = u + r * ldu, *gr = gate + (r / gate_period) * ldg;
        for (int64_t i = 0; i < dim; i++)
            yr[i] += gr[i] * ur[i];
    }
    return MC_OK;
}

/* Row r of src (row src_idx[r], or r when src_idx is NULL) to row r of dst
 * (row dst_idx[r], or r): gather_rows and scatter_rows. */
static void copy_rows(mc_backend *be, const float *src, int64_t lds, const int32_t *src_idx, float *dst, int64_t ldd,
                      const int32_t *dst_idx, int64_t rows, int64_t dim) {
    (void)be;
#pragma omp parallel for schedule(static) num_threads(mc_cpu_threads(be)) if (rows * dim >= MC_PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t from = src_idx != NULL ? (int64_t)src_idx[r] : r, to = dst_idx != NULL ? (int64_t)dst_idx[r] : r;
        memcpy(dst + to * ldd, src + from * lds, (size_t)dim * sizeof(float));
    }
}

mc_status mc_cpu_gather_rows(mc_backend *be, const float *src, int64_t lds, const int32_t *idx,
                             int64_t rows, int64_t dim, float *dst, int64_t ldd, mc_err *err) {
    (void)err;
    copy_rows(be, src, lds, idx, dst, ldd, NULL, rows, dim);
    return MC_OK;
}

mc_status mc_cpu_scatter_rows(mc_backend *be, const float *src, int64_t lds, const int32_t *idx,
                              int64_t rows, int64_t dim, float *dst, int64_t ldd, mc_err *err) {
    (void)err;
    copy_rows(be, src, lds, NULL, dst, ldd, idx, rows, dim);
    return MC_OK;
}

mc_status mc_cpu_cfg_combine(mc_backend *be, const float *cond, int64_t ldc, const float *uncond,
                             int64_t ldu, int64_t rows, int channels, float scale, float *out,
                             int64_t ldo, mc_err *err) {
    (void)be;
    (void)err;
    for (int64_t r = 0; r < rows; r++)
        for (int c = 0; c < channels; c++) {
            float u = uncond[r * ldu + c];
            out[r * ldo + c] = u + scale * (cond[r * ldc + c] - u);
        }
    return MC_OK;
}

mc_status mc_cpu_ddpm_step(mc_backend *be, float *x, int64_t rows, int channels, const float *eps,
                           int64_t ld_eps, const float *v, int64_t ld_v, const float *noise,
                           const mc_ddpm_coefs *coefs, mc_err *err) {
    (void)be;
    if (noise == NULL && coefs->noise_scale != 0.0f)
        return mc_fail(err, MC_ERR_INTERNAL, "ddpm_step: noise missing");
    for (int64_t r = 0; r < rows; r++) {
        for (int c = 0; c < channels; c++) {
            float xt = x[r * channels + c];
            float e = eps[r * ld_eps + c];
            float x0 = coefs->sqrt_recip_alphas_cumprod * xt - coefs->sqrt_recipm1_alphas_cumprod * e;
            float mean = coefs->posterior_mean_coef1 * x0 + coefs->posterior_mean_coef2 * xt;
            float frac = (v[r * ld_v + c] + 1.0f) * 0.5f;
            float log_var = frac * coefs->log_beta + (1.0f - frac) * coefs->posterior_log_variance;
            float next = mean;
            if (coefs->noise_scale != 0.0f)
                next += expf(0.5f * log_var) * noise[r * channels + c] * coefs->noise_scale;
            x[r * channels + c] = next;
        }
    }
    return MC_OK;
}

mc_status mc_cpu_token_normals(mc_backend *be, uint64_t seed, uint32_t stream, uint32_t step,
                               const uint32_t *image, const uint32_t *position, int64_t rows,
                               int channels, float *out, mc_err *err) {
    (void)be;
    if (channels > 64)
        return mc_fail(err, MC_ERR_INTERNAL, "token_normals: at most 64 channels");
    for (int64_t r = 0; r < rows; r++)
        mc_philox_token_normals(seed, image[r], stream, position[r], step, channels,
                                out + r * channels);
    return MC_OK;
}

mc_status mc_cpu_axpby(mc_backend *be, float a, const float *x, int64_t ldx, float b, float *y,
                       int64_t ldy, int64_t rows, int64_t cols, mc_err *err) {
    (void)err;
#pragma omp parallel for schedule(static) num_threads(mc_cpu_threads(be)) if (rows * cols >= MC_PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * ldx;
        float *yr = y + r * ldy;
        if (b == 0.0f)
            for (int64_t i = 0; i < cols; i++)
                yr[i] = a * xr[i];
        else
            for (int64_t i = 0; i < cols; i++)
                yr[i] = a * xr[i] + b * yr[i];
    }
    return MC_OK;
}

mc_status mc_cpu_cosine_rows(mc_backend *be, const float *a, int64_t lda, const float *b,
                             int64_t ldb, int64_t rows, int heads, int head_dim, float *out,
                             mc_err *err) {
    (void)err;
#pragma omp parallel for schedule(static) num_threads(mc_cpu_threads(be)) if (rows * heads * head_dim >= MC_PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        double total = 0.0;
        for (int h = 0; h < heads; h++) {
            const float *ar = a + r * lda + (int64_t)h * head_dim, *br = b + r * ldb + (int64_t)h * head_dim;
            double dot = 0.0, na = 0.0, nb = 0.0;
            for (int i = 0; i < head_dim; i++) {
                dot += (double)ar[i] * br[i];
                na += (double)ar[i] * ar[i];
                nb += (double)br[i] * br[i];
            }
            double denom = sqrt(na) * sqrt(nb);
            total += dot / (denom > 1e-8 ? denom : 1e-8);
        }
        out[r] = (float)(total / heads);
    }
    return MC_OK;
}

mc_status mc_cpu_head_l2norm(mc_backend *be, float *x, int64_t ld, int64_t rows, int heads,
                             int head_dim, const float *head_scale, mc_err *err) {
    if (heads <= 0 || head_dim <= 0)
        return mc_fail(err, MC_ERR_INTERNAL, "head_l2norm: %d heads of %d channels", heads, head_dim);
#pragma omp parallel for schedule(static) num_threads(mc_cpu_threads(be)) if (rows * heads * head_dim >= MC_PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        for (int h = 0; h < heads; h++) {
            float *v = x + r * ld + (int64_t)h * head_dim;
            double sq = 0.0;
            for (int i = 0; i < head_dim; i++)
                sq += (double)v[i] * v[i];
            const double norm = sqrt(sq);
            const double denom = norm > 1e-12 ? norm : 1e-12;
            const double s = head_scale != NULL ? (double)head_scale[h] : 1.0;
            for (int i = 0; i < head_dim; i++)
                v[i] = (float)((double)v[i] / denom * s);
        }
    }
    return MC_OK;
}

/* ---- pivotal_rows (FastVAR, ops_list.h) ---- */

typedef struct pivotal_entry {
    double score;
    int64_t row;
} pivotal_entry;

/* The selection order of the contract (sampling_inline.h): a strict total
 * order, so qsort's result does not depend on its algorithm. */
static int pivotal_compare(const void *pa, const void *pb) {
    const pivotal_entry *a = pa, *b = pb;
    if (mc_pivotal_before(a->score, a->row, b->score, b->row))
        return -1;
    return mc_pivotal_before(b->score, b->row, a->score, a->row) ? 1 : 0;
}

mc_status mc_cpu_pivotal_rows(mc_backend *be, const float *x, int64_t ldx, int64_t batch, int64_t rows,
                              int64_t dim, int64_t keep, int32_t *out, mc_err *err) {
    (void)be;
    MC_TRY(mc_check_pivotal_rows(ldx, batch, rows, dim, keep, err));
    if (batch == 0 || keep == 0)
        return MC_OK;
    double *mean = malloc((size_t)(dim > 0 ? dim : 1) * sizeof(double));
    pivotal_entry *order = malloc((size_t)rows * sizeof(pivotal_entry));
    unsigned char *kept = malloc((size_t)rows);
    if (mean == NULL || order == NULL || kept == NULL) {
        free(mean);
        free(order);
        free(kept);
        return mc_fail_nomem(err,
                             (size_t)(dim > 0 ? dim : 1) * sizeof(double) + (size_t)rows * (sizeof(pivotal_entry) + 1),
                             "pivotal_rows' mean and ranking of %lld rows", (long long)rows);
    }
    for (int64_t b = 0; b < batch; b++) {
        const float *xb = x + b * rows * ldx;
        /* The mean token, each channel summed in row order (the CUDA kernel's order too). */
        for (int64_t c = 0; c < dim; c++)
            mean[c] = 0.0;
        for (int64_t r = 0; r < rows; r++)
            for (int64_t c = 0; c < dim; c++)
                mean[c] += (double)xb[r * ldx + c];
        for (int64_t c = 0; c < dim; c++)
            mean[c] /= (double)rows;
        for (int64_t r = 0; r < rows; r++) {
            double score = 0.0;
            for (int64_t c = 0; c < dim; c++) {
                const double d = (double)xb[r * ldx + c] - mean[c];
                score += d * d;
            }
            order[r] = (pivotal_entry){score, r};
        }
        qsort(order, (size_t)rows, sizeof *order, pivotal_compare);
        memset(kept, 0, (size_t)rows);
        for (int64_t j = 0; j < keep; j++)
            kept[order[j].row] = 1;
        int32_t *ob = out + b * keep;
        for (int64_t r = 0, n = 0; r < rows; r++)
            if (kept[r])
                ob[n++] = (int32_t)(b * rows + r);
    }
    free(mean);
    free(order);
    free(kept);
    return MC_OK;
}
