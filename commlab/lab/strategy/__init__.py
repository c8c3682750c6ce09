"""Strategy choice: the performance model (perfmodel/), the advisor, and `strategy: auto`."""
