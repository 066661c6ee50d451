"""doctor's checks of a Slurm cluster ([cluster] scheduler = "slurm"): the
scheduler reachable, the partition up, GPUs per node against [gpus], the
run directory shared, and what each node runs and writes."""

from __future__ import annotations

from pipeline.cluster import slurm
from pipeline.doctor.findings import BLOCK, GIB, OK, WARN, Finding, check
from pipeline.doctor.inputs import Inputs
from pipeline.doctor.plans import prepared_tokens
from pipeline.model.info import hs_bytes_per_token


@check(230)
def check_cluster(x: Inputs) -> list[Finding]:
    """[cluster] scheduler = "slurm": the scheduler reachable, the partition
    there and up, GPUs per node against [gpus], the run directory shared."""
    c = x.cfg.cluster
    if c.scheduler != "slurm":
        return []
    try:
        slurm.preflight(c, x.cfg.runs_dir())
    except slurm.SlurmError as e:
        return [Finding("cluster", BLOCK, str(e))]
    out = [Finding("cluster", OK, "Slurm answers" + (f"; partition {c.partition!r} is up"
                                                       if c.partition else ""))]
    need = len(x.cfg.gpus.devices)
    if need and c.gpus_per_node < need:
        out.append(Finding("cluster", WARN, f"[gpus] devices names {need} GPUs but jobs ask for "
                           f"{c.gpus_per_node} per node", "set [cluster] gpus_per_node = "
                           f"{need}"))
    runs = x.cfg.runs_dir()
    note = slurm.shared_filesystem_note(runs)
    if note:
        out.append(Finding("cluster", WARN, note))
    if c.nodes > 1:
        out.append(per_node_plan(x))
    return out


def per_node_plan(x: Inputs) -> Finding:
    """Extract over `[cluster] nodes`: what each node runs and writes (the
    KV plan above is per server, the same on every node; the disk forecast
    above is the total, on the one shared filesystem)."""
    c, sec = x.cfg.cluster, x.cfg.stages.extract
    gpus = len(x.cfg.gpus.devices)
    groups = max(1, gpus // max(1, sec.tensor_parallel)) if gpus else 1
    what = (f"{groups} vLLM {'server' if x.backend != 'vllm-engine' else 'engine'}(s) at "
            f"TP={sec.tensor_parallel}" if x.uses_vllm else f"{max(1, gpus)} hf worker(s)")
    msg = (f"{c.nodes} nodes per extract: each runs {what} on its {gpus or 'no'} GPU(s), "
           f"{c.nodes * groups} in all, on one shared queue of samples; train: torchrun over "
           f"{c.nodes} nodes x {gpus or 1} GPU(s)")
    if x.model is not None and x.layer_ids is not None and not x.cfg.online:
        elem = 4 if x.cfg.dtype_name(bool(gpus)) == "float32" else 2
        tokens, exact = prepared_tokens(x.cfg)
        if tokens is not None:
            total = tokens * hs_bytes_per_token(x.model, len(x.layer_ids), elem)
            msg += (f"; each node writes {'' if exact else 'at most '}~{total / c.nodes / GIB:,.1f}"
                    f" GiB of the {total / GIB:,.1f} GiB of hidden states (all on the shared "
                    "run directory)")
    return Finding("cluster", OK, msg)
