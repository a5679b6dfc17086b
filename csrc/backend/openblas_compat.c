/* scipy-openblas32 0.3.34.481.3 declares scipy_openblas_set_num_threads_local
 * in its cblas.h, but its library keeps the function local (nm shows a `t`
 * symbol, unprefixed), so an extension that calls it links and then fails to
 * import with "undefined symbol". This weak fallback keeps the module
 * loadable: it changes nothing and returns the current thread count, so a
 * caller's save/restore pair is a no-op. A library that does export the
 * function is searched first at load time and wins.
 *
 * Consequence while the fallback is in use: GEMMs called from inside an
 * OpenMP region may use OpenBLAS's own threads as well (oversubscription,
 * not a wrong result). */
#include <cblas.h>

__attribute__((weak)) int scipy_openblas_set_num_threads_local(int num_threads) {
    (void)num_threads;
    return scipy_openblas_get_num_threads();
}
