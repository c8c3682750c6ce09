"""The identity compressor."""
from __future__ import annotations

from engine.compressors.base import Compressor


def reject_params(name: str, params: dict) -> None:
    if params:
        raise ValueError(f"{sorted(params)[0]}: {name} takes no parameters")


class NoneCompressor(Compressor):
    """No compression: the payload is the bucket itself, all-reduced in place."""
    name = "none"
    summable = True
    keeps_shape = True

    def __init__(self, **params):
        reject_params(self.name, params)

    def compress(self, t):
        return [t], None

    def decompress(self, payload, ctx):
        return payload[0]
