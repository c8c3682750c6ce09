"""The identity compressor."""
from __future__ import annotations

from engine.compressors.base import Compressor
from engine.compressors.params import reject_params


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
