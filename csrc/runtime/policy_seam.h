/* What every model family's cache-policy seam does the same way, written
 * once and instantiated by each family's registry (mar_policies.c,
 * var_policies.c) for its own types: a policy's life for one run, so the
 * policies themselves only fill and release their state, and a policy's
 * config schema by name.
 *
 *   mc_<family>_policy_make(policy, ops, model, config, run, err)
 *       ops NULL means the family's NoCache (config unused). Checks the
 *       config, allocates the state (ops->state_size bytes, zeroed) and has
 *       ops->init fill it; if init fails, ops->release and free undo it and
 *       policy->state stays NULL.
 *   mc_<family>_policy_free(policy)
 *       ops->release, then frees the state; nothing when none was made.
 *   mc_<family>_policy_schema(name)
 *       the config schema of mc_<family>_policy_find(name) (the first member
 *       of its ops table), or NULL: the lookup of composed policies' fields. */
#ifndef MC_POLICY_SEAM_H
#define MC_POLICY_SEAM_H

#include <stdlib.h>

#include "../core/mc_core.h"

#define MC_POLICY_SEAM(family, model_type, run_type, nocache_ops)                                            \
    mc_status mc_##family##_policy_make(mc_##family##_policy *policy, const mc_##family##_policy_ops *ops,    \
                                        model_type *model, const void *config, const run_type *run,            \
                                        mc_err *err) {                                                         \
        policy->ops = ops != NULL ? ops : &(nocache_ops);                                                      \
        policy->state = NULL;                                                                                  \
        MC_TRY(policy->ops->check(config, &model->config, err));                                               \
        void *state = calloc(1, policy->ops->state_size);                                                      \
        if (state == NULL)                                                                                     \
            return mc_fail_nomem(err, policy->ops->state_size, "the state of cache policy '%s'",            \
                                 policy->ops->schema.name);                                                    \
        const mc_status st = policy->ops->init(state, model, config, run, err);                                \
        if (st != MC_OK) {                                                                                     \
            policy->ops->release(state);                                                                       \
            free(state);                                                                                       \
            return st;                                                                                         \
        }                                                                                                      \
        policy->state = state;                                                                                 \
        return MC_OK;                                                                                          \
    }                                                                                                          \
                                                                                                               \
    void mc_##family##_policy_free(mc_##family##_policy *policy) {                                             \
        if (policy->state != NULL) {                                                                           \
            policy->ops->release(policy->state);                                                               \
            free(policy->state);                                                                               \
        }                                                                                                      \
        policy->state = NULL;                                                                                  \
    }                                                                                                          \
                                                                                                               \
    const mc_config_schema *mc_##family##_policy_schema(const char *name) {                                    \
        const mc_##family##_policy_ops *ops = mc_##family##_policy_find(name);                                 \
        return ops ? &ops->schema : NULL;                                                                      \
    }

#endif
