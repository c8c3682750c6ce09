"""A fault-tolerant run's Lighthouse as a process of its own, started by the lab (commlab/lab/rundir/ftrun.py):

    python commlab/engine/ft_lighthouse.py --bind [::]:PORT --min_replicas 2 --join_timeout_ms 1000 ...

A script file on purpose: torchft's ``lighthouse_main`` parses the process's own argv (Rust's env::args with the
first one skipped), so under ``python -m`` or ``python -c`` it would meet ``-m``/``-c`` where its program name
goes. Run as a script, this file's folder would come first on sys.path, where commlab's engine modules would
shadow top-level names; it is taken off before anything is imported.

It loads torchft's compiled extension (``torchft._torchft``, Rust, which links no torch) straight from its file,
without torchft's package, whose ``__init__`` imports torch: the Lighthouse then starts in a tenth of a second and
about 0.1 s of CPU, where importing torch first took several seconds of CPU on a loaded two-core machine.
"""
import importlib.util
import os
import sys

LIGHTHOUSE_ENV = "COMMLAB_FT_LIGHTHOUSE"
"""The Lighthouse's address (http://host:port), as the lab hands it to each replica's process."""
GEN_ENV = "COMMLAB_FT_GEN"
"""The generation of a replica group's process (0 at the run's start, one more per restart), as the lab hands it to
each replica's process: the processes of generation 0 wait for one another before the first quorum."""
HOST_ENV = "COMMLAB_FT_HOST"
"""The address a replica group's process is reached at (its store, its Manager's server, its recovery transport),
as the lab hands it to each replica on a shaped link (its namespace's address); unset: localhost, one machine's
loopback."""
RUN_DIR_ENV = "COMMLAB_FT_RUN_DIR"
"""The run directory, as the lab hands it to each replica's process of your own script (``commlab run --script``):
``commlab.wrap`` then trains as that replica group of that run."""


def torchft_extension():
    """torchft's ``_torchft`` extension module, loaded from its file in torchft's installed package (the package's
    ``__init__`` is not run); ImportError when torchft is not installed or has no such file."""
    found = importlib.util.find_spec("torchft")  # finds the package without importing it
    folders = list(found.submodule_search_locations or []) if found is not None else []
    for folder in folders:
        for name in sorted(os.listdir(folder)):
            if name.startswith("_torchft.") and name.endswith((".so", ".pyd")):
                spec = importlib.util.spec_from_file_location("torchft._torchft", os.path.join(folder, name))
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                return module
    raise ImportError("torchft's _torchft extension was not found (pip install --no-deps torchft==0.2.0)")


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    torchft_extension().lighthouse_main()


if __name__ == "__main__":
    main()
