"""Many runs: the queue (slots, admission, supervisors), the detached supervisor, processes started
for the app (spawn), and who owns a run, who sees it and how much each may ask (owners)."""
