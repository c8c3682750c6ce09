"""Your own compressor, first class: one registry for the built-ins and yours, a class named by import path
checked as the spec checks a built-in, the conformance checks every built-in passes (and that catch what a
broken class gets wrong), and a compressor written in a scratch folder outside the repository that passes
`commlab check compressor`, trains under sync, wfbp, dear and mergecomp from the CLI, runs in commlab.wrap
and as a DDP hook, is ranked by `commlab advise`, and is queued from the New run form by the local user."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import commlab
from distutil import run_world
from commlab.engine import codepath, compressors
from commlab.engine.compressors import base, conformance, register, resolve
from commlab.engine.compressors.base import Compressor
from commlab.engine.compressors.params import Param
from commlab.engine.spec import JobSpec, SpecError
from commlab.lab.front import cli

ROOT = Path(__file__).resolve().parents[1]
PKG = "commlab_scratch_codecs"
CLASS = f"{PKG}.rr:RandomRoundHalf"
SCRATCH = '''
"""Random rounding to fp16: unbiased, summable and shape-keeping, so dear reduce-scatters it as it is."""
import torch

from commlab import Compressor, Param


class RandomRoundHalf(Compressor):
    summable = True        # fp16 values add up across ranks
    keeps_shape = True     # element i stands for element i
    counts_steps = True
    params = (Param("seed", int, 0, "seeds the rounding noise, with the bucket, the rank and the step", lo=0),)

    def __init__(self, **given):
        super().__init__(**given)
        self.step = 0

    def compress(self, t):
        seed = ((self.seed * 1_000_003 + self.bucket) * 10_007 + self.process_rank) * 100_003 + self.step
        g = torch.Generator(device=t.device).manual_seed(seed % (1 << 62))
        self.step += 1
        x = t.float()
        _, e = torch.frexp(x)
        e = torch.where(x == 0, torch.full_like(e, -13), e.clamp_min(-13))  # fp16's subnormal spacing below
        ulp = torch.ldexp(torch.ones_like(x), e - 11)
        noise = torch.rand(x.shape, generator=g, device=x.device) - 0.5
        return [(x + noise * ulp).half()], t.dtype  # dithered: rounds up as often as the remainder says

    def decompress(self, payload, ctx):
        return payload[0].to(ctx)

    def state_dict(self):
        return {**super().state_dict(), "step": self.step}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.step = int(state.get("step", 0))
'''


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A package outside the repository, on this process's path and on PYTHONPATH for the ones it starts."""
    top = tmp_path_factory.mktemp("scratch")
    (top / PKG).mkdir()
    (top / PKG / "__init__.py").write_text("")
    (top / PKG / "rr.py").write_text(textwrap.dedent(SCRATCH))
    (top / PKG / "broken.py").write_text("class NotOne:\n    pass\n\nraise_at_import = 1\n")
    sys.path.insert(0, str(top))
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(top) + (os.pathsep + old if old else "")
    yield top
    sys.path.remove(str(top))
    if old is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = old


@pytest.fixture
def registry():
    """The registry as it was, after the test."""
    before = dict(compressors.REGISTRY)
    yield compressors.REGISTRY
    compressors.REGISTRY.clear()
    compressors.REGISTRY.update(before)


# --------------------------------------------------------------------------- the registry

def test_builtins_fill_the_registry_through_register(registry):
    assert compressors.names()[:17] == ("none", "fp16", "bf16", "int8", "topk", "randomk", "threshold", "dgc",
                                        "qsgd", "terngrad", "signsgd", "efsignsgd", "signum", "onebit", "natural",
                                        "powersgd", "countsketch")
    assert all(resolve(n).name == n and issubclass(resolve(n), Compressor) for n in compressors.names())
    src = (ROOT / "commlab" / "engine" / "compressors" / "__init__.py").read_text()
    assert "register(_cls)" in src and "COMPRESSORS" not in src  # no private dict assembled beside it
    for family in ("quantize.py", "sign.py", "sparsify.py"):
        assert "COMPRESSORS" not in (ROOT / "commlab" / "engine" / "compressors" / family).read_text()


def test_register_by_name_as_a_decorator_and_its_refusals(registry):
    @register
    class Halve(Compressor):
        name = "halve"
        summable, keeps_shape = True, True

        def compress(self, t):
            return [t / 2], None

        def decompress(self, payload, ctx):
            return payload[0] * 2

    @register(name="halve2")
    class Unnamed(Halve.__base__):
        def compress(self, t):
            return [t], None

        def decompress(self, payload, ctx):
            return payload[0]

    assert compressors.names()[-2:] == ("halve", "halve2") and Unnamed.name == "halve2"
    assert compressors.make("halve").describe() == "halve"
    assert JobSpec.from_dict({"compressor": "halve2"}).compressor.name == "halve2"
    register(Halve)  # the same class again (a module reloaded): fine
    with pytest.raises(ValueError, match="^name: 'topk' is registered already, for commlab.engine.compressors.sparsify:TopK$"):
        register(type("TopK", (Compressor,), {"name": "topk"}))
    with pytest.raises(ValueError, match="^name: Halve is named 'halve'; register it under that name$"):
        register(Halve, name="other")
    with pytest.raises(ValueError, match="is not a compressor name"):
        register(type("X", (Compressor,), {}), name="a:b")
    with pytest.raises(ValueError, match="is not a Compressor subclass"):
        register(dict)


def test_a_subclass_is_named_by_its_import_path_and_its_declaration_is_checked():
    class Mine(Compressor):
        pass
    assert Mine.name == f"{__name__}:test_a_subclass_is_named_by_its_import_path_and_its_declaration_is_checked" \
                        f".<locals>.Mine"
    with pytest.raises(TypeError, match="params declares 'x' twice"):
        type("Two", (Compressor,), {"params": (Param("x", int, 1, "x", lo=0), Param("x", int, 2, "x", lo=0))})
    with pytest.raises(TypeError, match="may not declare 'error_feedback'"):
        type("EF", (Compressor,), {"params": (Param("error_feedback", bool, False, "no"),)})
    with pytest.raises(TypeError, match="params must be a tuple of"):
        type("Loose", (Compressor,), {"params": ("ratio",)})


def test_the_public_surface_exports_the_base_class():
    assert commlab.Compressor is base.Compressor and commlab.Param is Param and commlab.Round is base.Round
    assert commlab.register_compressor is register and commlab.check_compressor is conformance.check
    assert "commlab check compressor" in Compressor.__doc__ and "def compress" in Compressor.__doc__


def test_resolve_imports_a_class_by_path_with_one_line_errors(scratch):
    cls = resolve(CLASS, "compressor.name")
    assert issubclass(cls, Compressor) and cls.name == CLASS and resolve(cls) is cls
    for name, said in [(f"{PKG}.nowhere:X", f"compressor.name: cannot import '{PKG}.nowhere' (ModuleNotFoundError"),
                       (f"{PKG}.broken:Gone", f"compressor.name: module '{PKG}.broken' has no 'Gone'"),
                       (f"{PKG}.broken:NotOne", f"compressor.name: '{PKG}.broken:NotOne' is not a Compressor subclass"),
                       (f"{PKG}.broken:raise_at_import", "is not callable"),
                       ("gzip", "compressor.name: unknown compressor 'gzip'; allowed: none, fp16"),
                       ("a b:C", "compressor.name: 'a b:C' is not an import path")]:
        with pytest.raises(ValueError) as e:
            resolve(name, "compressor.name")
        assert said in str(e.value) and "\n" not in str(e.value), str(e.value)


# --------------------------------------------------------------------------- the spec

def test_the_spec_holds_a_class_to_its_declared_parameters(scratch):
    s = JobSpec.from_dict({"compressor": {"name": CLASS, "seed": 4, "error_feedback": True}, "comm": "dear"})
    assert s.compressor.params == {"seed": 4} and s.compressor.name == CLASS
    cases = [({"name": CLASS, "seed": -1}, "compressor: seed: must be an integer >= 0, got -1"),
             ({"name": CLASS, "colour": 1}, f"compressor: colour: not a parameter of {CLASS}; allowed: seed"),
             ({"name": "topk", "colour": 1}, "compressor: colour: not a parameter of topk; allowed: ratio"),
             ({"name": f"{PKG}.broken:NotOne"}, f"compressor.name: '{PKG}.broken:NotOne' is not a Compressor subclass"),
             ({"name": "none", "per_bucket": [{"below_mb": 1, "name": CLASS, "seed": 1.5}]},
              "compressor.per_bucket[0]: seed: must be an integer >= 0, got 1.5")]
    for section, said in cases:
        with pytest.raises(SpecError) as e:
            JobSpec.from_dict({"compressor": section})
        assert str(e.value).startswith(said), str(e.value)
    with pytest.raises(SpecError, match=r"^compressor\.name: comm\.mode dear reduce-scatters .*topk"):
        JobSpec.from_dict({"compressor": "topk", "comm": "dear"})


def test_where_imports_are_forbidden_a_class_is_checked_for_its_syntax_only(scratch):
    name = f"{PKG}.never_imported:Mine"
    with codepath.no_imports():
        s = JobSpec.from_dict({"compressor": {"name": name, "anything": 1}, "comm": "dear"})
        with pytest.raises(SpecError, match=r"^compressor\.name: 'a b:C' is not an import path"):
            JobSpec.from_dict({"compressor": "a b:C"})
    assert s.compressor.params == {"anything": 1} and f"{PKG}.never_imported" not in sys.modules
    assert codepath.code_fields(s.to_dict()) == [("compressor.name", name)]


# --------------------------------------------------------------------------- conformance

@pytest.mark.parametrize("name,params", [(n, {}) for n in compressors.names()[:17]] + [
    ("topk", {"ratio": 0.3}), ("powersgd", {"rank": 1, "start_iter": 0}), ("countsketch", {"exact": True}),
    ("int8", {"block": 7}), ("randomk", {"ratio": 0.5, "unbiased": True}), ("threshold", {"threshold": 0.5})])
def test_every_builtin_passes_the_conformance_checks(name, params):
    results = conformance.check(name, params)
    assert [r.check for r in results] == list(conformance.CHECKS)
    assert conformance.passed(results), "\n".join(r.line() for r in results if not r.ok)
    skipped = {r.check for r in results if r.status == "SKIP"}
    caps = compressors.make(name, **params).capabilities
    assert ("error feedback" in skipped) == caps.builtin_feedback
    assert ("dear shards" in skipped) == (caps.shard_problem() is not None)


class _Sign(Compressor):
    """Signs and a mean magnitude, honest: all-gathered."""
    summable = False

    def compress(self, t):
        mag = t.abs().mean().reshape(1) if t.numel() else t.new_zeros(1)
        return [torch.sign(t).to(torch.int8), mag], (t.shape, t.dtype)

    def decompress(self, payload, ctx):
        signs, mag = payload
        return (signs.to(ctx[1]) * mag.to(ctx[1])).view(ctx[0])


class SummableLie(_Sign):
    summable = True  # per-rank magnitudes: the sum of payloads stands for nothing


class CtxHoldsTheScale(_Sign):
    def compress(self, t):
        payload, ctx = super().compress(t)
        return [payload[0]], (*ctx, payload[1])  # decodes every rank's signs with its own magnitude

    def decompress(self, payload, ctx):
        return (payload[0].to(ctx[1]) * ctx[2].to(ctx[1])).view(ctx[0])


class AlwaysFloat32(_Sign):
    def decompress(self, payload, ctx):
        return super().decompress(payload, ctx).float()


class EmptyCrash(_Sign):
    def compress(self, t):
        t.max()  # no maximum of nothing
        return super().compress(t)


class WrongRounds(_Sign):
    rounds = 2


class Forgetful(Compressor):
    """Momentum that a checkpoint loses (not in state_dict)."""
    keeps_shape = True

    def __init__(self, **given):
        super().__init__(**given)
        self.m = None

    def compress(self, t):
        self.m = t.clone() if self.m is None else self.m * 0.5 + t
        return [self.m.clone()], None

    def decompress(self, payload, ctx):
        return payload[0]


class Reversed(Compressor):
    """Says element i stands for element i, but sends the bucket reversed: dear's shards are wrong."""
    keeps_shape = True

    def compress(self, t):
        return [t.flip(0)], None

    def decompress(self, payload, ctx):
        return payload[0].flip(0)


class ScalesItsInput(Compressor):
    """Halves the tensor it is given in place: error feedback's residual is computed from a changed tensor."""
    keeps_shape = True

    def compress(self, t):
        return [t.mul_(0.5)], None

    def decompress(self, payload, ctx):
        return payload[0] * 2


@pytest.mark.parametrize("cls,check,said", [
    (SummableLie, "aggregation", "declares summable"), (CtxHoldsTheScale, "ranks agree", "ended with another result"),
    (AlwaysFloat32, "shapes and dtypes", "float16"), (EmptyCrash, "empty and ragged", "RuntimeError"),
    (WrongRounds, "declaration", "declares 2 round(s), its exchange asked for 1"),
    (Forgetful, "state round trip", "missing from state_dict"), (Reversed, "dear shards", "differs from the whole"),
    (ScalesItsInput, "error feedback", "plus the residual is not everything fed in")])
def test_the_checks_catch_a_broken_compressor(cls, check, said):
    results = {r.check: r for r in conformance.check(cls)}
    assert results[check].status == "FAIL" and said in results[check].reason, results[check].line()
    assert "\n" not in results[check].reason


def test_an_honest_class_passes_what_the_broken_ones_fail():
    results = conformance.check(_Sign)
    assert conformance.passed(results), "\n".join(r.line() for r in results)
    assert [r.check for r in results if r.status == "SKIP"] == ["dear shards"]


def test_the_example_package_compressor_is_the_guide_s_and_passes(monkeypatch, forget_modules):
    """examples/mypkg/codecs.py is the class in Compressor's docstring (with shard_codec), and it passes."""
    forget_modules("mypkg")
    monkeypatch.syspath_prepend(str(ROOT / "examples"))  # PYTHONPATH=examples, as its docstring says
    results = conformance.check("mypkg.codecs:ScaledSign", {"scale": 0.5})
    assert {r.status for r in results} == {"PASS"}, "\n".join(r.line() for r in results)
    src = (ROOT / "examples" / "mypkg" / "codecs.py").read_text()
    for line in ("    def compress(self, t):", "        mag = t.abs().mean().reshape(1) if t.numel() else t.new_zeros(1)",
                 "        return (signs.to(dtype) * (mag.to(dtype) * self.scale)).view(shape)"):
        assert line in src and line.strip() in Compressor.__doc__


def test_check_reports_a_name_or_parameter_it_cannot_make():
    (r,) = conformance.check("topk", {"ratio": 2})
    assert (r.check, r.status, r.reason) == ("declaration", "FAIL", "ratio: must be in (0, 1], got 2")


def test_the_scratch_compressor_passes_every_check(scratch):
    results = conformance.check(CLASS, {"seed": 1})
    assert conformance.passed(results) and {r.status for r in results} == {"PASS"}, \
        "\n".join(r.line() for r in results)


def test_check_command_exit_codes_and_json(scratch, capsys):
    assert cli.main(["check", "compressor", CLASS, "--param", "seed=2", "--checks-only", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["passed"] and out["params"] == {"seed": 2} and len(out["checks"]) == len(conformance.CHECKS)
    assert cli.main(["check", "compressor", f"{__name__}:SummableLie", "--checks-only"]) == 1
    text = capsys.readouterr().out
    assert "FAIL  aggregation" in text and "1 failed" in text
    assert cli.main(["check", "compressor", CLASS, "--param", "seed=-1", "--checks-only"]) == 2
    assert capsys.readouterr().err.strip() == "commlab: error: --param: seed: must be an integer >= 0, got -1"
    assert cli.main(["check", "compressor", f"{PKG}.broken:NotOne", "--checks-only"]) == 2
    assert "is not a Compressor subclass" in capsys.readouterr().err
    assert cli.main(["check", "compressor", CLASS, "--device", "gpu", "--checks-only"]) == 2
    assert capsys.readouterr().err.strip() == "commlab: error: --device: expected cpu, cuda or cuda:N, got 'gpu'"
    assert cli.main(["check", "compressor", CLASS, "--device", "cuda:7", "--checks-only"]) == 2
    assert "commlab: error: --device: cuda:7 is not on this machine (" in capsys.readouterr().err


# --------------------------------------------------------------------------- the DDP hook

def _hook_train(rank, world, name, params):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from commlab.engine import data, models
    from commlab.engine.comm.hooks import ddp_hook
    torch.manual_seed(0)
    ds = data.load("digits", seed=0)
    m = DDP(models.build("mlp", ds.info))
    state, hook = ddp_hook(name, **params)
    m.register_comm_hook(state, hook)
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    sampler = data.ShardSampler(ds.size("train"), 16, rank, world, seed=0)
    for _ in range(4):
        x, y = ds.batch("train", next(sampler))
        opt.zero_grad()
        models.loss_fn(m(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in m.parameters()], state.bytes_sent


def test_the_scratch_compressor_runs_as_a_ddp_hook(scratch):
    (p0, b0), (p1, b1) = run_world(_hook_train, CLASS, {"seed": 1})
    for a, b in zip(p0, p1):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the ranks agree
    raw = sum(p.numel() * 4 for p in p0) * 4
    assert 0 < b0 == b1 <= raw / 2 + 1024  # fp16 on the wire


# --------------------------------------------------------------------------- end to end, from the CLI

def commlab_cli(*args, runs, timeout=300):
    env = {**os.environ, "COMMLAB_RUNS": str(runs), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "commlab.lab.front.cli", *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


SMALL = {"model": "mlp", "dataset": "digits", "world_size": 2, "steps": 8, "batch_size": 32, "eval_every": 0,
         "threads": 1, "compressor": {"name": CLASS, "seed": 5}}
MODES = {"sync": {"comm": "sync"}, "wfbp": {"comm": "wfbp"}, "dear": {"comm": "dear", "schedule": {"cap_mb": 0.05}},
         "mergecomp": {"comm": "wfbp", "schedule": {"name": "mergecomp", "warmup_steps": 1, "steps_per_candidate": 2,
                                                    "max_candidates": 3}}}


def test_the_scratch_compressor_checks_trains_everywhere_and_is_advised(scratch, tmp_path):
    """Outside the repository, on PYTHONPATH only: `commlab check compressor` passes and says where it pays,
    `commlab run` trains it under sync, wfbp, dear and mergecomp, and `commlab advise` ranks it."""
    runs = tmp_path / "runs"
    r = commlab_cli("check", "compressor", CLASS, "--param", "seed=1", "--model", "mlp", "--gbps", "0.1,10",
                    "--workers", "2,8", "--json", runs=runs)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["passed"] and out["profile"] == "mlp-digits-b32"
    mine = out["costs"][0]
    assert mine["mine"] and mine["key"] == f"{CLASS}(seed=1)" and mine["ratio"] == pytest.approx(2.0, rel=0.01)
    assert {"fp16", "int8", "powersgd r1"} <= {c["compressor"] for c in out["costs"]}
    assert [(g["gbps"], g["workers"]) for g in out["grid"]] == [(0.1, 2), (0.1, 8), (10.0, 2), (10.0, 8)]
    assert all(g["yours_ms"] > 0 and g["none_ms"] > 0 for g in out["grid"])
    assert any(g["pays"] for g in out["grid"] if g["gbps"] == 0.1)  # half the bytes on a slow link
    assert len(out["verdict"]) == 2 and out["verdict"][0].startswith("0.1 Gbit/s: pays")

    for mode, over in MODES.items():
        spec = tmp_path / f"{mode}.json"
        spec.write_text(json.dumps({**SMALL, "name": f"scratch-{mode}", **over}))
        r = commlab_cli("run", spec, "--quiet", runs=runs)
        assert r.returncode == 0, mode + ": " + r.stdout[-2000:] + r.stderr[-2000:]
    import commlab
    done = {run.spec_dict()["name"]: run for run in commlab.runs(runs=runs, state="done")}
    for mode in MODES:
        run = done[f"scratch-{mode}"]
        assert run.spec_dict()["compressor"]["name"] == CLASS
        steps = [m for m in run.metric_rows() if m.get("kind") == "step"]
        assert len(steps) == 2 * 8 and all(m["loss"] == m["loss"] for m in steps)
        assert all(m["bytes_sent"] < 0.6 * m["bytes_raw"] for m in steps), mode  # fp16 on the wire

    spec = tmp_path / "advise.json"
    spec.write_text(json.dumps({**SMALL, "name": "advise", "network": {"link": "modeled", "gbps": 0.1}}))
    r = commlab_cli("advise", spec, "--top", "0", "--candidate", "{name: %s, seed: 9}" % CLASS, runs=runs)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = [line for line in r.stdout.splitlines() if CLASS in line]
    assert any(f"{CLASS}(seed=5), bucket 25 MB, wfbp" in line for line in rows), r.stdout  # the spec's own
    assert any(f"{CLASS}(seed=9), dear 25 MB" in line for line in rows), r.stdout  # the --candidate, dear too
    profile = json.loads((runs / ".profiles" / "mlp-digits-b32.json").read_text())
    assert f"{CLASS}(seed=5)" in profile["compressors"] and "code" in profile["compressors"][f"{CLASS}(seed=5)"]


def test_a_name_registered_in_this_process_reaches_the_ranks(scratch, registry, tmp_path):
    """commlab.register_compressor in your own process, then commlab.run by that name: the ranks (other processes,
    which never ran the registration) get the class's import path; a class from a script cannot be imported
    there, and is refused before anything is queued, in one line."""
    import importlib
    import commlab
    from commlab.engine.spec import SpecError
    register(importlib.import_module(f"{PKG}.rr").RandomRoundHalf, name="rrhalf")
    run = commlab.run({**SMALL, "name": "registered", "compressor": {"name": "rrhalf", "seed": 3}}, runs=tmp_path)
    assert run.state == "done", run.log_tail(20)
    assert run.spec_dict()["compressor"] == {**run.spec_dict()["compressor"], "name": CLASS, "params": {"seed": 3}}
    assert commlab.spec({"compressor": "fp16"}).compressor.name == "fp16"  # the built-ins keep their names
    script = register(type("Scripted", (Compressor,), {"__module__": "__main__", "summable": True}), name="scripted")
    assert script.__module__ == "__main__"
    with pytest.raises(SpecError, match=r"^compressor.per_bucket\[0\].name: 'scripted' was registered by a script "
                                        r"\(__main__\), which the ranks cannot import; move Scripted into a module"):
        commlab.spec({**SMALL, "compressor": {"name": "fp16", "per_bucket": [{"below_mb": 1, "name": "scripted"}]}})
    assert [r.spec_dict()["name"] for r in commlab.runs(runs=tmp_path)] == ["registered"]


def test_commlab_wrap_trains_with_the_scratch_compressor(scratch, tmp_path):
    """Your own loop (a plain `python script.py`: a world of one) with the scratch compressor from the spec."""
    code = textwrap.dedent(f"""
        import torch, commlab
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
        spec = {{"name": "own-scratch", "steps": 4, "compressor": {{"name": "{CLASS}", "seed": 2}}}}
        with commlab.wrap(m, torch.optim.SGD(m.parameters(), lr=0.1), spec, runs="runs") as comm:
            for _ in range(4):
                x = torch.randn(16, 8)
                loss = torch.nn.functional.cross_entropy(m(x), (x[:, 0] > 0).long())
                loss.backward()
                comm.step(loss=loss)
        """)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT) + os.pathsep + os.environ["PYTHONPATH"]}
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "COMMLAB_RUNS"):
        env.pop(k, None)
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    (run_dir,) = [d for d in (tmp_path / "runs").iterdir() if d.is_dir() and not d.name.startswith(".")]
    assert json.loads((run_dir / "status.json").read_text())["state"] == "done"
    assert json.loads((run_dir / "spec.json").read_text())["compressor"]["params"] == {"seed": 2}
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in steps if m["kind"] == "step"]
    assert len(steps) == 4 and all(m["bytes_sent"] * 2 == m["bytes_raw"] for m in steps)  # fp16 on the wire


# --------------------------------------------------------------------------- the New run form

def test_the_local_user_queues_the_scratch_compressor_from_the_form(scratch, tmp_path, monkeypatch):
    pytest.importorskip("streamlit")
    from streamlit.testing.v1 import AppTest

    import commlab
    from commlab.lab.front import new_run, ui
    monkeypatch.setenv("COMMLAB_RUNS", str(tmp_path))
    at = AppTest.from_file(str(ROOT / "commlab" / "app" / "streamlit_app.py"), default_timeout=120).run()
    at.switch_page("views/new_run.py").run()
    assert at.selectbox(key="nr.comp_source").options == ["registry", new_run.IMPORT_PATH]
    at.selectbox(key="nr.model").set_value("mlp")
    at.selectbox(key="nr.comp_source").set_value(new_run.IMPORT_PATH).run()
    at.text_input(key="nr.comp_path").set_value(CLASS)
    at.text_area(key="nr.comp_params").set_value("seed: -3").run()
    assert not at.exception, [e.value for e in at.exception]
    # from the preview child, shown as text (commlab.lab.front.ui.text keeps Streamlit from turning ">=" into a symbol)
    assert [e.value for e in at.error] == [ui.text("seed: must be an integer >= 0, got -3")]
    assert at.button(key="nr.submit").disabled
    at.text_area(key="nr.comp_params").set_value("seed: 3")
    for key, v in (("nr.steps", 6), ("nr.batch_size", 16), ("nr.eval_every", 0), ("nr.threads", 1)):
        at.number_input(key=key).set_value(v)
    at.run()
    assert not at.error, [e.value for e in at.error]
    at.button(key="nr.submit").click().run()
    assert not at.exception, [e.value for e in at.exception]
    run_id = at.session_state["run_id"]
    assert commlab.wait(run_id, runs=tmp_path, timeout=240) == "done", commlab.get(run_id, runs=tmp_path).log_tail()
    c = commlab.get(run_id, runs=tmp_path).spec_dict()["compressor"]
    assert (c["name"], c["params"]) == (CLASS, {"seed": 3})
