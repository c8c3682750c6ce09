"""The ways in: the commlab command (cli and its *_cli modules), what the Streamlit pages need (ui: who is
looking and the runs they may see; new_run, previews, groups, sweep_jobs, advice_jobs: each page's side),
who may use an exposed lab (accounts), JupyterLab (jupyter), notebook helpers, sweeps."""
