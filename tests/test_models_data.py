import pytest
import torch
import torch.nn as nn

from commlab.engine import data, models

torch.set_num_threads(1)

IMAGE_SIZES = {"digits": (1437, 360, (1, 8, 8)),
               "mnist": (4000, 1000, (1, 28, 28)),
               "synthetic": (2048, 512, (3, 32, 32))}
LEAVES = (nn.Conv2d, nn.Linear, nn.GroupNorm, nn.LayerNorm, nn.Embedding)


def rows(x):
    return {bytes(r.numpy().tobytes()) for r in x.flatten(1)}


# ---------------------------------------------------------------- data sets

@pytest.mark.parametrize("name", sorted(IMAGE_SIZES))
def test_image_dataset(name):
    ds = data.load(name)
    n_train, n_test, shape = IMAGE_SIZES[name]
    assert ds.info == data.DataInfo("image", shape, 10, n_train, n_test)
    assert (ds.size("train"), ds.size("test")) == (n_train, n_test)
    assert ds.train_x.shape == (n_train, *shape) and ds.train_x.dtype == torch.float32
    assert ds.test_x.shape == (n_test, *shape) and ds.test_x.dtype == torch.float32
    assert ds.train_y.shape == (n_train,) and ds.train_y.dtype == torch.int64
    assert ds.test_y.dtype == torch.int64
    assert ds.train_y.min() >= 0 and ds.train_y.max() < 10
    # normalised with train statistics
    assert abs(ds.train_x.mean().item()) < 1e-3
    assert abs(ds.train_x.std().item() - 1) < 1e-2
    # held-out examples are not in the train split (the raw sets have no duplicates)
    assert not rows(ds.train_x) & rows(ds.test_x)
    x, y = ds.batch("test", torch.tensor([0, 5, 7]))
    assert x.shape == (3, *shape) and torch.equal(y, ds.test_y[[0, 5, 7]])


@pytest.mark.parametrize("name", ["digits", "mnist"])
def test_real_split_is_stratified_and_fixed(name):
    ds = data.load(name, seed=7)
    assert ds is data.load(name, seed=0)  # the seed does not pick the split
    counts = torch.bincount(ds.test_y, minlength=10).float()
    assert counts.min() >= 0.8 * counts.mean()
    # rebuilding from scratch gives the very same split
    getattr(data, "_" + name).cache_clear()
    again = data.load(name)
    assert again is not ds and torch.equal(again.test_x, ds.test_x)
    assert torch.equal(again.train_y, ds.train_y)


def test_text_dataset():
    ds = data.load("text", block=32)
    info = ds.info
    assert info.kind == "text" and info.input_shape == (32,)
    assert info.num_classes == len(ds.vocab) > 60 and ds.vocab == "".join(sorted(set(ds.vocab)))
    assert ds.train_tokens.dtype == torch.int64 and ds.test_tokens.dtype == torch.int64
    n = len(ds.train_tokens) + len(ds.test_tokens)
    assert n > 400_000 and abs(len(ds.test_tokens) / n - 0.1) < 1e-3
    assert ds.size("train") == len(ds.train_tokens) - 32 == info.train_size
    assert ds.size("test") == len(ds.test_tokens) - 32 == info.test_size
    assert max(ds.train_tokens.max(), ds.test_tokens.max()) < info.num_classes
    last = ds.size("test") - 1
    x, y = ds.batch("test", torch.tensor([0, 100, last]))
    assert x.shape == y.shape == (3, 32) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(y[2], ds.test_tokens[-32:])
    corpus = data._corpus()
    assert ds.decode(x[1]) == corpus[-len(ds.test_tokens) + 100:][:32]
    assert data.load("text").info.input_shape == (64,)


def test_synthetic_dataset():
    data._synthetic.cache_clear()
    a = data.load("synthetic", seed=1)
    assert torch.equal(data.load("synthetic", seed=1).train_x, a.train_x)
    b = data.load("synthetic", seed=2)
    assert not torch.equal(a.train_x, b.train_x)
    assert len(torch.unique(a.train_y)) == 10  # not all one class
    c = data.load("synthetic", shape=[2, 5, 6], classes=3, size=100)
    assert c.info == data.DataInfo("image", (2, 5, 6), 3, 100, 25)
    assert set(c.train_y.tolist()) == {0, 1, 2}


def test_synthetic_labels_are_learnable():
    ds = data.load("synthetic", shape=(1, 8, 8), size=1024)
    torch.manual_seed(0)
    m = models.build("mlp", ds.info, hidden=64, depth=1)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    for _ in range(100):
        loss = models.loss_fn(m(ds.train_x), ds.train_y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    right, total = models.correct(m(ds.test_x), ds.test_y)
    assert right / total > 0.6  # chance is 0.1


def test_load_rejects_bad_input():
    with pytest.raises(ValueError, match="allowed: digits, mnist, text, synthetic"):
        data.load("cifar")
    with pytest.raises(ValueError, match="shape"):
        data.load("digits", shape=(1, 8, 8))
    with pytest.raises(ValueError, match="block"):
        data.load("synthetic", block=8)
    with pytest.raises(ValueError, match="split"):
        data.load("digits").batch("val", torch.tensor([0]))


# ---------------------------------------------------------------- sampling

def take(sampler, k):
    return [next(sampler) for _ in range(k)]


def test_shard_sampler_shards_are_disjoint_and_cover():
    n, bs, world = 96, 8, 3
    samplers = [data.ShardSampler(n, bs, r, world, seed=5) for r in range(world)]
    per_rank = [torch.cat(take(s, n // world // bs)) for s in samplers]
    for s in samplers:
        assert s.epoch == 0
    assert sorted(torch.cat(per_rank).tolist()) == list(range(n))
    b = next(samplers[0])
    assert samplers[0].epoch == 1 and b.dtype == torch.int64 and b.shape == (bs,)


def test_shard_sampler_is_deterministic():
    a = take(data.ShardSampler(50, 4, 1, 2, seed=3), 20)
    b = take(data.ShardSampler(50, 4, 1, 2, seed=3), 20)
    c = take(data.ShardSampler(50, 4, 1, 2, seed=4), 20)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))
    # epoch 0 and epoch 1 visit the shard in different orders
    assert not torch.equal(torch.cat(a[:6]), torch.cat(a[6:12]))


def test_shard_sampler_keeps_ranks_in_step():
    # 63 items over 2 ranks: shards of 32 and 31, yet both ranks change epoch together
    s0, s1 = data.ShardSampler(63, 1, 0, 2, 0), data.ShardSampler(63, 1, 1, 2, 0)
    for _ in range(100):
        next(s0), next(s1)
        assert s0.epoch == s1.epoch


def test_shard_sampler_rejects_small_shard():
    with pytest.raises(ValueError, match="batch_size"):
        data.ShardSampler(100, 60, 0, 2, 0)
    data.ShardSampler(100, 50, 1, 2, 0)  # exactly one batch per shard is fine


@pytest.mark.parametrize("n,bs,world", [(101, 8, 2), (2, 4, 3), (360, 64, 1)])
def test_eval_batches_cover_each_index_once(n, bs, world):
    batches = [b for r in range(world) for b in data.eval_batches(n, bs, r, world)]
    assert all(1 <= len(b) <= bs and b.dtype == torch.int64 for b in batches)
    assert sorted(torch.cat(batches).tolist()) == list(range(n))


# ---------------------------------------------------------------- models

def dataset_for(name):
    if name == "text":
        return data.load("text")
    if name == "synthetic":
        return data.load("synthetic", size=64)
    return data.load(name)


PAIRS = [(m, d) for m in models.NAMES for d in data.NAMES
         if models.compatible(m, "text" if d == "text" else "image")]


@pytest.mark.filterwarnings("ignore:Full backward hook")  # inputs are data, not grads
@pytest.mark.parametrize("model,dset", PAIRS)
def test_forward_backward_with_layer_hooks(model, dset):
    ds = dataset_for(dset)
    torch.manual_seed(0)
    m = models.build(model, ds.info)
    # Full backward hooks on every parameterised leaf: in-place ops on their
    # outputs would make backward raise here.
    fired = []
    for mod in m.modules():
        if list(mod.parameters(recurse=False)):
            assert isinstance(mod, LEAVES) and not list(mod.children()), type(mod)
            mod.register_full_backward_hook(lambda mod, gi, go: fired.append(mod))
    x, y = ds.batch("train", torch.arange(4))
    logits = m(x)
    want = (4, 64, ds.info.num_classes) if ds.info.kind == "text" else (4, ds.info.num_classes)
    assert logits.shape == want
    loss = models.loss_fn(logits, y)
    assert torch.isfinite(loss)
    loss.backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert fired
    assert list(m.buffers()) == []


def test_resnet_size():
    m = models.build("resnet", data.load("synthetic", size=64).info)
    params = list(m.parameters())
    assert len(params) >= 40
    assert 1e6 <= sum(p.numel() for p in params) <= 5e6
    assert not any(isinstance(x, nn.BatchNorm2d) for x in m.modules())


def test_init_is_deterministic():
    info = data.load("digits").info
    torch.manual_seed(3)
    a = models.build("resnet", info, width=8)
    torch.manual_seed(3)
    b = models.build("resnet", info, width=8)
    torch.manual_seed(4)
    c = models.build("resnet", info, width=8)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not all(torch.equal(p, q) for p, q in zip(a.parameters(), c.parameters()))


def test_transformer_is_causal():
    info = data.load("text", block=16).info
    torch.manual_seed(0)
    m = models.build("transformer", info, n_layer=2, n_head=2, n_embd=32)
    x = torch.randint(0, info.num_classes, (2, 16))
    x2 = x.clone()
    x2[:, 10] = (x[:, 10] + 1) % info.num_classes
    with torch.no_grad():
        a, b = m(x), m(x2)
    assert torch.allclose(a[:, :10], b[:, :10], atol=1e-5)
    assert not torch.allclose(a[:, 10:], b[:, 10:], atol=1e-5)


def test_compatible_and_bad_names():
    assert not models.compatible("transformer", "image")
    assert not models.compatible("mlp", "text")
    assert models.compatible("cnn", "image") and models.compatible("transformer", "text")
    with pytest.raises(ValueError, match="needs text"):
        models.build("transformer", data.load("digits").info)
    with pytest.raises(ValueError, match="allowed: mlp, cnn, resnet, transformer"):
        models.build("vgg", data.load("digits").info)
    with pytest.raises(ValueError, match="allowed: mlp, cnn, resnet, transformer"):
        models.compatible("vgg", "image")


def test_loss_and_correct():
    logits = torch.tensor([[2.0, 0.0], [0.0, 3.0], [1.0, 0.0]])
    y = torch.tensor([0, 1, 1])
    assert models.correct(logits, y) == (2, 3)
    assert torch.isclose(models.loss_fn(logits, y),
                         torch.nn.functional.cross_entropy(logits, y))
    text_logits = torch.zeros(2, 5, 7)
    text_logits[..., 3] = 1.0
    ty = torch.full((2, 5), 3)
    ty[0, 0] = 1
    assert models.correct(text_logits, ty) == (9, 10)
    assert models.loss_fn(text_logits, ty).shape == ()


def test_cnn_learns_digits_at_world_size_2():
    # Two ranks of batch 32 with averaged gradients equal one step on their
    # concatenated batch of 64, so one process reproduces the 2-rank run.
    ds = data.load("digits")
    torch.manual_seed(0)
    m = models.build("cnn", ds.info)
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    ranks = [data.ShardSampler(ds.size("train"), 32, r, 2, seed=0) for r in range(2)]
    for _ in range(300):
        x, y = ds.batch("train", torch.cat([next(s) for s in ranks]))
        loss = models.loss_fn(m(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        right, total = models.correct(m(ds.test_x), ds.test_y)
    assert right / total >= 0.95


def test_split_cache_gives_the_same_arrays_without_splitting_again(tmp_path, monkeypatch):
    """The digits split is kept on disk: a second process reads exactly the arrays scikit-learn's split
    made, and does not split (nor import scikit-learn) again."""
    monkeypatch.setenv("COMMLAB_CACHE", str(tmp_path))
    fresh = data._cached_split("digits", ("scikit-learn",), data._digits_split)
    assert len(list(tmp_path.glob("digits-scikit-learn*-seed1234-v1.npz"))) == 1

    def must_not_split():
        raise AssertionError("split again although the cache holds it")
    kept = data._cached_split("digits", ("scikit-learn",), must_not_split)
    for a, b in zip(fresh, kept):
        assert a.dtype == b.dtype and (a == b).all()
    again = data._digits_split()
    for a, b in zip(again, kept):
        assert (a == b).all()


def test_split_cache_that_cannot_be_read_is_made_again_and_said(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("COMMLAB_CACHE", str(tmp_path))
    data._cached_split("digits", ("scikit-learn",), data._digits_split)
    (path,) = tmp_path.glob("*.npz")
    path.write_bytes(b"not a zip")
    arrays = data._cached_split("digits", ("scikit-learn",), data._digits_split)
    assert "unreadable" in capsys.readouterr().err and len(arrays[0]) == 1437
    assert len(data._cached_split("digits", ("scikit-learn",), lambda: 1 / 0)[1]) == 1437  # written again


def test_split_cache_that_cannot_be_written_is_said_and_the_data_used(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("COMMLAB_CACHE", str(blocker / "cache"))  # under a file: cannot be made
    arrays = data._cached_split("digits", ("scikit-learn",), data._digits_split)
    assert len(arrays[0]) == 1437 and "could not keep the digits split" in capsys.readouterr().err
