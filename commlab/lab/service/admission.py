"""How a lab admits a run and orders its queue. ``Admission`` is the single-user lab's rule: one user (the
person at the machine, ``local_name``), any spec the full check passed, first come, first served. A room
(commlab.room) installs its own (commlab.room.policy.Room: owners, quotas, memory limits, code refused to
students, checks in a child with limits, a queue fair by run time over owners); the queue (commlab.lab.service.queue.Lab)
calls only what is defined here, at admission (``admit``) and while queued (``order``), and hands its
detached supervisors to ``supervisor``, so each follows the same rule.
"""
from __future__ import annotations

import getpass
from pathlib import Path
from typing import Callable, Iterable, List, Optional

from commlab.engine import codepath
from commlab.engine.spec import SpecError
from commlab.lab.base import sandbox
from commlab.lab.base.errors import LabError


def local_name() -> str:
    """The person at the machine: the owner of every run of a lab without a room."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "local"


def needs_first_batch(spec) -> bool:
    """Whether ``spec`` (a checked JobSpec) takes one batch through its model before any rank starts
    (commlab.engine.preflight.check). Zoo models on shipped data sets are known to fit (the spec checks their
    kinds); models and data sets from outside the zoo, code the spec names (a loss of the user's), and a method
    whose parameters depend on the model (Streaming DiLoCo's fragments) are checked. Imports torch only for a
    spec with a method, to ask the method."""
    if (codepath.is_external(spec.model.name) or codepath.is_external(spec.dataset.name)
            or codepath.code_fields(spec.to_dict())):
        return True
    if spec.method.name == "none":  # methods.NONE, without importing the methods
        return False
    from commlab.engine import methods  # lazy: the methods pull in torch
    return methods.resolve(spec.method.name).checks_model  # a built-in here: one named by import path is code


class Admission:
    supervisor = "commlab.lab.service.supervise"
    """The module a detached supervisor runs (``python -m MODULE --runs DIR RUN_ID``): it builds its lab with
    this rule again."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def admit(self, spec, owner: Optional[str] = None, say: Optional[Callable[[str], None]] = None) -> dict:
        """The fields of ``spec``'s queued status (``owner``, its limits: Run.mark_queued's), or an error
        naming what refuses it. Here: the local user's, with no limits; a model or data set from outside the
        zoo takes one batch first (``check_code``)."""
        me = local_name()
        if owner is not None and owner.lower() not in (me.lower(), "local"):
            raise LabError(f"owner: this lab has one user ({me}); runs owned by {owner!r} need a room's lab "
                           "(commlab.room.open_lab)")
        self.check_code(spec, say)
        return {"owner": me}

    def check_code(self, spec, say: Optional[Callable[[str], None]] = None, who=None) -> None:
        """A model or data set from outside the zoo takes one batch before any rank starts: in this process
        where it may import the spec's code (the CLI, a notebook), else in a child with limits
        (commlab.lab.base.sandbox; the UI's server), for ``who``. ``say`` is told first, since building the model can
        take a while (a Hugging Face model: its imports and weights, seconds)."""
        if not needs_first_batch(spec):
            return
        from commlab.engine import preflight  # lazy: torch, for a spec that takes its first batch only
        if say is not None:
            say(f"checking the model and data set ({spec.model.name} on {spec.dataset.name}): one batch "
                "before any rank starts ...")
        if codepath.imports_allowed():
            preflight.check(spec)
            return
        try:
            sandbox.run("check", spec.to_dict(), sandbox.CHECK, who=who, wait_s=sandbox.CHECK_WAIT_S)
        except sandbox.SandboxError as e:
            raise SpecError(e.path, e.msg) from None

    def order(self, queued: List[dict], everything: Iterable[dict]) -> List[str]:
        """The ids of ``queued`` (index rows) in the order the queue serves them; ``everything``: every row
        of the index. Here: first come, first served."""
        return [r["id"] for r in sorted(queued, key=lambda r: (r.get("created") or 0, r["id"]))]
