import functools
import importlib
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("OMP_NUM_THREADS", "1")
# AppTest runs the app with no server address, which on a real server means every interface and so
# sign-in (commlab/room/accounts.py); the tests use it as `commlab app` does on loopback unless they say otherwise.
os.environ.setdefault("COMMLAB_ACCESS", "off")
torch.set_num_threads(1)


# --------------------------------------------------------------------------- Streamlit deprecations
# Streamlit reports a deprecated call (use_container_width=..., an old name, ...) through
# streamlit.deprecation_util.show_deprecation_warning: it always logs a WARNING on the logger
# "streamlit.deprecation_util" (its own logger, propagate=False) and, for some calls, also draws
# an st.warning in the page. It never uses the warnings module, so pytest's filterwarnings cannot
# catch it. Every test (AppTest runs the pages in this process) therefore records that logger
# and fails when anything was logged.
import logging  # noqa: E402

import pytest  # noqa: E402

STREAMLIT_DEPRECATION_LOGGER = "streamlit.deprecation_util"


class StreamlitDeprecations(logging.Handler):
    """Records Streamlit's deprecation warnings while entered; ``check()`` fails the test on any."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []
        self._logger = logging.getLogger(STREAMLIT_DEPRECATION_LOGGER)  # the same object Streamlit's get_logger returns
        self._lowered_from = None

    def emit(self, record):
        self.messages.append(record.getMessage())

    def __enter__(self):
        shown = getattr(sys.modules.get(STREAMLIT_DEPRECATION_LOGGER), "_shown_warnings", None)
        if shown is not None:
            shown.clear()  # show_once warnings seen by an earlier test would otherwise stay silent here
        if self._logger.getEffectiveLevel() > logging.WARNING:  # e.g. --logger.level=error
            self._lowered_from = self._logger.level
            self._logger.setLevel(logging.WARNING)
        self._logger.addHandler(self)
        return self

    def __exit__(self, *exc):
        self._logger.removeHandler(self)
        if self._lowered_from is not None:
            self._logger.setLevel(self._lowered_from)
        return False

    def check(self):
        if self.messages:
            first = " ".join(self.messages[0].split())
            more = f" (and {len(self.messages) - 1} more)" if len(self.messages) > 1 else ""
            pytest.fail(f"Streamlit deprecation warning: {first}{more}", pytrace=False)


@pytest.fixture(autouse=True)
def streamlit_deprecations():
    """Fails any test during which Streamlit reported a deprecated call (the call phase through
    the hook below; what only fixture teardown logs, here)."""
    with StreamlitDeprecations() as rec:
        yield rec
    rec.check()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    rec = getattr(item, "funcargs", {}).get("streamlit_deprecations")
    result = yield  # the test body's own exception, if any, propagates and wins
    if rec is not None and rec.messages:
        try:
            rec.check()
        finally:
            rec.messages.clear()  # reported once, as the test's failure
    return result


# --------------------------------------------------------------------------- Streamlit's component scan, once
# Each new AppTest scans every installed distribution's metadata for Streamlit component manifests (about half a
# second here; a third of the CPU of the page tests in a profile). A server does it once at its start; the suite
# installs nothing while it runs, so each test process scans once and every AppTest reads that result.
def _scan_once():
    try:
        from streamlit.components.v2 import manifest_scanner
    except ImportError:  # a Streamlit without v2 components: nothing to scan
        return
    scan = manifest_scanner.scan_component_manifests
    once = functools.lru_cache(maxsize=1)(lambda: tuple(scan()))

    def scanned(*args, **kwargs):
        return scan(*args, **kwargs) if args or kwargs else list(once())
    manifest_scanner.scan_component_manifests = scanned


_scan_once()


# --------------------------------------------------------------------------- compressor tests on a GPU
# COMMLAB_TEST_DEVICE=cuda runs the compressor tests' inputs on that device: inside the modules below,
# ``torch``'s factory functions (randn, zeros, arange, tensor, ...) create on it unless a test names a
# device. Only the tests' own tensors move; the compressors' code sees the real torch, as in a run, so
# a compressor that allocates on the default device instead of its input's fails here.
TEST_DEVICE = os.environ.get("COMMLAB_TEST_DEVICE", "")
DEVICE_MODULES = ("test_compressors_common", "test_compressors_sparse", "test_compressors_quantize",
                  "test_compressor_buffers", "test_compressor_capabilities", "test_powersgd_layout")
FACTORIES = ("randn", "rand", "randint", "randperm", "zeros", "ones", "empty", "full", "arange", "linspace",
             "tensor", "as_tensor", "eye")


class _OnDevice:
    """The torch module, with its factory functions defaulting to ``device``."""

    def __init__(self, device):
        self._device = device

    def __getattr__(self, name):
        attr = getattr(torch, name)
        if name in FACTORIES:
            def factory(*args, **kwargs):
                g = kwargs.get("generator")  # a test's own generator decides where its draws are made
                kwargs.setdefault("device", g.device if g is not None else self._device)
                return attr(*args, **kwargs)
            return factory
        return attr


@pytest.fixture(autouse=True)
def sandbox_places(monkeypatch):
    """Each test starts with nobody's child time counted (commlab.room.places.Places keeps it per person for
    BUDGET_WINDOW_S): the suite's students, alice most of all, would otherwise carry one test's previews
    into the next one's budget."""
    from commlab.room import places
    monkeypatch.setattr(places, "_places", places.Places())


@pytest.fixture(autouse=True)
def compressor_test_device(request, monkeypatch):
    if not TEST_DEVICE:
        yield None
        return
    name = request.module.__name__.rsplit(".", 1)[-1]
    if name not in DEVICE_MODULES:
        pytest.skip(f"COMMLAB_TEST_DEVICE={TEST_DEVICE} runs only the compressor tests")
    monkeypatch.setattr(request.module, "torch", _OnDevice(torch.device(TEST_DEVICE)))
    yield TEST_DEVICE



@pytest.fixture
def forget_modules(monkeypatch):
    """forget_modules("mypkg"): the package's cached modules are gone for this test, and its own after it.

    Two tests may each put a different ``mypkg`` on sys.path; without this the
    second would get the first one's modules from ``sys.modules``.
    """
    tops = []

    def forget(top):
        tops.append(top)
        for name in [n for n in sys.modules if n == top or n.startswith(top + ".")]:
            monkeypatch.delitem(sys.modules, name)
        importlib.invalidate_caches()

    yield forget
    for top in tops:  # what the test imported; monkeypatch then puts back what was there before
        for name in [n for n in sys.modules if n == top or n.startswith(top + ".")]:
            del sys.modules[name]


# --------------------------------------------------------------------------- the order and lanes tests run in
# The suite runs on three xdist workers with `--dist loadgroup` (pyproject.toml) on a 2-core machine: two lanes
# for the tests that keep a core busy and one for the tests that mostly wait (PACED). The few tests that take a
# minute or more start first, so that the end of the suite is many short tests, not one long one. Only the order
# and the worker a test runs on change.
FIRST = ("tests/test_notebooks.py::test_runs_top_to_bottom", "tests/test_presets_train.py::",
         "tests/test_browser.py::", "tests/test_browser_workshop.py::",
         "tests/test_plugin_compressor.py::test_the_scratch_compressor", "tests/test_models_ext.py::test_hf_gpt2",
         "tests/test_compressors_train.py::", "tests/test_methods.py::test_wrap_", "tests/test_own_loop.py::")

# Tests that spend most of their time waiting: on a modeled or shaped link that paces a fault-tolerant run while a
# replica is killed and restarted, on a child's wall-time limit, on a server. Run one after the other each used less
# than half of one core, most of them a fifth or less (the machine's CPU counters around each test, the suite run in
# one process: docs/reference/tests.md). They run on one worker, one after the other; a file whose module fixture
# they share is here whole, so that the fixture is built once.
PACED = ("tests/test_notebooks.py::test_runs_top_to_bottom[07_pull_the_plug]",
         "tests/test_notebooks.py::test_runs_top_to_bottom[08_across_the_internet]",
         "tests/test_presets_train.py::test_preset_runs_train[across-the-internet]",
         "tests/test_presets_train.py::test_preset_runs_train[compression-links]",
         "tests/test_ft_run.py::", "tests/test_ft_methods.py::test_a_killed_diloco_replica", "tests/test_ft_cut.py::",
         "tests/test_own_loop_ft.py::", "tests/test_multinode.py::test_a_fault_tolerant_run_over_two_nodes",
         "tests/test_safe_room.py::test_a_preview_child_is_stopped_at_its_limit[sleeps]",
         "tests/test_safe_room.py::test_children_are_bounded_per_person_and_per_server",
         "tests/test_accounts.py::test_served_over_tls_with_the_teachers_certificate",
         "tests/test_autoprofile.py::test_strategy_auto_profiles_in_the_run",
         "tests/test_advisor.py::test_strategy_auto_", "tests/test_cluster.py::test_strategy_auto_chooses_on_a_cluster",
         "tests/test_room_text.py::test_a_student_sending_previews_back_to_back_holds_one_place",
         "tests/test_workshop.py::test_a_supervisor_far_back_waits_without_importing_torch")


def _nodeid(nodeid):
    return nodeid if nodeid.startswith("tests/") else "tests/" + nodeid


def unmatched(nodeids):
    """The prefixes of FIRST and PACED that match none of ``nodeids`` though their file is among them: a test
    renamed or a parameter changed, which would drop it silently out of its place."""
    ids = [_nodeid(n) for n in nodeids]
    files = {n.partition("::")[0] for n in ids}
    return [p for p in FIRST + PACED if p.partition("::")[0] in files and not any(n.startswith(p) for n in ids)]


def pytest_collection_modifyitems(config, items):
    def rank(item):
        return next((i for i, prefix in enumerate(FIRST) if _nodeid(item.nodeid).startswith(prefix)), len(FIRST))
    items.sort(key=rank)  # stable: within a rank, the collected order


def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup``, its one group being PACED. (xdist's own loadgroup reads ``xdist_group`` marks and
    groups by a suffix it writes into the node id, which pytest 9's node ids no longer take.)"""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Lanes(LoadScopeScheduling):
        # a work unit is a test, or all of PACED; the unit with the most tests goes out first, to a worker of
        # its own, and a worker is given another unit when it has two tests or fewer left
        def _split_scope(self, nodeid):
            return "paced" if _nodeid(nodeid).startswith(PACED) else nodeid

    return Lanes(config, log)


# --------------------------------------------------------------------------- torch DDP's reference, run once
# tests/test_own_loop.py and tests/test_methods.py each compare a commlab.wrap run of examples/own_loop.py with the
# same script under torch DDP (--ddp, 10 steps, world size 2): a deterministic run that every such test used to
# start again (a torchrun, about 10 s of two cores). It runs once for the whole suite: the first xdist worker to
# need it runs it under a lock in the directory the workers share, the others read what it left.
from distutil import OWN_LOOP_DDP_STEPS, torchrun_own_loop  # noqa: E402


class OwnLoopDDP:
    """``returncode`` and ``stdout`` of that torchrun; each rank's final parameters in ``f"{save}.rank{r}"``."""

    def __init__(self, save, returncode, stdout):
        self.save, self.returncode, self.stdout = save, returncode, stdout


@pytest.fixture(scope="session")
def own_loop_ddp(tmp_path_factory):
    import fcntl
    import json
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    where = shared / "own-loop-ddp"
    where.mkdir(exist_ok=True)
    save, done = where / "ddp", where / "done.json"
    with open(where / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            p = torchrun_own_loop(where, "--ddp", "--steps", OWN_LOOP_DDP_STEPS, "--save", save)
            done.write_text(json.dumps({"returncode": p.returncode, "stdout": p.stdout}))
        got = json.loads(done.read_text())
    return OwnLoopDDP(save, got["returncode"], got["stdout"])
