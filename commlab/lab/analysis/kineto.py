"""A PyTorch profiler trace of your own job, read into the lab's timeline frame.

``torch.profiler`` writes a Kineto trace (Chrome trace JSON, by ``prof.export_chrome_trace(path)`` or
``torch.profiler.tensorboard_trace_handler(dir)``), one file per rank. ``read_trace`` turns those files into the
frame ``commlab.lab.rundir.store.Run.timeline`` returns for the lab's own runs (rank, lane, name, start_us, dur_us
and args columns; the lanes of ``commlab.engine.timeline.LANES``), so the lab's analysis explains a job it did not
run: ``breakdown`` is the lab's per-step breakdown (``commlab.lab.analysis.plots.step_breakdown``) of that frame,
``comm_overlap`` the share of communication hidden under computation.

What is recognised, on the host (CPU) side:

- ``step``: one span per ``ProfilerStep#N`` of the training thread (the thread that holds them), with ``step`` = N.
- ``backward``: the autograd engine's ``autograd::engine::evaluate_function: ...`` spans (the outermost on their
  thread: the training thread on CPU, the autograd device threads on GPU), and the training thread's top-level
  ops from the first of them to the optimizer (DDP's finalisation: ``copy_bucket_to_grad``).
- ``optimizer``: ``Optimizer.step#...`` and ``Optimizer.zero_grad#...`` spans (the lab's optimizer span holds both),
  and the training thread's top-level ops after the optimizer's step (a scheduler's step, ``loss.item()``).
- ``forward``: the training thread's top-level ops of a step before its backward and optimizer (the model's
  module spans such as ``DistributedDataParallel.forward``, the loss's aten ops). A span that encloses backward or
  optimizer spans (a ``record_function`` around the whole step) is looked into, not taken whole; the data
  loader's ``enumerate(DataLoader)...`` spans are left out.
- ``comm``: the collectives: ``gloo:*`` spans (gloo's own threads, where the transfer runs) and ``nccl:*``
  spans; a trace with neither gives ``record_param_comms`` spans, and one without those the ``c10d::*`` ops. Each
  has ``op`` (allreduce, allgather, reduce_scatter, alltoall, broadcast, ...) and ``bytes`` when the trace gives
  sizes (``In msg nelems`` and ``dtype``, or the input's dims and type when the profiler recorded shapes).
- ``wait``: spans named ``c10d::wait``, ``aten::wait``, ``..::wait_tensor``; and, where a step has none, the
  training thread's idle stretches (``WAIT_MIN_US`` or longer) between the end of backward and the optimizer while
  its collectives are in flight (DDP's finalisation waits on the buckets' Work there, which the profiler does not
  mark): ``inferred`` is True.
- ``compress``/``decompress``: only spans a comm hook marks itself, ``record_function("compress...")`` or
  ``"encode..."`` and ``"decompress..."`` or ``"decode..."``: torch's own hooks mark nothing, so their encoding
  counts as the phase it runs in.

On a GPU trace (one with ``kernel`` events) the frame is the GPU's (``device="gpu"``, the default there): each
compute kernel, memcpy and memset is on the lane of the host phase that launched it (the launch's ``correlation``
id; the launch inside a backward, optimizer, compress or decompress span, else by where it falls in its step), the
NCCL kernels (``nccl*Kernel*``) on ``comm`` with ``op`` and ``bytes`` (the kernel's own ``Collective name``,
``In msg nelems`` and ``dtype``, else the host span that launched it), every kernel with its ``stream``. A step
span is the GPU's step: from the first kernel the step launched to the first kernel of the next step (the last
step: to the end of its last kernel), so the steps tile the GPU's time as the lab's CUDA timeline measures it
(``host_start_us``/``host_dur_us`` keep the profiler step's host window). Kernels launched outside the profiler's
steps are left out. A GPU frame has no ``wait`` spans: a GPU waiting on a collective is its compute stream idle
until the NCCL kernel ends, which is the exposed communication already. ``device="cpu"`` reads a GPU trace's host side instead (the NCCL collectives are then the
short host spans that enqueue them).

Every span has ``device`` ("cpu" or "gpu"), ``step`` (the profiler step it belongs to: the step window its host
span starts in, or the step that launched a kernel), and ``thread`` (host spans) or ``stream`` (kernels).
Times are microseconds on the trace's clock plus its ``baseTimeNanoseconds``: the wall clock, as the lab's own
timelines are, so the ranks of one machine share a time base.

Compared with Holistic Trace Analysis (HTA, ``hta.trace_analysis.TraceAnalysis``) on the same GPU trace, with
``include_last_profiler_step=True``, summed over the steps: the steps add up to HTA's ``kernel_time`` (first kernel
to last), and ``other_ms`` is its ``idle_time``. They differ by definition on copies: HTA counts memcpy and memset
as non-compute, the lab as compute of the phase that launched them (as its CUDA timeline does), so
``compute_ms`` is HTA's ``compute_time`` plus the copies, and ``compute_ms + exposed_comm_ms`` is its
``compute_time + non_compute_time``. With the frame's ``kind == "memory"`` rows left out, ``compute_ms`` is
HTA's ``compute_time`` and ``comm_overlap`` its ``comp_comm_overlap_ratio``; ``other_ms`` then also holds the time
only copies run, which HTA's ``non_compute_time`` holds beside ``exposed_comm_ms``. HTA also rounds every event inward to
whole microseconds (start up, end down) unless ``HTA_DISABLE_NS_ROUNDING=1``: on a trace with sub-microsecond
times that takes up to a microsecond off every kernel, which HTA then counts as idle. It leaves out the last
profiler step by default (``include_last_profiler_step=False``) and counts over the whole trace, not per step; a
kernel of one step that still runs when the next step's first kernel starts is cut at that start here, and
counted whole there. tests/test_kineto.py checks the agreement on a synthetic trace, to 1 us a figure.
"""
from __future__ import annotations

import bisect
import gzip
import json
import math
import re
import zlib
from collections import Counter
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple, Union

import numpy as np
import pandas as pd

from commlab.engine.timeline import LANES
from commlab.lab.analysis import plots
from commlab.lab.base.errors import LabError

PathLike = Union[str, Path]

DEVICE_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
"""Event categories that ran on the GPU (``gpu_user_annotation``, the GPU's copy of host annotations, is skipped)."""
HOST_CATS = frozenset({"cpu_op", "user_annotation"})
"""Host spans that are read (``python_function`` spans, with ``with_stack=True``, enclose everything: skipped)."""
LAUNCH_CATS = frozenset({"cuda_runtime", "cuda_driver"})
"""Host calls that launch GPU work; a kernel's ``correlation`` names its launch."""

STEP_RE = re.compile(r"^ProfilerStep\s*#\s*(\d+)$")
BACKWARD_PREFIX = "autograd::engine::evaluate_function"
OPTIMIZER_RE = re.compile(r"^Optimizer\.(step|zero_grad)#")
OPTIMIZER_STEP_PREFIX = "Optimizer.step#"
LOADER_PREFIX = "enumerate(DataLoader)"
COMM_KERNEL_RE = re.compile(r"^nccl.*Kernel")
"""HTA's test for a communication kernel (``ncclKernel_AllReduce_...``, ``ncclDevKernel_AllGather_...``)."""
C10D_RE = re.compile(r"^c10d::(all_?reduce|all_?gather|_allgather_base|allgather_into_tensor_coalesced|"
                     r"reduce_?scatter|_reduce_scatter_base|reduce_scatter_tensor_coalesced|alltoall|alltoall_base|"
                     r"broadcast|reduce|gather|scatter|send|recv|recv_any_source|barrier)_?$")
WAIT_RE = re.compile(r"(^c10d::wait$)|(^aten::wait$)|(::wait_tensor$)|(^wait_tensor$)")
COMPRESS_RE = re.compile(r"^(compress|encode)", re.I)
DECOMPRESS_RE = re.compile(r"^(decompress|decode)", re.I)

OPS = (("reduce_scatter", "reduce_scatter"), ("reducescatter", "reduce_scatter"), ("allreduce", "allreduce"),
       ("all_reduce", "allreduce"), ("allgather", "allgather"), ("all_gather", "allgather"),
       ("alltoall", "alltoall"), ("all_to_all", "alltoall"), ("sendrecv", "sendrecv"), ("broadcast", "broadcast"),
       ("barrier", "barrier"), ("reduce", "reduce"), ("gather", "gather"), ("scatter", "scatter"),
       ("send", "send"), ("recv", "recv"))
"""Collective names, as the lab's comm spans call them, by the first that a lowered name contains."""

DTYPE_BYTES = {"float": 4, "float32": 4, "double": 8, "float64": 8, "half": 2, "float16": 2, "bfloat16": 2,
               "int": 4, "int32": 4, "long": 8, "long int": 8, "int64": 8, "short": 2, "short int": 2, "int16": 2,
               "char": 1, "signed char": 1, "int8": 1, "byte": 1, "unsigned char": 1, "uint8": 1, "bool": 1,
               "complexfloat": 8, "complexdouble": 16, "float8_e4m3fn": 1, "float8_e5m2": 1,
               "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1, "f32": 4, "f16": 2, "bf16": 2, "i8": 1, "u8": 1}
"""Element sizes by the dtype names Kineto writes (``dtype``: "Float", "BFloat16"; ``Input type``: "float",
"c10::BFloat16", "long int"), lowered and without ``c10::``."""

LANE_ORDER = {name: i for i, name in enumerate(LANES)}
WAIT_MIN_US = 20.0
"""An inferred wait is an idle stretch of the training thread at least this long: the few microseconds between
two of DDP's copies while a bucket is still in flight are the framework's own time, not a wait."""


# --------------------------------------------------------------------------- reading files

def trace_files(paths: Union[PathLike, Iterable[PathLike]]) -> List[Path]:
    """The trace files ``paths`` names: a file, a directory (its ``*.json`` and ``*.json.gz`` files, by name, as
    ``tensorboard_trace_handler`` writes them), or a list of those, in order."""
    items = [paths] if isinstance(paths, (str, Path)) else list(paths)
    out: List[Path] = []
    for item in items:
        p = Path(item)
        if p.is_dir():
            found = sorted(f for f in p.iterdir() if f.is_file() and f.name.endswith((".json", ".json.gz")))
            if not found:
                raise LabError(f"{p}: no trace files (*.json, *.json.gz) in this directory")
            out.extend(found)
        elif p.is_file():
            out.append(p)
        else:
            raise LabError(f"{p}: no such trace file")
    if not out:
        raise LabError("no trace files given")
    return out


def load(path: Path) -> dict:
    """A trace file's JSON object (gzip read when the file is gzipped); LabError, in one line, when it is not one
    of a profiler's traces."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise LabError(f"{path}: cannot be read: {e.strerror or e}") from None
    try:
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
        doc = json.loads(raw)
    except (ValueError, EOFError, OSError, zlib.error) as e:  # JSONDecodeError, UnicodeDecodeError, a torn gzip
        raise LabError(f"{path}: not a JSON trace ({' '.join(str(e).split())})") from None
    if isinstance(doc, list):  # the Chrome format's bare array of events
        doc = {"traceEvents": doc}
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise LabError(f"{path}: no traceEvents: not a PyTorch profiler (Kineto) trace")
    return doc


def _rank_of(doc: dict) -> Optional[int]:
    info = doc.get("distributedInfo")
    if isinstance(info, dict):
        r = info.get("rank")
        if isinstance(r, (int, float)) and not isinstance(r, bool) and r >= 0:
            return int(r)
    return None


# --------------------------------------------------------------------------- names and sizes

def op_of(name: str, args: Optional[dict] = None) -> Optional[str]:
    """A collective's op (allreduce, allgather, ...) from its args' ``Collective name`` or its span's name."""
    coll = (args or {}).get("Collective name")
    for text in (coll, name):
        if isinstance(text, str) and text:
            low = text.lower()
            if low.startswith("nccl") and "kernel" in low:  # ncclDevKernel_AllReduce_Sum_f32_RING_LL(...)
                low = low.split("(")[0]
            for key, op in OPS:
                if key in low:
                    return op
    return None


def _elem_bytes(dtype) -> Optional[int]:
    if not isinstance(dtype, str):
        return None
    return DTYPE_BYTES.get(dtype.lower().replace("c10::", "").strip())


def _numel(dims) -> Optional[int]:
    """Elements of an ``Input Dims`` entry: a tensor's shape ([68362]) or a tensor list's shapes ([[68362]])."""
    if not isinstance(dims, list):
        return None
    if all(isinstance(d, (int, float)) for d in dims):
        return int(np.prod(dims)) if dims else 1
    total = 0
    for d in dims:
        n = _numel(d)
        if n is None:
            return None
        total += n
    return total


def bytes_of(args: Optional[dict]) -> Optional[int]:
    """A collective's message size in bytes (its input, what this rank contributes), from Kineto's ``In msg
    nelems`` and ``dtype``, or from the first input's ``Input Dims`` and ``Input type``; None when the trace
    does not say."""
    if not args:
        return None
    n, size = args.get("In msg nelems"), _elem_bytes(args.get("dtype"))
    if isinstance(n, (int, float)) and size:
        return int(n) * size
    dims, types = args.get("Input Dims"), args.get("Input type")
    if isinstance(dims, list) and dims and isinstance(types, list) and types:
        size, n = _elem_bytes(types[0]), _numel(dims[0])
        if size and n is not None:
            return n * size
    return None


# --------------------------------------------------------------------------- one rank's trace

def _kind(e: dict) -> Optional[str]:
    """What a host span's name makes it: step, backward, optimizer, lib (gloo:/nccl:), rpc (record_param_comms),
    c10d (a c10d collective op), wait, compress, decompress, loader; None for a plain op."""
    name = e.get("name")
    if not isinstance(name, str):
        return None
    if name.startswith("ProfilerStep"):
        return "step" if STEP_RE.match(name) else None
    if name.startswith(BACKWARD_PREFIX):
        return "backward"
    if name.startswith("Optimizer."):
        return "optimizer" if OPTIMIZER_RE.match(name) else None
    if name.startswith(("gloo:", "nccl:")):
        return "lib"
    if name == "record_param_comms":
        return "rpc"
    if name.startswith("c10d::") and C10D_RE.match(name):
        return "c10d"
    if "wait" in name and WAIT_RE.search(name):
        return "wait"
    if name.startswith(LOADER_PREFIX):
        return "loader"
    if e.get("cat") == "user_annotation":
        if DECOMPRESS_RE.match(name):
            return "decompress"
        if COMPRESS_RE.match(name):
            return "compress"
    return None


def _outermost(spans: List[dict]) -> List[dict]:
    """The spans not inside another of ``spans`` on the same thread."""
    out, end = [], {}
    for e in sorted(spans, key=lambda e: (e["tid"], e["ts"], -e["dur"])):
        if e["ts"] >= end.get(e["tid"], -math.inf):
            out.append(e)
            end[e["tid"]] = e["ts"] + e["dur"]
    return out


def _union(iv: Iterable[Tuple[float, float]]) -> List[Tuple[float, float]]:
    out: List[List[float]] = []
    for s, e in sorted(iv):
        if e <= s:
            continue
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _minus(a: List[Tuple[float, float]], b: List[Tuple[float, float]]) -> List[Tuple[float, float]]:
    """Merged intervals ``a`` less merged intervals ``b``."""
    out, j = [], 0
    for s, e in a:
        while j < len(b) and b[j][1] <= s:
            j += 1
        k, cur = j, s
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            out.append((cur, e))
    return out


def _intersect(a: List[Tuple[float, float]], b: List[Tuple[float, float]]) -> List[Tuple[float, float]]:
    i = j = 0
    out = []
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


class _Rank:
    """One rank's trace, its events sorted out; ``rows(device)`` are its frame rows."""

    def __init__(self, path: Path, doc: dict, rank: int):
        self.path, self.rank = path, rank
        base = doc.get("baseTimeNanoseconds")
        self.base = float(base) / 1e3 if isinstance(base, (int, float)) and not isinstance(base, bool) else 0.0
        host: List[dict] = []
        self.kernels: List[dict] = []
        self.launches: Dict[int, dict] = {}
        for e in doc["traceEvents"]:
            if not isinstance(e, dict) or e.get("ph") != "X":
                continue
            cat, ts, dur = e.get("cat"), e.get("ts"), e.get("dur")
            if not isinstance(ts, (int, float)) or not isinstance(dur, (int, float)) or dur < 0:
                continue
            if cat in HOST_CATS:
                host.append(e)
            elif cat in DEVICE_CATS:
                self.kernels.append(e)
            elif cat in LAUNCH_CATS:
                corr = (e.get("args") or {}).get("correlation")
                if isinstance(corr, int):
                    self.launches[corr] = e
        steps = []
        for e in host:
            name = e.get("name")
            m = STEP_RE.match(name) if isinstance(name, str) and name.startswith("ProfilerStep") else None
            if m:
                steps.append((e, int(m.group(1))))
        if not steps:
            raise LabError(f"{path}: no ProfilerStep spans: record with torch.profiler.schedule(...) and call "
                           f"prof.step() after every training step")
        self.main = Counter(e["tid"] for e, _ in steps).most_common(1)[0][0]
        steps = sorted(((e, n) for e, n in steps if e["tid"] == self.main), key=lambda s: s[0]["ts"])
        self.steps = []  # (number, start, end, event), one per step number
        seen = set()
        for e, n in steps:
            if n not in seen:
                seen.add(n)
                self.steps.append((n, float(e["ts"]), float(e["ts"] + e["dur"]), e))
        self.starts = [s[1] for s in self.steps]
        self.host = host
        self._sort_host()

    # -- host side ----------------------------------------------------------
    def step_at(self, ts: float) -> Optional[int]:
        """Index (in self.steps) of the step whose host window holds ``ts``, or None."""
        i = bisect.bisect_right(self.starts, ts) - 1
        if i >= 0 and ts <= self.steps[i][2]:
            return i
        return None

    def _sort_host(self):
        backward, optimizer, waits, compress, decompress = [], [], [], [], []
        tiers: Dict[str, List[dict]] = {"lib": [], "rpc": [], "c10d": []}
        lists = {"backward": backward, "optimizer": optimizer, "wait": waits, "compress": compress,
                 "decompress": decompress, **tiers}
        self.kinds: Dict[int, str] = {}
        """id(event) -> what its name makes it (``_kind``), for the host events that are not plain ops."""
        for e in self.host:
            kind = _kind(e)
            if kind is not None:
                self.kinds[id(e)] = kind
                if kind in lists:
                    lists[kind].append(e)
        self.backward = _outermost(backward)
        self.optimizer = _outermost(optimizer)
        self.waits = _outermost(waits)
        self.compress, self.decompress = _outermost(compress), _outermost(decompress)
        tier = next((t for t in ("lib", "rpc", "c10d") if tiers[t]), "lib")
        self.comm = _outermost(tiers[tier])
        self.sized = sorted((e for t in tiers.values() for e in t if bytes_of(e.get("args"))),
                            key=lambda e: (e["tid"], e["ts"]))
        """Host collective spans that carry sizes, to size the kernels they launch."""
        # per step: where its backward and its optimizer's step begin (any thread), for the position rule
        n = len(self.steps)
        self.b0, self.o0 = [math.inf] * n, [math.inf] * n
        for e in self.backward:
            i = self.step_at(e["ts"])
            if i is not None:
                self.b0[i] = min(self.b0[i], e["ts"])
        for e in self.optimizer:
            i = self.step_at(e["ts"])
            if i is not None and e["name"].startswith(OPTIMIZER_STEP_PREFIX):
                self.o0[i] = min(self.o0[i], e["ts"])
        self._top_level()

    def phase_at(self, i: int, ts: float) -> str:
        """The phase of step ``i`` a top-level op or a launch at ``ts`` belongs to, by where it falls: before the
        step's backward and optimizer, forward; from its backward to its optimizer's step, backward; after,
        optimizer."""
        if ts < min(self.b0[i], self.o0[i]):
            return "forward"
        if ts < self.o0[i]:
            return "backward"
        return "optimizer"

    def _top_level(self):
        """The training thread's top-level ops of each step (under its ProfilerStep, looking into spans that
        enclose backward or optimizer spans), each with the lane the position rule gives it."""
        main = sorted((e for e in self.host if e["tid"] == self.main), key=lambda e: (e["ts"], -e["dur"]))
        parent, stack = [], []
        for k, e in enumerate(main):
            while stack and main[stack[-1]]["ts"] + main[stack[-1]]["dur"] <= e["ts"]:
                stack.pop()
            parent.append(stack[-1] if stack else -1)
            stack.append(k)
        kinds = self.kinds
        special = [2 if kinds.get(id(e)) == "step" else 0 for e in main]  # 2: a step
        phase_ids = {id(e) for e in self.backward} | {id(e) for e in self.optimizer} | \
            {id(e) for e in self.compress} | {id(e) for e in self.decompress}
        for k, e in enumerate(main):
            if id(e) in phase_ids or kinds.get(id(e)) in ("backward", "optimizer"):
                special[k] = 1
                p = parent[k]
                while p >= 0 and special[p] == 0:  # its enclosing plain spans are containers: looked into
                    special[p] = 3
                    p = parent[p]
        reach = [False] * len(main)
        self.plain: List[Tuple[dict, str, int]] = []
        for k, e in enumerate(main):
            p = parent[k]
            reach[k] = p >= 0 and (special[p] == 2 or (special[p] == 3 and reach[p]))
            if not reach[k] or special[k] or id(e) in kinds:  # a collective, a wait, the data loader: not an op
                continue
            i = self.step_at(e["ts"])
            if i is not None:
                self.plain.append((e, self.phase_at(i, e["ts"]), i))
        self.main_busy = [(float(e["ts"]), float(e["ts"] + e["dur"])) for k, e in enumerate(main)
                          if reach[k] and special[k] != 3]

    def _inferred_waits(self) -> List[Tuple[float, float, int]]:
        """(start, end, step index) of the training thread's idle time between a step's backward and its
        optimizer while collectives are in flight, in steps without wait spans of their own."""
        comm = _union((e["ts"], e["ts"] + e["dur"]) for e in self.comm)
        busy = _union(self.main_busy)
        busy_starts, busy_ends = [b[0] for b in busy], [b[1] for b in busy]
        has_wait = {self.step_at(e["ts"]) for e in self.waits}
        last_bwd: Dict[int, float] = {}
        for e in self.backward:
            i = self.step_at(e["ts"])
            if i is not None:
                last_bwd[i] = max(last_bwd.get(i, -math.inf), e["ts"] + e["dur"])
        out = []
        for i, end_bwd in sorted(last_bwd.items()):
            if i in has_wait:
                continue
            stop = min(self.o0[i], self.steps[i][2])
            if stop <= end_bwd:
                continue
            lo = max(bisect.bisect_left(busy_ends, end_bwd), 0)
            hi = bisect.bisect_right(busy_starts, stop)
            idle = _minus([(end_bwd, stop)], busy[lo:hi])
            out.extend((s, e, i) for s, e in _intersect(idle, comm) if e - s >= WAIT_MIN_US)
        return out

    def host_rows(self) -> List[dict]:
        rows = []

        def add(lane, e, i, **extra):
            rows.append({"rank": self.rank, "lane": lane, "name": str(e["name"]), "start_us": e["ts"] + self.base,
                         "dur_us": float(e["dur"]), "step": self.steps[i][0] if i is not None else None,
                         "device": "cpu", "thread": e["tid"], **extra})

        for lane, spans in (("backward", self.backward), ("optimizer", self.optimizer),
                            ("compress", self.compress), ("decompress", self.decompress)):
            for e in spans:
                add(lane, e, self.step_at(e["ts"]))
        for e, lane, i in self.plain:
            add(lane, e, i)
        for e in self.comm:
            args = e.get("args") or {}
            add("comm", e, self.step_at(e["ts"]), op=op_of(str(e["name"]), args), bytes=bytes_of(args))
        for e in self.waits:
            add("wait", e, self.step_at(e["ts"]))
        for s, t, i in self._inferred_waits():
            rows.append({"rank": self.rank, "lane": "wait", "name": "wait for collectives", "start_us": s + self.base,
                         "dur_us": t - s, "step": self.steps[i][0], "device": "cpu", "thread": self.main,
                         "inferred": True})
        for n, s, t, e in self.steps:
            rows.append({"rank": self.rank, "lane": "step", "name": str(e["name"]), "start_us": s + self.base,
                         "dur_us": t - s, "step": n, "device": "cpu", "thread": self.main})
        return rows

    # -- GPU side -----------------------------------------------------------
    def _span_index(self):
        """{thread: (starts, spans)} of the host phase spans, in two layers that do not overlap within
        themselves: the hooks' (compress, decompress), looked up first, then backward and optimizer."""
        layers = []
        for lanes in ((("compress", self.compress), ("decompress", self.decompress)),
                      (("backward", self.backward), ("optimizer", self.optimizer))):
            out: Dict[object, List[Tuple[float, float, object]]] = {}
            for lane, spans in lanes:
                for e in spans:
                    out.setdefault(e["tid"], []).append((float(e["ts"]), float(e["ts"] + e["dur"]), lane))
            layers.append({tid: ([a for a, _, _ in v], v) for tid, v in ((t, sorted(v)) for t, v in out.items())})
        sized: Dict[object, List[Tuple[float, float, object]]] = {}
        for e in self.sized:
            sized.setdefault(e["tid"], []).append((float(e["ts"]), float(e["ts"] + e["dur"]), e))
        self._sized = {tid: ([a for a, _, _ in v], v) for tid, v in sized.items()}
        return layers

    @staticmethod
    def _holding(index, tid, at: float, back: int = 1):
        """What the latest of ``index[tid]``'s spans to start by ``at`` (or one of the ``back`` latest) that
        still runs at ``at`` carries, or None."""
        if tid not in index:
            return None
        starts, spans = index[tid]
        j = bisect.bisect_right(starts, at) - 1
        for k in range(j, max(j - back, -1), -1):
            if spans[k][0] <= at <= spans[k][1]:
                return spans[k][2]
        return None

    def gpu_rows(self) -> List[dict]:
        layers = self._span_index()
        kept = []  # (kernel, step index, lane, its launch)
        for k in self.kernels:
            args = k.get("args") or {}
            launch = self.launches.get(args.get("correlation"))
            at = float(launch["ts"]) if launch is not None else float(k["ts"])
            i = self.step_at(at)
            if i is None:
                continue
            name = str(k.get("name", ""))
            if k.get("cat") == "kernel" and COMM_KERNEL_RE.match(name):
                lane = "comm"
            else:
                lane = None
                if launch is not None:  # the innermost phase span that holds the launch
                    lane = self._holding(layers[0], launch["tid"], at) or self._holding(layers[1], launch["tid"], at)
                lane = lane or self.phase_at(i, at)
            kept.append((k, i, lane, launch))
        rows = []
        first: Dict[int, float] = {}
        last: Dict[int, float] = {}
        for k, i, lane, launch in kept:
            args = k.get("args") or {}
            ts, dur = float(k["ts"]), float(k["dur"])
            first[i] = min(first.get(i, math.inf), ts)
            last[i] = max(last.get(i, -math.inf), ts + dur)
            stream = args.get("stream", k.get("tid"))
            row = {"rank": self.rank, "lane": lane, "name": str(k.get("name", "")), "start_us": ts + self.base,
                   "dur_us": dur, "step": self.steps[i][0], "device": "gpu", "stream": stream,
                   "kind": "comm" if lane == "comm" else ("compute" if k.get("cat") == "kernel" else "memory")}
            if lane == "comm":
                # the innermost sized host collective around the launch (record_param_comms holds nccl:*)
                host = self._holding(self._sized, launch["tid"], float(launch["ts"]), back=4) \
                    if launch is not None else None
                row["op"] = op_of(row["name"], args) or (op_of(str(host["name"]), host.get("args")) if host else None)
                row["bytes"] = bytes_of(args) or (bytes_of(host.get("args")) if host else None)
            rows.append(row)
        order = sorted(first)
        for pos, i in enumerate(order):
            n, hs, ht, e = self.steps[i]
            s = first[i]
            t = first[order[pos + 1]] if pos + 1 < len(order) else last[i]
            t = max(t, s)
            rows.append({"rank": self.rank, "lane": "step", "name": str(e["name"]), "start_us": s + self.base,
                         "dur_us": t - s, "step": n, "device": "gpu", "host_start_us": hs + self.base,
                         "host_dur_us": ht - hs})
        for i, (n, hs, ht, e) in enumerate(self.steps):  # a step that launched nothing: its host window
            if i not in first:
                rows.append({"rank": self.rank, "lane": "step", "name": str(e["name"]), "start_us": hs + self.base,
                             "dur_us": ht - hs, "step": n, "device": "cpu", "host_start_us": hs + self.base,
                             "host_dur_us": ht - hs})
        return rows


# --------------------------------------------------------------------------- the API

FRAME_COLUMNS = ["rank", "lane", "name", "start_us", "dur_us"]


def read_trace(paths: Union[PathLike, Iterable[PathLike]], device: Optional[str] = None) -> pd.DataFrame:
    """Kineto trace files, one per rank, as the lab's timeline frame (``Run.timeline()``'s columns: rank, lane,
    name, start_us, dur_us, then the args: step, device, thread or stream, op and bytes on ``comm``, inferred on
    inferred waits, kind and host_start_us/host_dur_us on a GPU frame).

    ``paths``: a file, a directory of them (``tensorboard_trace_handler``'s), or a list. A trace's rank is its
    ``distributedInfo.rank``; a trace without one takes its place in ``paths``. ``device``: "gpu" reads the GPU's
    kernels (the default for a trace with kernels), "cpu" the host's spans (the default otherwise). What goes on
    which lane: this module's docstring. Raises LabError, in one line naming the file, for a file that is not a
    profiler trace, has no ProfilerStep spans, or a rank that two files claim."""
    if device not in (None, "cpu", "gpu"):
        raise LabError(f"device must be 'cpu', 'gpu' or None (the trace's), not {device!r}")
    files = trace_files(paths)
    docs = [(p, load(p)) for p in files]
    claimed: Dict[int, Path] = {}
    ranks = []
    for k, (p, doc) in enumerate(docs):
        r = _rank_of(doc)
        r = k if r is None else r
        if r in claimed:
            raise LabError(f"{p}: rank {r} again (also {claimed[r]}): give one trace per rank")
        claimed[r] = p
        ranks.append(_Rank(p, doc, r))
    if device is None:
        device = "gpu" if any(r.kernels for r in ranks) else "cpu"
    rows: List[dict] = []
    for r in ranks:
        rows.extend(r.gpu_rows() if device == "gpu" else r.host_rows())
    return _frame(rows)


def _frame(rows: List[dict]) -> pd.DataFrame:
    df = pd.DataFrame(rows)
    if df.empty:
        return pd.DataFrame(columns=FRAME_COLUMNS)
    df["_lane"] = df["lane"].map(LANE_ORDER)
    df = df.sort_values(["rank", "start_us", "_lane", "name", "dur_us"], kind="mergesort").drop(columns="_lane")
    rest = [c for c in df.columns if c not in FRAME_COLUMNS]
    df = df[FRAME_COLUMNS + rest].reset_index(drop=True)
    df["rank"] = df["rank"].astype(int)
    for col in ("start_us", "dur_us", "bytes"):
        if col in df:
            df[col] = df[col].astype(float)
    if "inferred" in df:
        df["inferred"] = df["inferred"].fillna(False).astype(bool)
    return df


def breakdown(frame: pd.DataFrame) -> pd.DataFrame:
    """Where each step's time went, per rank and step, in ms: the lab's own rule (``plots.step_breakdown``) on
    the imported frame, unchanged: compute_ms + compression_ms + exposed_comm_ms + other_ms = step_ms, and
    hidden_comm_ms, the communication that overlapped compute."""
    return plots.step_breakdown(frame)


def comm_overlap(frame: pd.DataFrame) -> pd.DataFrame:
    """Per rank, over its steps: comm_ms (the union of its ``comm`` spans within the step windows),
    hidden_comm_ms (the part of it that overlapped compute or hooks, ``breakdown``'s) and overlap, their ratio
    (HTA's ``comp_comm_overlap_ratio`` on a GPU frame); NaN where a rank has no communication."""
    cols = ["rank", "comm_ms", "hidden_comm_ms", "overlap"]
    if frame is None or frame.empty:
        return pd.DataFrame(columns=cols)
    df = plots.assign_steps(frame)
    df = df[df["it"].notna()]
    rows = []
    for rank, g in df.groupby("rank", sort=True):
        comm = hidden = 0.0
        for _, s in g.groupby("it", sort=True):
            win = s[s["lane"] == "step"]
            if win.empty:
                continue
            w0 = float(win["start_us"].iloc[0])
            w1 = w0 + float(win["dur_us"].iloc[0])

            def spans(lanes):
                d = s[s["lane"].isin(lanes)]
                a = d["start_us"].to_numpy(float)
                return _union((max(x, w0), min(x + y, w1)) for x, y in zip(a, d["dur_us"].to_numpy(float)))
            m = spans(("comm",))
            busy = spans(plots.COMPUTE_LANES + plots.HOOK_LANES)
            comm += sum(t - u for u, t in m)
            hidden += sum(t - u for u, t in _intersect(m, busy))
        rows.append([int(rank), comm / 1e3, hidden / 1e3, hidden / comm if comm > 0 else float("nan")])
    return pd.DataFrame(rows, columns=cols)
