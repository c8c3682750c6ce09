"""A room's detached supervisor: ``python -m commlab.room.supervise --runs DIR RUN_ID``, the lab's own
(commlab.lab.service.supervise) with the room's admission rule, so its queue order is the room's."""
from __future__ import annotations

import sys

from commlab.lab.service import supervise
from commlab.room.policy import Room


def main(argv=None) -> int:
    return supervise.main(argv, admission=Room)


if __name__ == "__main__":
    sys.exit(main())
