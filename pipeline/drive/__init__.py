"""Driving stages from a config: the detached driver that plans and launches
a run's stage attempts (driver.py) and a stage process's own context, its
config loaded and its events opened (stage_context.py).

It sits above pipeline.config (and the vLLM and model packages it asks), and
above pipeline/run/, the floor it writes through: the run directory, state,
events, processes and supervision, which know nothing of configs or vLLM
(tests/unit/test_shape.py states the floors)."""
