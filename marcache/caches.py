"""The cache policies under their historical module name: each lives in its own
module of marcache.policies (configuration, engine fields and FLOP model)."""
from .policies import POLICIES, RETENTION_64, CfgFreeLate, FastVAR, LazyMAR, MARche, NoCache, resolve

__all__ = ["CfgFreeLate", "FastVAR", "NoCache", "LazyMAR", "MARche", "RETENTION_64", "POLICIES", "resolve"]
