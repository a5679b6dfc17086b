/* Shorthands for a model loader's weight list (mar.c, var.c), so each tensor
 * is one line: its destination, name and shape. Include it in a .c file
 * only, after bind.h; the macros expect an `mc_loader *ld` in scope and
 * return the failure from the enclosing function (MC_TRY).
 *
 *   BIND(dst, "name", d0, d1, ...)         a float32 tensor of that shape
 *   BINDF(dst, (d0, d1), "fmt.%d", i)      the same, the name as a format
 *   LBIND(dst, out, in, "fmt.%d", i)       a Linear weight [out, in] in the
 *                                          backend's linear_wtype */
#ifndef MC_BIND_SHORTHAND_H
#define MC_BIND_SHORTHAND_H

#include "bind.h"

#define SHAPE(...) ((const int64_t[]){__VA_ARGS__})
#define NDIM(...) ((int)(sizeof((const int64_t[]){__VA_ARGS__}) / sizeof(int64_t)))
#define BIND(dst, name, ...) MC_TRY(mc_bind(ld, name, NDIM(__VA_ARGS__), SHAPE(__VA_ARGS__), MC_BIND_AS_IS, &(dst)))
#define BINDF(dst, dims, fmt, ...) MC_TRY(mc_bindf(ld, &(dst), NDIM dims, SHAPE dims, fmt, __VA_ARGS__))
#define LBIND(dst, out, in, ...) MC_TRY(mc_bind_linearf(ld, &(dst), out, in, __VA_ARGS__))

#endif
