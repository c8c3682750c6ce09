"""The identity compressor."""
from __future__ import annotations

from commlab.engine.compressors.base import Compressor
from commlab.engine.compressors.capabilities import Capabilities


class NoneCompressor(Compressor):
    """No compression: the payload is the bucket itself, all-reduced in place."""
    name = "none"
    capabilities = Capabilities(summable=True, keeps_shape=True, lossless=True, identity=True)

    def compress(self, t):
        return [t], None

    def decompress(self, payload, ctx):
        return payload[0]
