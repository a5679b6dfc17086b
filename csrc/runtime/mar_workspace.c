#include "mar_workspace.h"

#include <stdlib.h>

static void free_runtime_acts(void *data, mc_backend *be) {
    mc_mar_runtime_acts *acts = data;
    MC_BUFFERS_RELEASE(be, acts);
    free(acts);
}

mc_mar_runtime_acts *mc_mar_runtime_acts_of(mc_mar *mar, mc_err *err) {
    if (mar->runtime.data != NULL)
        return mar->runtime.data;
    mc_mar_runtime_acts *acts = calloc(1, sizeof *acts);
    if (acts == NULL) {
        mc_fail_nomem(err, sizeof *acts, "the MAR runtime's workspace table");
        return NULL;
    }
    mar->runtime.data = acts;
    mar->runtime.free = free_runtime_acts;
    return acts;
}
