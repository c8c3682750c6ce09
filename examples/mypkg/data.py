"""A data loader: commlab calls ``load(**dataset options, seed=...)`` and gets (train, held_out), two
map-style data sets whose items are (x, y)."""
import torch
from torch.utils.data import TensorDataset


def load(n: int = 1000, seed: int = 0):
    """Two interleaved spirals in 2-D, noisy: a small problem a wider model learns better."""
    g = torch.Generator().manual_seed(seed)
    t = torch.rand(n, generator=g) * 2 * torch.pi
    label = torch.randint(0, 2, (n,), generator=g)
    r = 0.2 + t / (2 * torch.pi)
    angle = t + label * torch.pi
    x = torch.stack([r * torch.cos(angle), r * torch.sin(angle)], 1) + 0.02 * torch.randn(n, 2, generator=g)
    cut = n * 4 // 5
    return TensorDataset(x[:cut], label[:cut]), TensorDataset(x[cut:], label[cut:])
