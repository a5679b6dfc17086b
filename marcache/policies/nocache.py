"""NoCache: the official model, every step in full (csrc/runtime/nocache.c for MAR,
the VAR engine's NoCache for VAR)."""
from dataclasses import dataclass

from .. import mar_family, var_family
from ._common import engine_fields


@dataclass(frozen=True)
class NoCache:
    """Every step runs in full: the official model. MAR: the whole encoder, decoder
    and head at every AR step; VAR: every block on every token of every scale."""

    name = "none"
    family = mar_family.FAMILY
    families = (mar_family.FAMILY, var_family.FAMILY)  # the one policy both families run

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
        """(encoder, decoder) FLOPs of one MAR AR step."""
        return mar_family.plain_transformer(ctx.config, ctx.n_seq, ctx.known, ctx.read(ctx.predicted))

    def scale_flops(self, ctx):
        """(linear, attention) FLOPs of the blocks at one VAR scale (var_family.ScaleContext)."""
        return var_family.plain_blocks(ctx.config, ctx.n_seq, ctx.tokens, ctx.keys)
