"""NoCache: the official model, every step in full (csrc/runtime/nocache.c)."""
from dataclasses import dataclass

from .. import mar_family
from ._common import engine_fields


@dataclass(frozen=True)
class NoCache:
    """Every AR step runs the full encoder, decoder and head: the official model."""

    name = "none"
    family = mar_family.FAMILY

    def as_dict(self, rows=320):
        """The engine's configuration (NoCache has no fields)."""
        del rows
        return engine_fields(self)

    def check_model(self, config):
        """NoCache runs on any MAR model."""
        del config

    def head_cache_config(self, cfg_on):
        del cfg_on
        return None

    def transformer_flops(self, ctx):
        """(encoder, decoder) FLOPs of one AR step."""
        return mar_family.plain_transformer(ctx.config, ctx.n_seq, ctx.known)
