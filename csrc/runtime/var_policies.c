/* The registry of VAR cache policies: the binding finds a policy here by the
 * name the Python policy carries. A new policy adds one line. Also the
 * family's instance of what every seam shares (policy_seam.h: the policy
 * lifecycle, the schema lookup). */
#include <string.h>

#include "policy_seam.h"
#include "var_policy.h"

const mc_var_policy_ops *const mc_var_policies[] = {
    &mc_var_nocache_policy,
    &mc_var_fastvar_policy,
    &mc_var_cfgfree_policy,
    NULL,
};

const mc_var_policy_ops *mc_var_policy_find(const char *name) {
    /* The Python NoCache class serves both families under MAR's name. */
    if (strcmp(name, "none") == 0)
        return &mc_var_nocache_policy;
    for (int i = 0; mc_var_policies[i] != NULL; i++)
        if (strcmp(mc_var_policies[i]->schema.name, name) == 0)
            return mc_var_policies[i];
    return NULL;
}

MC_POLICY_SEAM(var, mc_var, mc_var_run_shape, mc_var_nocache_policy)
