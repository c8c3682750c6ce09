"""The ways in: the commlab command (cli), what the Streamlit pages need (ui), who may use an exposed
lab (accounts), JupyterLab (jupyter), notebook helpers, the Advisor page's jobs, sweeps."""
