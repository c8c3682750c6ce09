"""The lab as a room others share: a workshop's people and what each may do, around the single-user lab.

    owners     who owns a run, who sees and controls it, the quotas, the memory limit of a rank, the queue's
               fair order over owners
    accounts   who may sign in to an exposed lab: tokens, people and browser sessions
    places     who takes the sandbox's next child process, and each person's child time
    previews   model sizes for the pages, counted in a child, shared by every viewer
    policy     the room's admission rule (``Room``): what the queue calls at admission and while queued
    supervise  a room's detached supervisor

A lab without a room (``commlab run``, a notebook, a script, on a runs directory nobody shares) takes none
of this: its queue admits by commlab.lab.service.admission. ``open_lab`` gives the lab a runs directory
asks for: a room's when runs/lab.json configures one (``quotas``, ``access``, ``rank_mb``,
``preset_steps``) or runs/access.json exists (the app was served to others), the single-user lab's
otherwise. The UI's pages always use a room's (they act for a viewer: commlab.lab.front.ui).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from commlab.lab.base.paths import ACCESS, default_root
from commlab.lab.rundir.store import lab_config
from commlab.lab.service.queue import Lab
from commlab.room.policy import Room

ROOM_KEYS = ("quotas", "access", "rank_mb", "preset_steps")
"""Keys of runs/lab.json that make its runs directory a room's."""


def is_room(root: os.PathLike) -> bool:
    """Whether the runs directory ``root`` is a room's (see the module's docstring)."""
    return any(k in lab_config(root) for k in ROOM_KEYS) or (Path(root) / ACCESS).exists()


def open_lab(runs: Optional[os.PathLike] = None, max_jobs: Optional[int] = None, room: Optional[bool] = None):
    """The lab (commlab.lab.service.queue.Lab) on ``runs`` (default: $COMMLAB_RUNS, else ./runs), with the room's
    admission rule when ``room`` is true, or, when it is None, when the directory is a room's (``is_room``)."""
    root = runs or default_root()
    if room is None:
        room = is_room(root)
    return Lab(root, max_jobs=max_jobs, admission=Room if room else None)
