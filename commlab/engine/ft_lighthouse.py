"""A fault-tolerant run's Lighthouse as a process of its own, started by the lab (commlab/lab/rundir/ftrun.py):

    python commlab/engine/ft_lighthouse.py --bind [::]:PORT --min_replicas 2 --join_timeout_ms 1000 ...

A script file on purpose: torchft's ``lighthouse_main`` parses the process's own argv (Rust's env::args with the
first one skipped), so under ``python -m`` or ``python -c`` it would meet ``-m``/``-c`` where its program name
goes. Run as a script, this file's folder would come first on sys.path, where commlab's engine modules would
shadow top-level names; it is taken off before anything is imported.
"""
import os
import sys

LIGHTHOUSE_ENV = "COMMLAB_FT_LIGHTHOUSE"
"""The Lighthouse's address (http://host:port), as the lab hands it to each replica's process."""
RUN_DIR_ENV = "COMMLAB_FT_RUN_DIR"
"""The run directory, as the lab hands it to each replica's process of your own script (``commlab run --script``):
``commlab.wrap`` then trains as that replica group of that run."""

def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    from commlab.engine.ft import lighthouse_main  # lazy: the lab reads LIGHTHOUSE_ENV here without torch or torchft
    lighthouse_main()


if __name__ == "__main__":
    main()
