"""A run directory and its processes: the layout and atomic state (rundir), the
event protocol (events), the detached driver (driver), the stage supervisor
(supervise), process trees (proctree), disk space (diskspace), why a process
exited (exit_reasons)."""
