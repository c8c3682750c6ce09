"""Model zoo: small image classifiers and a character-level GPT.

Rules every model follows, because the trainers rely on them:
- no BatchNorm or other buffers: nothing but parameters needs syncing across ranks;
- no in-place ops on activations: per-module backward hooks wrap module
  outputs, and autograd rejects in-place edits of those;
- every parameter lives in a leaf module (Conv2d, Linear, GroupNorm,
  LayerNorm, Embedding), so per-layer hooks see each layer on its own.
Callers seed (torch.manual_seed) before build() for a deterministic init.

Models from outside the zoo (``torchvision:<arch>``, ``hf:<type>``,
``pkg.module:factory``; commlab/engine/external.py) follow none of these rules by
promise: the trainer averages their floating-point buffers (BatchNorm running
statistics) across ranks before each evaluation.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from commlab.engine import external
from commlab.engine.codepath import ZOO_KIND, is_external, zoo_kind

NAMES = tuple(ZOO_KIND)


def kind(name):
    """The data kind model `name` needs ("image", "text"), or None when only its first batch can tell."""
    if is_external(name):
        return external.model_kind(name)
    return zoo_kind(name)


MIN_SIDE = {"cnn": 2}
"""The smallest image height and width a zoo model takes (cnn's max pool halves them; resnet's stride-2 stages
keep a 1x1 image 1x1)."""


def compatible(name, info_kind):
    """Whether model `name` can train on data of kind "image" or "text" (True when unknown)."""
    need = kind(name)
    return need is None or info_kind is None or need == info_kind


def build(name, info, **kw):
    if is_external(name):
        return external.build_model(name, info, **kw)
    zoo_kind(name)
    if not compatible(name, info.kind):
        raise ValueError(f"model: {name!r} needs {ZOO_KIND[name]} data, got {info.kind}")
    if name == "mlp":
        return MLP(math.prod(info.input_shape), info.num_classes, **kw)
    if name == "cnn":
        return CNN(info.input_shape[0], info.num_classes, **kw)
    if name == "resnet":
        return ResNet(info.input_shape[0], info.num_classes, **kw)
    return GPT(info.num_classes, info.input_shape[0], **kw)


def loss_fn(logits, y):
    """Mean cross entropy; (B, T, V) text logits are flattened to (B*T, V)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def make_loss(path=None):
    """The loss: cross entropy (per image, or per next token) unless the spec names a function
    ``package.module:fn`` taking (model output, y) and returning a scalar tensor."""
    if path is None:
        return loss_fn
    return external.import_object(path, "model.loss")


def correct(logits, y):
    """(number right, number scored): per image, or per next character for text."""
    return int((logits.argmax(dim=-1) == y).sum()), y.numel()


# ---------------------------------------------------------------- image models

class MLP(nn.Module):
    def __init__(self, n_in, classes, hidden=512, depth=2):
        super().__init__()
        if depth < 1:
            raise ValueError(f"model: mlp depth must be >= 1, got {depth}")
        layers = [nn.Flatten()]
        for i in range(depth):
            layers += [nn.Linear(n_in if i == 0 else hidden, hidden), nn.ReLU()]
        layers.append(nn.Linear(hidden, classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


class CNN(nn.Module):
    """Two 3x3 convs and a max pool, then a fixed 4x4 pool so the head has
    the same size for 8x8 digits, 28x28 MNIST or 32x32 inputs (H, W >= 2)."""

    def __init__(self, channels, classes):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(channels, 32, 3, padding=1), nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2),
            nn.AdaptiveAvgPool2d(4),
            nn.Flatten(),
            nn.Linear(64 * 16, 128), nn.ReLU(),
            nn.Linear(128, classes),
        )

    def forward(self, x):
        return self.net(x)


def _gn(channels):
    return nn.GroupNorm(min(8, channels), channels)


class BasicBlock(nn.Module):
    def __init__(self, c_in, c_out, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.norm1 = _gn(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.norm2 = _gn(c_out)
        self.shortcut = None
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False),
                                          _gn(c_out))

    def forward(self, x):
        out = F.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        skip = x if self.shortcut is None else self.shortcut(x)
        return F.relu(out + skip)  # a new tensor, not out += skip


class ResNet(nn.Module):
    """ResNet-18 layout (4 stages x 2 basic blocks) at reduced width, with a
    3x3 stem and no initial pooling so 8x8 inputs survive three stride-2 stages."""

    def __init__(self, channels, classes, width=32):
        super().__init__()
        widths = (width, 2 * width, 4 * width, 8 * width)
        self.stem = nn.Sequential(nn.Conv2d(channels, width, 3, 1, 1, bias=False),
                                  _gn(width), nn.ReLU())
        blocks, c = [], width
        for w, stride in zip(widths, (1, 2, 2, 2)):
            blocks += [BasicBlock(c, w, stride), BasicBlock(w, w, 1)]
            c = w
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(c, classes)

    def forward(self, x):
        x = self.blocks(self.stem(x))
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


# ---------------------------------------------------------------- transformer

class SelfAttention(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # (B, T, C) -> (B, heads, T, head_dim)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        # is_causal builds the mask on the fly: no mask buffer to store or sync.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class MLPBlock(nn.Module):
    def __init__(self, n_embd):
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = SelfAttention(n_embd, n_head)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = MLPBlock(n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab, block, n_layer=4, n_head=4, n_embd=128):
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"model: n_embd={n_embd} is not divisible by n_head={n_head}")
        self.block = block
        self.tok = nn.Embedding(vocab, n_embd)
        self.pos = nn.Embedding(block, n_embd)
        self.blocks = nn.Sequential(*[Block(n_embd, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab)
        # GPT-2 style small init; PyTorch's defaults (N(0,1) embeddings) make
        # the first steps of a small transformer needlessly unstable.
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear):
                nn.init.zeros_(m.bias)

    def forward(self, idx):
        T = idx.shape[1]
        if T > self.block:
            raise ValueError(f"model: sequence length {T} exceeds block size {self.block}")
        pos = torch.arange(T, device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        return self.head(self.ln_f(self.blocks(x)))
