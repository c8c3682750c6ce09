"""A room's admission rule (``Room``): what the queue (commlab.lab.service.queue.Lab) asks at admission and
while a run is queued, for a lab others share.

At admission: a student's spec that names code is refused (commlab.room.owners.refuse_code); a model or data
set from outside the zoo takes one batch in a child with limits, counted to its owner (commlab.room.places);
the run's ranks get the memory limit of its owner (commlab.room.owners.rank_limit: a student's ``rank_mb``
quota, runs/lab.json's ``rank_mb`` for everyone), recorded in its status (``rank_limit_mb``), which the
launcher applies, and so are a student's disk limits (commlab.room.owners.disk_limits: what its directory may
grow to, what the disk keeps free). While queued: fair by run time over the runs' owners (commlab.room.owners.fair_order), so a
student with many runs queued does not hold back one who has few. The per-user quotas on what a run may
ask (steps, world size, ...), the count of queued runs and the wall-time limit are checked by the UI as it
queues a viewer's runs (commlab.lab.front.ui.queue_runs), before admission.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable, List, Optional

from commlab.lab.service.admission import Admission
from commlab.room import owners, places


class Room(Admission):
    supervisor = "commlab.room.supervise"

    def __init__(self, root: Path):
        super().__init__(root)
        owners.every_rank_mb(self.root)  # a bad rank_mb in runs/lab.json is said before any run
        places.install()

    def admit(self, spec, owner: Optional[str] = None, say: Optional[Callable[[str], None]] = None) -> dict:
        student = owners.is_student(owner)
        if student:
            owners.refuse_code(spec.to_dict())
        who = owners.User(owner, admin=not student) if owner else owners.local_user()  # students' budgeted
        self.check_code(spec, say, who=who)  # before others' previews (commlab.room.places.Places)
        memory_mb, memory_from = owners.rank_limit(self.root, owner) or (None, None)
        return {"owner": owner or owners.local_user().name, "rank_limit_mb": memory_mb,
                "rank_limit_from": memory_from, **owners.disk_limits(self.root, owner)}

    def order(self, queued: List[dict], everything: Iterable[dict]) -> List[str]:
        everything = list(everything)
        running = [r for r in everything if r["state"] == "running"]
        return owners.fair_order(queued, running, owners.run_time(everything), owners.typical_run(everything))
