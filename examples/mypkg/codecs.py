"""A compressor of your own: commlab names it by import path (``compressor: {name: mypkg.codecs:ScaledSign}``)
and checks it like a built-in:

    PYTHONPATH=examples commlab check compressor mypkg.codecs:ScaledSign --param scale=0.5 --model mlp

It is the example in ``commlab.Compressor``'s docstring, declared a shard codec so that dear takes it too."""
import torch

from commlab import Capabilities, Compressor, Param


class ScaledSign(Compressor):
    """Each element's sign and the bucket's mean magnitude, times ``scale``: about a quarter of fp32's bytes
    (a byte per sign; packing eight signs per byte, as efsignsgd does, would send an eighth of that)."""
    # summable=False: magnitudes differ by rank, so payloads are all-gathered and decoded per rank;
    # shard_codec=True: any slice compresses alone, its payload's sizes fixed by its length
    capabilities = Capabilities(summable=False, shard_codec=True)
    params = (Param("scale", float, 1.0, "multiplies the decoded magnitude", lo=0, lo_open=True),)

    def compress(self, t):
        mag = t.abs().mean().reshape(1) if t.numel() else t.new_zeros(1)
        return [torch.sign(t).to(torch.int8), mag], (t.shape, t.dtype)

    def decompress(self, payload, ctx):
        signs, mag = payload
        shape, dtype = ctx
        return (signs.to(dtype) * (mag.to(dtype) * self.scale)).view(shape)
