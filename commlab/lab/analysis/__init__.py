"""Reading runs, finished or running: comparison tables, figures (plots), incremental reading of a live
run (live), traces, HTML reports, the presets and their verdicts (presets, results)."""
