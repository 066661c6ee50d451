"""A torchrun worker that only proves the rendezvous: gloo process group,
one all_reduce, and what it saw written to OUT/rank{RANK}.json. Launched by
tests/test_slurm.py with the train stage's own torchrun command, inside a
real Slurm allocation (the speculators trainer itself needs GPUs)."""

import json
import os
import socket
import sys

import torch
import torch.distributed as dist


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo")
    t = torch.tensor([dist.get_rank() + 1])
    dist.all_reduce(t)
    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump({"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": int(t),
                   "group_rank": int(os.environ["GROUP_RANK"]), "host": socket.gethostname(),
                   "slurm_procid": os.environ.get("SLURM_PROCID")}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
