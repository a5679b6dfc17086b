/* The marcache._C extension module: assembles the areas of the binding
 * (each py_*.c registers its types and functions; shared helpers are in
 * py_util.c). The one translation unit that initialises NumPy's C API. */
#define MC_PY_MODULE_MAIN
#include "py_numpy.h"

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "marcache._C", "marcache C engine", -1, NULL,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__C(void) {
    import_array();
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL)
        return NULL;
    if (mcpy_build_init(module) < 0 || mcpy_io_init(module) < 0 || mcpy_ops_init(module) < 0 ||
        mcpy_mar_init(module) < 0 || mcpy_vae_init(module) < 0 || mcpy_vqvae_init(module) < 0 ||
        mcpy_inception_init(module) < 0 || mcpy_var_init(module) < 0 ||
        mcpy_devpool_init(module) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
