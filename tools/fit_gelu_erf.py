"""Fit the constants of the CPU backend's exact-erf GELU (csrc/backend/cpu/cpu_vmath.c).

    python tools/fit_gelu_erf.py        # prints the #define lines of mc_gelu_erf

GELU(x) = x/2 g(x), g = 1 + erf(x / sqrt 2). Two forms, split at |x| = NEAR:
  near: g = 1 + x P(x^2),        P(u) ~ erf(sqrt(u / 2)) / sqrt(u)      on u in (0, NEAR^2]
  far:  erfc(y / sqrt 2) = e^(-y^2/2) F(t) / y,  t = 1 / (1 + y/2),
        F(t) ~ y erfcx(y / sqrt 2)                                      on t in (0, 1 / (1 + NEAR/2)]
Each polynomial is a minimax fit on relative error (Lawson's reweighted least squares on
Chebyshev points) with float32 coefficients: the coefficients are rounded to float32 one
at a time, lowest degree first, the higher ones refitted after each rounding, so the later
ones absorb the rounding of the earlier ones. Needs scipy (erf, erfcx), a test dependency.
tests/test_vmath.py holds the result to the float64 GELU."""
import numpy as np
from scipy.special import erf, erfcx

NEAR = 0.85
P_DEGREE = 5
F_DEGREE = 10


def fit_float32_minimax(func, lo, hi, degree, points=6000, rounds=40):
    """Coefficients, lowest degree first, each a float32, of a polynomial near func on
    [lo, hi] in relative error; returns (coefficients, max relative error in float64)."""
    k = np.arange(points)
    v = 0.5 * (lo + hi) + 0.5 * (hi - lo) * np.cos(np.pi * (k + 0.5) / points)
    fv = func(v)
    powers = np.stack([v ** i for i in range(degree + 1)], axis=1)
    fixed = []
    while len(fixed) <= degree:
        j = len(fixed)
        rest = (fv - powers[:, :j] @ np.array(fixed)) / fv if j else np.ones_like(fv)
        a = powers[:, j:] / fv[:, None]
        weight = np.full(points, 1.0 / points)
        for _ in range(rounds):
            sw = np.sqrt(weight)
            c, *_ = np.linalg.lstsq(a * sw[:, None], rest * sw, rcond=None)
            weight *= np.abs(a @ c - rest) + 1e-30
            weight /= weight.sum()
        fixed.append(float(np.float32(c[0])))
    c = np.array(fixed)
    return c, float(np.max(np.abs(powers @ c / fv - 1.0)))


def main():
    p, p_err = fit_float32_minimax(lambda u: erf(np.sqrt(u / 2)) / np.sqrt(u), 1e-12, NEAR * NEAR, P_DEGREE)

    def f_of_t(t):
        y = (1.0 / t - 1.0) * 2.0
        return y * erfcx(y / np.sqrt(2.0))

    f, f_err = fit_float32_minimax(f_of_t, 1e-9, 1.0 / (1.0 + NEAR / 2), F_DEGREE)
    print(f"/* relative error of the fits in float64: P {p_err:.2g}, F {f_err:.2g} */")
    for name, coefs in (("P", p), ("F", f)):
        for i, c in enumerate(coefs):
            print(f"#define GELU_{name}{i} {np.float32(c)!r}".replace("np.float32(", "").replace(")", "f"))


if __name__ == "__main__":
    main()
