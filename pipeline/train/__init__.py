"""The train stage's pieces: speculators' trainer as the stage runs it
(trainer), its checkpoints made safe to resume (checkpoints), the CPU
patches (cpu_patches), online mode's dataset and servers (online), the
torchrun worker (worker)."""
