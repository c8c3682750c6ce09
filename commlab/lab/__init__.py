"""The lab's user side, by idea: base (paths, errors, specs, processes), net (links and clusters), rundir (the run
directory and its index), strategy (the advisor and the performance model), service (the queue and its
supervisor), analysis (results, timelines, plots), front (the command line, the app's server, the workshop's
accounts). The Python API over it is ``commlab`` (commlab/api.py)."""
