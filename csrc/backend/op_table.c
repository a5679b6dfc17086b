/* What the op list (ops_list.h) gives every backend: the op names, and the
 * entries that stand in for an op a backend does not implement. */
#include "ops.h"

const char *const mc_op_names[MC_OP_COUNT] = {
#define MC_OP(name, where, params, args, flops) #name,
#include "ops_list.h"
};

static mc_status unsupported(mc_backend *be, mc_op_id id, mc_err *err) {
    return mc_fail(err, MC_ERR_INTERNAL, "op '%s' is not supported on backend '%s'",
                   mc_op_names[id], be->ops->name);
}

/* One stand-in per op, with the op's own type. Only `be` and `err` are
 * read; the op's other parameters are there to give the entry its type. */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-parameter"
#define MC_OP(name, where, params, args, flops) \
    static mc_status unsupported_##name params { return unsupported(be, MC_OP_ID_##name, err); }
#include "ops_list.h"
#pragma GCC diagnostic pop

mc_op_fn mc_op_entry(const mc_ops *ops, mc_op_id id) {
    switch (id) {
#define MC_OP(name, where, params, args, flops) \
    case MC_OP_ID_##name:                         \
        return (mc_op_fn)ops->name;
#include "ops_list.h"
    case MC_OP_COUNT:
        break;
    }
    return NULL;
}

static mc_op_fn unsupported_entry(mc_op_id id) {
    mc_ops stand_ins = {0};
#define MC_OP(name, where, params, args, flops) stand_ins.name = unsupported_##name;
#include "ops_list.h"
    return mc_op_entry(&stand_ins, id);
}

void mc_ops_fill_unsupported(mc_ops *ops) {
#define MC_OP(name, where, params, args, flops) \
    if (ops->name == NULL)                        \
        ops->name = unsupported_##name;
#include "ops_list.h"
}

int mc_op_supported(const mc_ops *ops, mc_op_id id) {
    mc_op_fn entry = mc_op_entry(ops, id);
    return entry != NULL && entry != unsupported_entry(id);
}
