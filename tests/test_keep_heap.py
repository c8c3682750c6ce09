"""commlab.engine.worker.keep_heap: with it, memory a step frees stays in the process, so the next step
does not fault it back in; without it glibc hands the free top of its heap back to the OS."""
import json
import subprocess
import sys

import pytest

# Each round mallocs 40 MB in 100 KB blocks (below glibc's mmap threshold: from the heap),
# writes every page, and frees it all: a step's activations, in small. Reported: the page
# faults of the first round and of the later rounds.
_ROUNDS = r"""
import ctypes, ctypes.util, json, resource, sys
sys.path.insert(0, sys.argv[1])
from commlab.engine.worker import keep_heap
kept = keep_heap() if sys.argv[2] == "keep" else None
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
faults = []
for _ in range(4):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [libc.malloc(100_000) for _ in range(400)]
    for b in blocks:
        ctypes.memset(b, 1, 100_000)
    for b in reversed(blocks):
        libc.free(b)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
print(json.dumps({"kept": kept, "faults": faults}))
"""


def _rounds(mode):
    root = __file__.rsplit("/tests/", 1)[0]
    out = subprocess.run([sys.executable, "-c", _ROUNDS, root, mode], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_keep_heap_stops_freed_memory_being_faulted_back():
    kept = _rounds("keep")
    if kept["kept"] is False:
        pytest.skip("no glibc mallopt on this platform")
    first, later = kept["faults"][0], kept["faults"][1:]
    assert first > 5000, kept  # 40 MB of fresh pages: about 10K faults
    assert max(later) < first / 20, kept  # the same memory again: reused, not faulted back
    plain = _rounds("plain")["faults"]
    # without it glibc trims the heap after every round: the pages come back as faults each time
    assert min(plain[1:]) > first / 2, plain

