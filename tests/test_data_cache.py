"""The caches mend themselves: the split cache (commlab.engine.data, ``$COMMLAB_CACHE``) and the performance
model's files beside the runs (cost curves, saved profiles, the properties checklist). A damaged file is
kept aside and made again, with a line on stderr, and writers at once never mix their bytes."""
import json
import threading
import time

import numpy as np
import pytest

from commlab.engine import data
from commlab.lab.strategy.perfmodel import views, whatif
from commlab.lab.base.specs import load_spec

DIGITS = ("digits", ("scikit-learn",), data._digits_split)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache directory, with no digits held in this process either."""
    monkeypatch.setenv("COMMLAB_CACHE", str(tmp_path))
    data._digits.cache_clear()
    yield tmp_path
    data._digits.cache_clear()


def kept(cache):
    (path,) = cache.glob("digits-*.npz")
    return path


def read(path):
    with open(path, "rb") as f:
        return data._read_split(f)


def damaged_then_loaded(cache, capsys, damage):
    """Make the cache, damage it with ``damage(path)``, then load digits as a run does; returns the file
    set aside and what was said."""
    data._cached_split(*DIGITS)
    path = kept(cache)
    damage(path)
    bad = path.read_bytes()
    ds = data.load("digits")
    assert ds.info.input_shape == (1, 8, 8) and ds.size("train") == 1437 and ds.size("test") == 360
    (aside,) = cache.glob("digits-*.npz.corrupt-*")
    assert aside.read_bytes() == bad  # kept as it was, under a new name
    assert read(path)[0].shape == (1437, 1, 8, 8)  # made again, whole
    assert sorted(p.name for p in cache.iterdir()) == sorted([path.name, aside.name])  # no temporary file
    err = capsys.readouterr().err
    assert f"{path}: unreadable (" in err and f"kept as {aside.name}; splitting digits again" in err
    return err


def test_a_truncated_cache_is_set_aside_and_made_again(cache, capsys):
    def truncate(path):
        b = path.read_bytes()
        path.write_bytes(b[:len(b) // 2])
    assert "BadZipFile" in damaged_then_loaded(cache, capsys, truncate)


def test_an_empty_cache_is_set_aside_and_made_again(cache, capsys):
    assert "EOFError" in damaged_then_loaded(cache, capsys, lambda path: path.write_bytes(b""))


def test_a_cache_without_its_arrays_is_set_aside_and_made_again(cache, capsys):
    def drop_the_test_split(path):
        with np.load(path) as f:
            xtr, ytr = f["xtr"], f["ytr"]
        np.savez(path, xtr=xtr, ytr=ytr)
    assert "KeyError" in damaged_then_loaded(cache, capsys, drop_the_test_split)


def test_a_cache_with_the_wrong_shapes_is_set_aside_and_made_again(cache, capsys):
    def flatten(path):
        with np.load(path) as f:
            arrays = {k: f[k] for k in data.CACHE_KEYS}
        arrays["xtr"] = arrays["xtr"].reshape(len(arrays["xtr"]), -1)
        np.savez(path, **arrays)
    assert "not a split of images" in damaged_then_loaded(cache, capsys, flatten)


def test_two_writers_at_once_each_write_their_own_file_and_the_last_one_wins_whole(cache, monkeypatch, capsys):
    real = data._digits_split()
    made = {i: tuple(a + i if a.dtype == np.float32 else a for a in real) for i in (1, 2)}  # told apart by x
    both_writing = threading.Barrier(2, timeout=20)
    savez = np.savez

    def savez_together(f, **arrays):  # both files are open before either is written
        both_writing.wait()
        savez(f, **arrays)
    monkeypatch.setattr(np, "savez", savez_together)
    got, errors = {}, []

    def writer(i):
        try:
            got[i] = data._cached_split("digits", ("scikit-learn",), lambda: made[i])
        except BaseException as e:  # a thread's error must fail the test: checked below
            errors.append(e)
    threads = [threading.Thread(target=writer, args=(i,)) for i in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and set(got) == {1, 2}
    for i in (1, 2):
        assert all((a == b).all() for a, b in zip(got[i], made[i]))  # each caller got its arrays, whole
    monkeypatch.undo()
    on_disk = read(kept(cache))
    assert any(all((a == b).all() for a, b in zip(on_disk, made[i])) for i in (1, 2))  # one writer's, whole
    assert [p.name for p in cache.iterdir()] == [kept(cache).name]  # no temporary file left
    assert capsys.readouterr().err == ""  # neither writer failed


# --------------------------------------------------------------------------- the performance model's caches

CURVE = {"encode": [1e-5, 1e-10], "between": [0.0, 0.0], "decode": [2e-5, 1e-10], "sizes": [4, 8]}


def aside_of(path):
    (aside,) = path.parent.glob(f"{path.name}.corrupt-*")
    return aside


@pytest.mark.parametrize("bad", ['{"m": {"fp16": {"encode": [1e-5', '["curves"]',
                                 '{MACHINE: {"fp16": {"encode": "fast", "between": [0, 0], "decode": [0, 0]}}}'])
def test_damaged_cost_curves_are_set_aside_and_measured_again(tmp_path, capsys, bad):
    bad = bad.replace("MACHINE", json.dumps(whatif.machine_key()))  # this machine's curve: the one it would use
    path = whatif.profile_dir(tmp_path) / whatif.CURVES
    path.parent.mkdir()
    path.write_text(bad)
    assert whatif.machine_curves(tmp_path) == {}
    assert aside_of(path).read_text() == bad and not path.exists()
    assert f"{path}: unreadable (" in capsys.readouterr().err
    whatif.keep_machine_curves(tmp_path, {"fp16": CURVE})
    assert whatif.machine_curves(tmp_path) == {"fp16": CURVE}


def test_two_advisers_keeping_curves_at_once_keep_both(tmp_path, monkeypatch):
    write = whatif.write_json_atomic

    def slow_write(path, obj, **kw):  # the second adviser reads while the first is still writing
        time.sleep(0.3)
        write(path, obj, **kw)
    monkeypatch.setattr(whatif, "write_json_atomic", slow_write)
    threads = [threading.Thread(target=whatif.keep_machine_curves, args=(tmp_path, {k: CURVE}))
               for k in ("fp16", "topk")]
    for t in threads:
        t.start()
        time.sleep(0.1)
    for t in threads:
        t.join(30)
    assert set(whatif.machine_curves(tmp_path)) == {"fp16", "topk"}


def test_a_damaged_saved_profile_is_set_aside_and_not_used(tmp_path, capsys):
    spec = load_spec(data={"model": "mlp", "dataset": "digits", "batch_size": 16}).to_dict()
    saved = whatif.profile_dir(tmp_path) / "mlp-digits-b16.json"
    saved.parent.mkdir()
    saved.write_text('{"model": "mlp", "dataset": "dig')
    assert whatif.known_profile(spec, tmp_path) is None  # no profile and no run: it will be measured
    assert aside_of(saved).read_text() == '{"model": "mlp", "dataset": "dig' and not saved.exists()
    assert f"{saved}: unreadable (JSONDecodeError" in capsys.readouterr().err


def test_a_damaged_properties_checklist_is_set_aside_and_taken_as_not_measured(tmp_path, capsys):
    f = views.properties_file(tmp_path)
    f.parent.mkdir()
    f.write_text('[{"compressor": "fp16", "rat')
    assert views.load_properties(tmp_path) is None
    assert aside_of(f).read_text() == '[{"compressor": "fp16", "rat'
    assert f"{f}: unreadable (JSONDecodeError" in capsys.readouterr().err
    f.write_text(json.dumps([{"compressor": "fp16"}]))
    assert views.load_properties(tmp_path) == [{"compressor": "fp16"}]
