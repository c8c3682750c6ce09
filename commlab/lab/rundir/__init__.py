"""One run: its directory and status (store), the index over run directories, its headline figures
(summary), the launcher that starts its ranks and follows them to a final status, the progress
display, and the disturbance sampler."""
