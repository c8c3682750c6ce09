"""A model factory: commlab calls ``build(**model options, info=DataInfo)`` and trains what it returns."""
import math

from torch import nn


def build(width: int = 64, info=None) -> nn.Module:
    """A two-layer MLP sized from the data: ``info.input_shape`` (one example's shape) and
    ``info.num_classes``."""
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(info.input_shape), width), nn.ReLU(),
                         nn.Linear(width, width), nn.ReLU(), nn.Linear(width, info.num_classes))
