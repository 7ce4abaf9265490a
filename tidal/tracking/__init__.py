"""``tidal run --track``: the job's per-step metrics sent to an experiment tracker (MLflow,
Weights & Biases) by the coordinator, each committed step once, under one run per job
(``docs/decisions/trackers.md``)."""
