"""Schedulers and nodes: Slurm jobs (slurm), the shared queue of samples
over nodes (workqueue), each node's GPU telemetry (node_telemetry)."""
