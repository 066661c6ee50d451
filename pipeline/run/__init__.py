"""A run directory and its processes: the layout and atomic state (rundir),
state.json's fields type-checked (state), the event protocol (events)
and each stage's typed summary in it (summaries),
whether a stage still runs (executor: local, or a registered scheduler's),
what readers show and launchers record of gone stages (reconcile), the
detached driver's launching, cancelling and resetting (driver), the stage
supervisor (supervise), what every stage process shares (stage_context),
process trees (proctree), what an attempt left running (leftovers), disk
space (diskspace), why a process exited (exit_reasons), each stage's inputs
and versions (provenance)."""
