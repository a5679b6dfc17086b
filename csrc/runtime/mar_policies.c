/* The registry of MAR cache policies: the binding finds a policy here by the
 * name the Python policy carries. A new policy adds one line. Also the
 * family's instance of what every seam shares (policy_seam.h: the policy
 * lifecycle, the schema lookup). */
#include <string.h>

#include "lazymar.h"
#include "marche.h"
#include "mar_policy.h"
#include "policy_seam.h"

extern const mc_mar_policy_ops mc_cfgfree_policy;
extern const mc_mar_policy_ops mc_disa_policy;

const mc_mar_policy_ops *const mc_mar_policies[] = {
    &mc_nocache_policy,
    &mc_lazymar_policy,
    &mc_marche_policy,
    &mc_cfgfree_policy,
    &mc_disa_policy,
    NULL,
};

const mc_mar_policy_ops *mc_mar_policy_find(const char *name) {
    for (int i = 0; mc_mar_policies[i] != NULL; i++)
        if (strcmp(mc_mar_policies[i]->schema.name, name) == 0)
            return mc_mar_policies[i];
    return NULL;
}

mc_status mc_mar_inner_check(const mc_policy_ref *ref, const char *outer, const mc_mar_config *model, mc_err *err) {
    if (ref->schema == NULL || ref->config == NULL)
        return mc_fail(err, MC_ERR_VALUE, "%s: no inner policy", outer);
    return mc_mar_policy_of(ref->schema)->check(ref->config, model, err);
}

mc_status mc_mar_inner_make(mc_mar_policy *inner, mc_mar *mar, const mc_policy_ref *ref,
                            const mc_mar_run_shape *run, mc_err *err) {
    return mc_mar_policy_make(inner, mc_mar_policy_of(ref->schema), mar, ref->config, run, err);
}

MC_POLICY_SEAM(mar, mc_mar, mc_mar_run_shape, mc_nocache_policy)
