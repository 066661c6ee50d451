"""The train stage's pieces: speculators' trainer as the stage runs it
(trainer), run in the stage's own process (in_process), its checkpoints
made safe to resume (checkpoints), a checkpoint's validation figures and
acceptance estimate (val_metrics), how long to train and when to stop
(budget), the CPU patches (cpu_patches), online mode's dataset and servers
(online), the torchrun worker (worker), the MLA draft (mla_layer, mla_draft)."""
