/* CPU graphs (ops.h capture_*): the head sampler's recorded diffusion steps
 * replayed on one persistent OpenMP team (issue 23).
 *
 * Called directly, every op of the CPU backend that has parallel work opens
 * its own OpenMP region: at batch 1 a MAR-B image runs ~45,000 regions in the
 * head alone (7 parallel Linears per diffusion step, 100 steps, 64 AR steps),
 * each a fork and a join, with the second thread spinning or asleep while the
 * first runs the small serial ops between them. Here the sampler records its
 * 99 later diffusion steps, as it does for a CUDA graph, and the launch walks
 * the recorded calls on one team:
 *
 *   - a small-row Linear (panels or lane kernel) is a TEAM node: thread 0
 *     plans it (scratch, x packed for the lane kernel), a barrier, every
 *     thread runs its slice of the outputs, a barrier;
 *   - a row-parallel elementwise op (norm, residual, axpby, activation,
 *     row gather or scatter) of MC_PARALLEL_MIN_ELEMS values or more is a
 *     TEAM_ROWS node: a barrier, every thread runs the op on its slice of
 *     the rows, a barrier;
 *   - an op that would run on one thread anyway (those elementwise ops
 *     below MC_PARALLEL_MIN_ELEMS, the sampler's cfg_combine,
 *     token_normals, ddpm_step, copies, Linears below
 *     MC_SMALLROW_PARALLEL_MIN_MACS) is a SERIAL node: thread 0 runs it with
 *     no barrier of its own, so a run of them costs one barrier, the next
 *     parallel node's;
 *   - anything else (an OpenBLAS Linear, attention, a convolution) is a
 *     REGION node: the team ends, the op runs as called directly (its own
 *     region), and the next run of team and serial nodes starts a new team.
 *
 * So wherever the head's Linears take the small-row kernels (up to 96
 * rows, or 768 with AVX-512's column panels) the 99 steps of an AR step run
 * in one parallel region (MAR-B at batch 1: one per AR step measured); the
 * kernels, their thread slices and therefore the bits are those of the
 * direct calls (tests/test_cpu_graphs.py). What is recorded is each call's
 * arguments: backend pointers as given, and the host structs some ops take
 * by pointer (ddpm_step's coefficients, a window's geometry, attention's
 * segments), which live on the caller's stack, copied into the node. Nothing
 * runs while recording, so a recording that fails or is discarded has
 * changed nothing. MARCACHE_CPU_GRAPHS=0 turns recording off (the sampler
 * then calls the steps directly). */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_internal.h"

/* ---- an op's arguments as a struct, from its entry in ops_list.h -------
 * CG_FIELDS(mc_backend *be, int m, ...)  -> mc_backend *be; int m; ...
 * CG_MEMBERS_OF(a, (be, m, ...))         -> a.be, a.m, ...
 * (up to 16 parameters; the list's longest op has 15). */
#define CG_NARG(...) CG_NARG_(__VA_ARGS__, 16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0)
#define CG_NARG_(_1, _2, _3, _4, _5, _6, _7, _8, _9, _10, _11, _12, _13, _14, _15, _16, n, ...) n
#define CG_CAT(a, b) CG_CAT_(a, b)
#define CG_CAT_(a, b) a##b
#define CG_UNPAREN(...) __VA_ARGS__
#define CG_BRACED(...) {__VA_ARGS__}

#define CG_FIELDS(...) CG_CAT(CG_F, CG_NARG(__VA_ARGS__))(__VA_ARGS__)
#define CG_F1(a) a;
#define CG_F2(a, ...) a; CG_F1(__VA_ARGS__)
#define CG_F3(a, ...) a; CG_F2(__VA_ARGS__)
#define CG_F4(a, ...) a; CG_F3(__VA_ARGS__)
#define CG_F5(a, ...) a; CG_F4(__VA_ARGS__)
#define CG_F6(a, ...) a; CG_F5(__VA_ARGS__)
#define CG_F7(a, ...) a; CG_F6(__VA_ARGS__)
#define CG_F8(a, ...) a; CG_F7(__VA_ARGS__)
#define CG_F9(a, ...) a; CG_F8(__VA_ARGS__)
#define CG_F10(a, ...) a; CG_F9(__VA_ARGS__)
#define CG_F11(a, ...) a; CG_F10(__VA_ARGS__)
#define CG_F12(a, ...) a; CG_F11(__VA_ARGS__)
#define CG_F13(a, ...) a; CG_F12(__VA_ARGS__)
#define CG_F14(a, ...) a; CG_F13(__VA_ARGS__)
#define CG_F15(a, ...) a; CG_F14(__VA_ARGS__)
#define CG_F16(a, ...) a; CG_F15(__VA_ARGS__)

#define CG_MEMBERS_OF(p, args) CG_MEMBERS_I(p, CG_UNPAREN args)
#define CG_MEMBERS_I(p, ...) CG_CAT(CG_M, CG_NARG(__VA_ARGS__))(p, __VA_ARGS__)
#define CG_M1(p, a) p.a
#define CG_M2(p, a, ...) p.a, CG_M1(p, __VA_ARGS__)
#define CG_M3(p, a, ...) p.a, CG_M2(p, __VA_ARGS__)
#define CG_M4(p, a, ...) p.a, CG_M3(p, __VA_ARGS__)
#define CG_M5(p, a, ...) p.a, CG_M4(p, __VA_ARGS__)
#define CG_M6(p, a, ...) p.a, CG_M5(p, __VA_ARGS__)
#define CG_M7(p, a, ...) p.a, CG_M6(p, __VA_ARGS__)
#define CG_M8(p, a, ...) p.a, CG_M7(p, __VA_ARGS__)
#define CG_M9(p, a, ...) p.a, CG_M8(p, __VA_ARGS__)
#define CG_M10(p, a, ...) p.a, CG_M9(p, __VA_ARGS__)
#define CG_M11(p, a, ...) p.a, CG_M10(p, __VA_ARGS__)
#define CG_M12(p, a, ...) p.a, CG_M11(p, __VA_ARGS__)
#define CG_M13(p, a, ...) p.a, CG_M12(p, __VA_ARGS__)
#define CG_M14(p, a, ...) p.a, CG_M13(p, __VA_ARGS__)
#define CG_M15(p, a, ...) p.a, CG_M14(p, __VA_ARGS__)
#define CG_M16(p, a, ...) p.a, CG_M15(p, __VA_ARGS__)

#define MC_OP(name, where, params, args, flops) typedef struct cg_args_##name { CG_FIELDS params } cg_args_##name;
#include "../ops_list.h"

/* A recorded backend copy (mc_ops.copy): not an op of the list. */
#define CG_COPY MC_OP_COUNT
/* Attention segments a node holds (MARche's cache-aware attention has 2);
 * a call with more fails the recording. */
#define CG_MAX_SEGMENTS 4

typedef enum cg_kind { CG_SERIAL = 0, CG_TEAM = 1, CG_TEAM_ROWS = 2, CG_REGION = 3 } cg_kind;

typedef struct cg_node {
    int op; /* mc_op_id, or CG_COPY */
    union {
#define MC_OP(name, where, params, args, flops) cg_args_##name name;
#include "../ops_list.h"
        struct {
            void *dst;
            const void *src;
            size_t bytes;
        } copy;
    } a;
    /* Copies of the host structs the call's pointers named: replay points
     * the arguments here. */
    union {
        mc_ddpm_coefs coefs;
        mc_window2d window;
        mc_kv_segment segments[CG_MAX_SEGMENTS];
    } host;
} cg_node;

struct mc_cpu_graph {
    cg_node *nodes;
    unsigned char *kinds; /* cg_kind per node, set at launch */
    int64_t count, capacity;
};

static void graph_free(mc_cpu_graph *g) {
    if (g == NULL)
        return;
    free(g->nodes);
    free(g->kinds);
    free(g);
}

static mc_status refuse(mc_cpu_recorder *rec, const char *what, mc_err *err) {
    if (!rec->failed)
        rec->failed_what = what;
    rec->failed = 1;
    return mc_fail(err, MC_ERR_INTERNAL, "cpu: %s while recording a graph", what);
}

/* The next node of the recording (grown by doubling; a failed growth fails
 * the recording, which the sampler answers by running the steps directly). */
static cg_node *append(mc_cpu_recorder *rec, int op, mc_err *err) {
    mc_cpu_graph *g = rec->recording;
    if (g->count == g->capacity) {
        const int64_t fresh = g->capacity ? 2 * g->capacity : 1024;
        cg_node *nodes = realloc(g->nodes, (size_t)fresh * sizeof *nodes);
        if (nodes == NULL) {
            rec->failed = 1;
            rec->failed_what = "no memory for the recorded calls";
            mc_fail_nomem_n(err, (size_t)fresh, sizeof *nodes, "a CPU graph's recorded calls");
            return NULL;
        }
        g->nodes = nodes;
        unsigned char *kinds = realloc(g->kinds, (size_t)fresh);
        if (kinds == NULL) {
            rec->failed = 1;
            rec->failed_what = "no memory for the recorded calls";
            mc_fail_nomem(err, (size_t)fresh, "a CPU graph's node kinds");
            return NULL;
        }
        g->kinds = kinds;
        g->capacity = fresh;
    }
    cg_node *node = &g->nodes[g->count++];
    node->op = op;
    return node;
}

/* The host structs an op takes by pointer are copied into the node; every
 * other pointer parameter of the list is backend memory, recorded as given
 * (tests/test_cpu_graphs.py holds the list to that). */
static mc_status keep_host_args(mc_cpu_recorder *rec, cg_node *node, mc_err *err) {
    switch (node->op) {
    case MC_OP_ID_ddpm_step:
        if (node->a.ddpm_step.coefs != NULL)
            node->host.coefs = *node->a.ddpm_step.coefs;
        break;
    case MC_OP_ID_conv2d_ex:
        node->host.window = *node->a.conv2d_ex.g;
        break;
    case MC_OP_ID_avg_pool2d:
        node->host.window = *node->a.avg_pool2d.g;
        break;
    case MC_OP_ID_max_pool2d:
        node->host.window = *node->a.max_pool2d.g;
        break;
    case MC_OP_ID_attention:
        if (node->a.attention.nsegs < 0 || node->a.attention.nsegs > CG_MAX_SEGMENTS)
            return refuse(rec, "an attention over more than 4 key segments", err);
        memcpy(node->host.segments, node->a.attention.segs,
               (size_t)node->a.attention.nsegs * sizeof(mc_kv_segment));
        break;
    default:
        break;
    }
    return MC_OK;
}

/* A node's arguments for its replay: a copy of the node whose host-struct
 * pointers name the node's own host copies. (Typed union members, not a
 * cast of one op's arguments to another's: GCC's -Warray-bounds, under the
 * sanitizer build's inlining, rejected the cast form in the other ops'
 * branches.) */
static cg_node replay_args(const cg_node *node) {
    cg_node local = *node;
    switch (node->op) {
    case MC_OP_ID_ddpm_step:
        if (local.a.ddpm_step.coefs != NULL)
            local.a.ddpm_step.coefs = &node->host.coefs;
        break;
    case MC_OP_ID_conv2d_ex:
        local.a.conv2d_ex.g = &node->host.window;
        break;
    case MC_OP_ID_avg_pool2d:
        local.a.avg_pool2d.g = &node->host.window;
        break;
    case MC_OP_ID_max_pool2d:
        local.a.max_pool2d.g = &node->host.window;
        break;
    case MC_OP_ID_attention:
        local.a.attention.segs = node->host.segments;
        break;
    default:
        break;
    }
    return local;
}

/* The backend table's entries: the op itself, or a record of the call. */
#define MC_OP(name, where, params, args, flops)                             \
    mc_status mc_cpu_entry_##name params {                                  \
        mc_cpu_recorder *rec = mc_cpu_recorder_of(be);                      \
        if (!rec->capturing)                                                \
            return mc_cpu_##name args;                                      \
        cg_node *node = append(rec, MC_OP_ID_##name, err);                  \
        if (node == NULL)                                                   \
            return err->status;                                             \
        const cg_args_##name recorded = CG_BRACED args;                     \
        node->a.name = recorded;                                            \
        return keep_host_args(rec, node, err);                              \
    }
#include "../ops_list.h"

mc_status mc_cpu_refuse_while_recording(mc_backend *be, const char *what, mc_err *err) {
    mc_cpu_recorder *rec = mc_cpu_recorder_of(be);
    return rec->capturing ? refuse(rec, what, err) : MC_OK;
}

/* A copy while recording is a node (CUDA records it as a memcpy node). */
static mc_status record_copy(mc_cpu_recorder *rec, void *dst, const void *src, size_t bytes, mc_err *err) {
    cg_node *node = append(rec, CG_COPY, err);
    if (node == NULL)
        return err->status;
    node->a.copy.dst = dst;
    node->a.copy.src = src;
    node->a.copy.bytes = bytes;
    return MC_OK;
}

mc_status mc_cpu_copy_or_record(mc_backend *be, void *dst, const void *src, size_t bytes, mc_err *err) {
    mc_cpu_recorder *rec = mc_cpu_recorder_of(be);
    if (rec->capturing)
        return record_copy(rec, dst, src, bytes, err);
    mc_cpu_copy_bytes(be, dst, src, bytes);
    return MC_OK;
}

mc_status mc_cpu_capture_begin(mc_backend *be, mc_err *err) {
    mc_cpu_recorder *rec = mc_cpu_recorder_of(be);
    if (!mc_cpu_graphs_enabled(be))
        return mc_fail(err, MC_ERR_INTERNAL, "cpu: graphs are off (MARCACHE_CPU_GRAPHS=0)");
    if (rec->capturing)
        return mc_fail(err, MC_ERR_INTERNAL, "cpu: a graph is already being recorded");
    if (rec->recording == NULL && (rec->recording = calloc(1, sizeof *rec->recording)) == NULL)
        return mc_fail_nomem(err, sizeof *rec->recording, "a CPU graph");
    rec->recording->count = 0;
    rec->capturing = 1;
    rec->failed = 0;
    rec->failed_what = NULL;
    return MC_OK;
}

mc_status mc_cpu_capture_end(mc_backend *be, void **graph, int keep, mc_err *err) {
    mc_cpu_recorder *rec = mc_cpu_recorder_of(be);
    if (!rec->capturing)
        return mc_fail(err, MC_ERR_INTERNAL, "cpu: capture_end without capture_begin");
    rec->capturing = 0;
    if (!keep || rec->failed) {
        rec->recording->count = 0;
        if (rec->failed)
            return mc_fail(err, MC_ERR_INTERNAL, "cpu: graph recording discarded (%s while recording)",
                           rec->failed_what);
        return mc_fail(err, MC_ERR_INTERNAL, "cpu: graph recording discarded");
    }
    /* The recording becomes the graph; the graph it replaces (if any) holds
     * the next recording, so steady state allocates nothing. */
    mc_cpu_graph *old = *graph;
    *graph = rec->recording;
    rec->recording = old;
    return MC_OK;
}

static mc_status run_node(mc_backend *be, const cg_node *node, mc_err *err) {
    switch (node->op) {
#define MC_OP(name, where, params, args, flops)           \
    case MC_OP_ID_##name: {                               \
        cg_args_##name a = replay_args(node).a.name;      \
        a.be = be;                                        \
        a.err = err;                                      \
        return mc_cpu_##name(CG_MEMBERS_OF(a, args));     \
    }
#include "../ops_list.h"
    case CG_COPY:
        mc_cpu_copy_bytes(be, node->a.copy.dst, node->a.copy.src, node->a.copy.bytes);
        return MC_OK;
    default:
        return mc_fail(err, MC_ERR_INTERNAL, "cpu graph: unknown node %d", node->op);
    }
}

/* Rows [r0, r1) of a row-parallel op (a TEAM_ROWS node): the op called on
 * that slice, whose rows it computes as the whole call does (each row on
 * its own). Slices start at multiples of the op's period (row_op_shape), so a
 * row keeps its modulation, gate or period row; r0 > 0 only then. */
static mc_status run_rows(mc_backend *be, const cg_node *node, int64_t r0, int64_t r1, mc_err *err) {
    const int64_t n = r1 - r0;
    switch (node->op) {
    case MC_OP_ID_layernorm: {
        const cg_args_layernorm *a = &node->a.layernorm;
        const int64_t m0 = a->shift != NULL && r0 > 0 ? r0 / a->mod_period * a->ld_mod : 0;
        return mc_cpu_layernorm(be, a->x + r0 * a->ldx, a->ldx, n, a->dim, a->w, a->b, a->eps,
                                a->shift != NULL ? a->shift + m0 : NULL, a->scale != NULL ? a->scale + m0 : NULL,
                                a->ld_mod, a->mod_period, a->y + r0 * a->ldy, a->ldy, err);
    }
    case MC_OP_ID_activation: {
        const cg_args_activation *a = &node->a.activation;
        return mc_cpu_activation(be, a->act, a->x + r0 * a->ld, a->ld, n, a->dim, err);
    }
    case MC_OP_ID_add_rows: {
        const cg_args_add_rows *a = &node->a.add_rows;
        return mc_cpu_add_rows(be, a->y + r0 * a->ldy, a->ldy, n, a->dim, a->v, a->ldv, a->period, err);
    }
    case MC_OP_ID_gated_add: {
        const cg_args_gated_add *a = &node->a.gated_add;
        const int64_t g0 = r0 > 0 ? r0 / a->gate_period * a->ldg : 0;
        return mc_cpu_gated_add(be, a->y + r0 * a->ldy, a->ldy, a->u + r0 * a->ldu, a->ldu, a->gate + g0, a->ldg,
                                a->gate_period, n, a->dim, err);
    }
    case MC_OP_ID_gather_rows: {
        const cg_args_gather_rows *a = &node->a.gather_rows;
        return mc_cpu_gather_rows(be, a->src, a->lds, a->idx + r0, n, a->dim, a->dst + r0 * a->ldd, a->ldd, err);
    }
    case MC_OP_ID_scatter_rows: {
        const cg_args_scatter_rows *a = &node->a.scatter_rows;
        return mc_cpu_scatter_rows(be, a->src + r0 * a->lds, a->lds, a->idx + r0, n, a->dim, a->dst, a->ldd, err);
    }
    case MC_OP_ID_axpby: {
        const cg_args_axpby *a = &node->a.axpby;
        return mc_cpu_axpby(be, a->a, a->x + r0 * a->ldx, a->ldx, a->b, a->y + r0 * a->ldy, a->ldy, n, a->cols,
                            err);
    }
    default:
        return mc_fail(err, MC_ERR_INTERNAL, "cpu graph: op %d has no row slices", node->op);
    }
}

/* A row-parallel op's shape: its rows, the values per row, and the multiple
 * its row slices start at (a modulation, gate or period row shared by that
 * many rows). 0 for any other op. A period that is not positive is left to
 * the op to refuse (on the slice of thread 0, which then holds every row). */
static int row_op_shape(const cg_node *node, int64_t *rows, int64_t *width, int64_t *align) {
    *align = 1;
    switch (node->op) {
    case MC_OP_ID_layernorm:
        if (node->a.layernorm.shift != NULL)
            *align = node->a.layernorm.mod_period;
        *rows = node->a.layernorm.rows, *width = node->a.layernorm.dim;
        return 1;
    case MC_OP_ID_activation:
        *rows = node->a.activation.rows, *width = node->a.activation.dim;
        return 1;
    case MC_OP_ID_add_rows:
        *align = node->a.add_rows.period;
        *rows = node->a.add_rows.rows, *width = node->a.add_rows.dim;
        return 1;
    case MC_OP_ID_gated_add:
        *align = node->a.gated_add.gate_period;
        *rows = node->a.gated_add.rows, *width = node->a.gated_add.dim;
        return 1;
    case MC_OP_ID_gather_rows:
        *rows = node->a.gather_rows.rows, *width = node->a.gather_rows.dim;
        return 1;
    case MC_OP_ID_scatter_rows:
        *rows = node->a.scatter_rows.rows, *width = node->a.scatter_rows.dim;
        return 1;
    case MC_OP_ID_axpby:
        *rows = node->a.axpby.rows, *width = node->a.axpby.cols;
        return 1;
    default:
        return 0;
    }
}

/* How a node runs on the replay's team (the file's comment). */
static cg_kind kind_of(mc_backend *be, const cg_node *node) {
    int64_t rows, width, align;
    if (row_op_shape(node, &rows, &width, &align))
        return rows * width < MC_PARALLEL_MIN_ELEMS ? CG_SERIAL : CG_TEAM_ROWS;
    switch (node->op) {
    case MC_OP_ID_linear: {
        const cg_args_linear *a = &node->a.linear;
        if (a->rows == 0 || (double)a->rows * (double)a->in * (double)a->out < MC_SMALLROW_PARALLEL_MIN_MACS)
            return CG_SERIAL;
        return mc_cpu_linear_takes_small_rows(be, a->w, a->rows, a->in, a->out) ? CG_TEAM : CG_REGION;
    }
    case MC_OP_ID_cfg_combine: /* serial loops whatever their size */
    case MC_OP_ID_ddpm_step:
    case MC_OP_ID_token_normals:
    case CG_COPY:
        return CG_SERIAL;
    default:
        return CG_REGION;
    }
}

/* What the team's threads share: the first failure, and the plan of the
 * TEAM node being run (made by thread 0 before a barrier). Thread 0 writes
 * status before a node's first barrier and every thread reads it right
 * after; a row slice's failure (any thread, between the node's two
 * barriers) goes to body_status, which thread 0 moves into status at its
 * next turn. */
typedef struct team_shared {
    mc_status status, body_status;
    mc_err err, body_err;
    mc_linear_plan plan;
} team_shared;

/* Thread 0's part of a TEAM node: plan the Linear. A plan that comes out
 * as OpenBLAS's (a weight's panels gone since launch classified it) runs
 * here on this thread; the others then skip the node. */
static void plan_team_node(mc_backend *be, const cg_node *node, team_shared *sh) {
    cg_args_linear a = node->a.linear;
    sh->plan.path = MC_LINEAR_BLAS;
    if (a.beta != 0.0f && a.act != MC_ACT_NONE) {
        sh->status = mc_cpu_linear(be, a.x, a.ldx, a.rows, a.in, a.w, a.bias, a.out, a.act, a.beta, a.y, a.ldy,
                                   &sh->err);
        return;
    }
    sh->status = mc_cpu_linear_plan_of(be, a.x, a.ldx, a.rows, a.in, a.w, a.bias, a.out, a.act, a.beta, a.y,
                                       a.ldy, &sh->plan, &sh->err);
    if (sh->status == MC_OK && sh->plan.path == MC_LINEAR_BLAS)
        sh->status = mc_cpu_linear(be, a.x, a.ldx, a.rows, a.in, a.w, a.bias, a.out, a.act, a.beta, a.y, a.ldy,
                                   &sh->err);
}

static void take_body_failure(team_shared *sh) {
    if (sh->body_status != MC_OK && sh->status == MC_OK) {
        sh->status = sh->body_status;
        sh->err = sh->body_err;
    }
}

/* Thread `tid`'s row slice of a TEAM_ROWS node. */
static void run_row_slice(mc_backend *be, const cg_node *node, int tid, int team, team_shared *sh) {
    int64_t rows = 0, width = 0, align = 1, r1;
    (void)row_op_shape(node, &rows, &width, &align);
    const int64_t r0 = align >= 1 ? mc_cpu_thread_slice(rows, tid, team, align, &r1) : (tid == 0 ? 0 : rows);
    if (align < 1)
        r1 = rows;
    if (r0 >= r1)
        return;
    mc_err local = {0};
    if (run_rows(be, node, r0, r1, &local) != MC_OK) {
#pragma omp critical(mc_cpu_graph_failure)
        if (sh->body_status == MC_OK) {
            sh->body_status = local.status;
            sh->body_err = local;
        }
    }
}

/* Nodes [begin, end) (TEAM, TEAM_ROWS and SERIAL) on one team of
 * `threads`. A parallel node waits for the serial ones before it (their
 * outputs may be its inputs) and is waited for before anything after it. */
static mc_status run_on_team(mc_backend *be, const mc_cpu_graph *g, int64_t begin, int64_t end, int threads,
                             mc_err *err) {
    team_shared sh = {.status = MC_OK, .body_status = MC_OK};
#pragma omp parallel num_threads(threads)
    {
        const int tid = omp_get_thread_num(), team = omp_get_num_threads();
        for (int64_t k = begin; k < end; k++) {
            const cg_node *node = &g->nodes[k];
            if (tid == 0)
                take_body_failure(&sh);
            if (g->kinds[k] == CG_SERIAL) {
                if (tid == 0 && sh.status == MC_OK)
                    sh.status = run_node(be, node, &sh.err);
                continue;
            }
            if (g->kinds[k] == CG_TEAM && tid == 0 && sh.status == MC_OK)
                plan_team_node(be, node, &sh);
#pragma omp barrier
            /* Read by every thread between the same two barriers: all
             * leave at the same node. */
            if (sh.status != MC_OK)
                break;
            if (g->kinds[k] == CG_TEAM)
                mc_cpu_linear_team_body(&sh.plan, tid, team);
            else
                run_row_slice(be, node, tid, team, &sh);
#pragma omp barrier
        }
    }
    take_body_failure(&sh);
    be->team_regions++;
    be->team_calls += end - begin;
    if (sh.status != MC_OK)
        *err = sh.err;
    return sh.status;
}

mc_status mc_cpu_graph_launch(mc_backend *be, void *graph, mc_err *err) {
    mc_cpu_graph *g = graph;
    if (g == NULL)
        return mc_fail(err, MC_ERR_INTERNAL, "cpu: graph_launch of no graph");
    const int threads = mc_cpu_threads(be);
    for (int64_t k = 0; k < g->count; k++)
        g->kinds[k] = (unsigned char)kind_of(be, &g->nodes[k]);
    int64_t k = 0;
    while (k < g->count) {
        int64_t end = k;
        int team_nodes = 0;
        while (end < g->count && g->kinds[end] != CG_REGION)
            team_nodes += g->kinds[end++] != CG_SERIAL;
        if (end == k) {
            MC_TRY(run_node(be, &g->nodes[k], err));
            k++;
            continue;
        }
        if (team_nodes > 0 && threads > 1) {
            MC_TRY(run_on_team(be, g, k, end, threads, err));
        } else {
            for (int64_t i = k; i < end; i++)
                MC_TRY(run_node(be, &g->nodes[i], err));
        }
        k = end;
    }
    return MC_OK;
}

void mc_cpu_graph_free(mc_backend *be, void *graph) {
    (void)be;
    graph_free(graph);
}

void mc_cpu_recorder_free(mc_cpu_recorder *rec) {
    graph_free(rec->recording);
    rec->recording = NULL;
}
