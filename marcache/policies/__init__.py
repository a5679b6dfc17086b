"""Cache policies: one module per policy (its config dataclass, the fields it sends
the engine, its FLOP model), each matching one C file in csrc/runtime/.

Dispatch is by policy type, as diffusers' ``enable_cache`` dispatches on its config
classes: every policy class names the model family it runs on (``family``), and a
model resolves a user's ``cache=`` argument with ``resolve(cache, family)``, which
refuses a policy of another family with a clear error. A new policy is one module
here (plus its C file), registered in POLICIES."""
from .fastvar import FastVAR
from .lazymar import RETENTION_64, LazyMAR
from .marche import MARche
from .nocache import NoCache

POLICIES = (NoCache, LazyMAR, MARche)

from .cfgfree import CfgFreeLate  # noqa: E402  (composes the policies above)

POLICIES += (CfgFreeLate, FastVAR)

from .disa import DiSA  # noqa: E402  (composes the policies above)

POLICIES += (DiSA,)


def resolve(cache, family="mar"):
    """The validated policy a model of `family` runs (None means NoCache)."""
    if cache is None:
        return NoCache()
    if isinstance(cache, POLICIES):
        if family not in getattr(cache, "families", (cache.family,)):
            raise ValueError(f"{type(cache).__name__} is a cache policy for {cache.family.upper()} models, "
                             f"not {family.upper()}")
        return cache
    names = ", ".join(f"marcache.{p.__name__}(...)" for p in POLICIES
                      if family in getattr(p, "families", (p.family,)))
    raise TypeError(f"cache must be None or one of {names}, got {cache!r}")


__all__ = ["NoCache", "LazyMAR", "MARche", "CfgFreeLate", "DiSA", "FastVAR", "RETENTION_64", "POLICIES", "resolve"]
