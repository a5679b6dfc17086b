"""Cache policy configurations. Each is a small frozen dataclass whose fields
are validated at construction; the C runtime reads them."""
from dataclasses import dataclass


@dataclass(frozen=True)
class NoCache:
    """Every AR step runs the full encoder, decoder and head: the official model."""

    name = "none"


def resolve(cache):
    """Returns a validated cache config (None means NoCache)."""
    if cache is None:
        return NoCache()
    if isinstance(cache, NoCache):
        return cache
    raise TypeError(f"cache must be None or a marcache cache config such as marcache.NoCache(), got {cache!r}")
