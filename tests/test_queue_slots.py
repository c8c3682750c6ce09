"""The queue's slots (commlab/lab/service/queue.py): at most max_jobs held at once, and a supervisor that dies
(kill -9) frees its slot without anyone cleaning up."""
import os
import signal
import subprocess
import sys
from pathlib import Path

from commlab.lab.service.queue import Slots

ROOT = Path(__file__).resolve().parents[1]

HOLDER = r"""
import sys, time
from commlab.lab.service.queue import Slots
fd = Slots(sys.argv[1], int(sys.argv[2])).try_acquire()
print("held" if fd is not None else "none", flush=True)
time.sleep(600)
"""


def test_no_more_than_n_slots_are_held(tmp_path):
    slots = Slots(tmp_path, 3)
    held = [slots.try_acquire() for _ in range(3)]
    assert None not in held and len(set(held)) == 3
    assert slots.try_acquire() is None  # all three busy
    Slots.release(held[1])
    again = slots.try_acquire()
    assert again is not None
    assert slots.try_acquire() is None
    for fd in (held[0], held[2], again):
        Slots.release(fd)
    assert sorted(p.name for p in (tmp_path / ".slots").iterdir()) == ["0.lock", "1.lock", "2.lock"]


def test_a_killed_supervisor_frees_its_slot(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    holders = [subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path), "2"], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        assert [h.stdout.readline().strip() for h in holders] == ["held", "held"]
        slots = Slots(tmp_path, 2)
        assert slots.try_acquire() is None  # another process holds each slot
        holders[0].send_signal(signal.SIGKILL)
        holders[0].wait()
        fd = slots.try_acquire()
        assert fd is not None  # the kernel dropped the dead process's lock
        assert slots.try_acquire() is None  # the live holder still has the other
        Slots.release(fd)
    finally:
        for h in holders:
            if h.poll() is None:
                h.kill()
            h.wait()
            h.stdout.close()
