"""Stage 4, train: an EAGLE-3 draft with speculators' own trainer.

    train/out/checkpoints/<epoch>/   speculators checkpoint folders
    train/out/checkpoints/checkpoint_best -> best epoch by validation loss
    train/out/plateau.json           train's estimate after each epoch, and a plateau
                                     stop once decided (pipeline.train.budget)
    train/out/draft_config.json      an MLA draft's decoder config (--draft-config)
    train/out/vllm/<epoch>/          an MLA draft's checkpoint as vLLM serves it
                                     (pipeline.train.mla_draft)

The draft's layer ([stages.train] draft_layer): speculators' Llama layer, or
for an MLA target where the vLLM in use needs it an MLA layer of ours
(pipeline.train.mla_layer), registered in speculators in every process that
trains (pipeline.train.in_process: in this process and in each torchrun rank).

The trainer is speculators 0.9's (`speculators.train.cli.main`, resolved
from the same flags as `speculators train`), with its metrics logger turned
into `metric` events, adjusted by pipeline/train/ (trainer.py, checkpoints.py,
and cpu_patches.py on the CPU, where it runs in this process); with several
GPUs this stage re-launches itself under torchrun, one process per GPU.

How long it trains ([stages.train] epochs / total_seq_len = 0, the default)
is pipeline.train.budget's rule, from the prepared data's lengths: the plan
and why are printed, and the summary says why training stopped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from pipeline import tracking
from pipeline.cluster import slurm
from pipeline.drive.stage_context import Interrupted, StageContext, StageError, main_for
from pipeline.model import fp8
from pipeline.run import provenance
from pipeline.run.events import EventType
from pipeline.run.summaries import TrainSummary
from pipeline.train import algorithms
from pipeline.train.budget import Budget, PlateauWatch, packed_steps, plan
from pipeline.train.checkpoints import complete_checkpoint, latest_checkpoint, set_aside_incomplete
from pipeline.train.flags import draft_flags, wrapper_mask_token
from pipeline.train.in_process import MetricEvents, plateau_watch, run_in_process
from pipeline.train.mla_draft import (
    DraftChoice,
    choose_draft_layer,
    draft_layer_config,
    mla_argv,
    sync_exports,
    validate_export,
)
from pipeline.train.val_metrics import estimate, read_val_metrics

# torch versions whose compile of speculators' fused loss is known to fail
# (docs/FACTS.md: torch 2.11, "ListVariable(...) is already tracked for mutation").
FUSED_LOSS_BROKEN = ("2.11",)


def choose_loss(requested: str, device_type: str, torch_version: str) -> tuple[str, str | None]:
    """(loss implementation, warning or None)."""
    if requested == "eager":
        return "eager", None
    if device_type != "cuda":
        if requested == "fused":
            return "eager", "the fused loss needs a GPU and triton; using the eager loss on CPU"
        return "eager", None
    broken = any(torch_version.startswith(v) for v in FUSED_LOSS_BROKEN)
    try:
        import triton  # noqa: F401
    except ImportError:
        return "eager", "triton is not installed, so the fused loss cannot compile; using eager"
    if broken:
        return "eager", (f"speculators' fused loss fails inside torch.compile on torch "
                         f"{torch_version} (after minutes of compiling); using the eager loss")
    return "fused", None


def choose_attention(requested: str, device_type: str) -> str:
    if requested == "auto":
        return "simple_flex_attention" if device_type == "cuda" else "sdpa"
    if requested == "flex":
        if device_type != "cuda":
            raise StageError("flex attention has no CPU backward",
                             hint='set [stages.train] attention = "sdpa" (or "auto")')
        return "simple_flex_attention"
    return requested


def logger_flags(ctx: StageContext) -> list[str]:
    """speculators' metric loggers: [tracking]'s, local under the run
    (pipeline.tracking), or none."""
    loggers = ctx.cfg.tracking.loggers
    if not loggers:
        return ["--log-dir", str(ctx.out / "logs"), "--logger", ""]
    return tracking.trainer_flags(ctx.run.path, ctx.run.id, loggers)


def trainer_argv(ctx: StageContext, meta: dict, loss: str, attn: str,
                 budget: Budget) -> list[str]:
    """The `speculators train` flags for this run: a user can replay them
    (the budget's epochs and total_seq_len written out)."""
    sec = ctx.section
    argv = [
        *draft_flags(ctx.cfg, meta["aux_layer_ids"],
                    wrapper_mask_token(ctx.cfg.target_path(), ctx.cfg.model.trust_remote_code)),
        "--data-path", str(ctx.out_of("prepare") / "data"),
        "--hidden-states-path", str(ctx.out_of("extract") / "hidden_states"),
        *vocab_flags(ctx),
        "--save-path", str(ctx.out / "checkpoints"), *logger_flags(ctx),
        "--epochs", str(budget.epochs), "--lr", str(sec.lr),
        "--total-seq-len", str(budget.total_seq_len),
        "--train-data-ratio", str(sec.train_ratio),
        "--checkpoint-freq", str(sec.checkpoint_freq), "--log-freq", str(sec.log_freq),
        "--hidden-states-dtype", meta["dtype"], "--seed", str(sec.seed),
        "--loss-implementation", loss, "--draft-attn-impl", attn,
        "--on-missing", "raise", "--num-workers", str(dataloader_workers(ctx)),
    ]
    if sec.max_steps:
        argv += ["--max-steps", str(sec.max_steps)]
    if stores_fp8(ctx, meta):
        # speculators' own FP8 loader: files dequantized as they are read
        argv += ["--hidden-states-backend", "fp8"]
    return argv


def vocab_flags(ctx: StageContext) -> list[str]:
    """The draft vocabulary: vocab's mapping, or none for an algorithm that
    trains on the target's whole vocabulary (DFlash2: the vocab stage is off)."""
    if algorithms.get(ctx.section.algorithm).full_vocab:
        return []
    n, vocab = ctx.cfg.stages.vocab.draft_vocab_size, ctx.out_of("vocab")
    return ["--d2t-path", str(vocab / f"d2t-{n}.npy"), "--t2d-path", str(vocab / f"t2d-{n}.npy")]


def stores_fp8(ctx: StageContext, meta: dict) -> bool:
    """Hidden states in FP8: extract's files (its meta.json says), or, online
    and hybrid, what the servers will write."""
    if ctx.cfg.pipeline.mode != "offline":
        return ctx.cfg.stages.extract.hidden_states_dtype == "fp8"
    return meta.get("stored") == "fp8"


def train_lengths(ctx: StageContext) -> list[int]:
    """The token lengths of the rows speculators trains on: the first
    int(n x train_ratio) of the prepared data (its split)."""
    from datasets import load_from_disk
    lengths = list(load_from_disk(str(ctx.out_of("prepare") / "data"))
                   .with_format(None)["seq_len"])
    n = int(len(lengths) * ctx.section.train_ratio) if ctx.section.train_ratio < 1 else len(lengths)
    if n == 0:
        raise StageError(f"{len(lengths)} prepared rows leave none to train on at train_ratio "
                         f"{ctx.section.train_ratio}",
                         hint="add conversations ([data] path) or raise [stages.train] train_ratio")
    return lengths[:n]


def plan_budget(ctx: StageContext) -> Budget:
    """How long to train ([stages.train] epochs, total_seq_len; 0 = the
    rule's choice), counted by speculators' packer over as many data
    parallel ranks as will train."""
    sec = ctx.section
    lengths = train_lengths(ctx)
    # the configured nodes, not this attempt's allocation: a resume on fewer nodes
    # (min_nodes) keeps the plan its checkpoints were made under
    ranks = ranks_per_node(ctx) * max(1, ctx.cfg.cluster.nodes)
    budget = plan(lengths, epochs=sec.epochs, total_seq_len=sec.total_seq_len,
                  target_steps=sec.target_steps, min_steps=sec.min_steps,
                  max_epochs=sec.max_epochs,
                  count=lambda n: packed_steps(lengths, n, ranks, sec.seed))
    print(f"train: budget: {budget.why} ({len(lengths):,} rows, {sum(lengths):,} tokens)",
          flush=True)
    return budget


def dataloader_workers(ctx: StageContext) -> int:
    n = ctx.section.dataloader_workers
    if n >= 0:
        return n
    if ctx.devices != ["cpu"]:
        return 4
    return 2 if ctx.cfg.online else 0


def online_meta(ctx: StageContext) -> dict:
    """What extract's meta.json says, for online and hybrid mode (extract is off)."""
    import torch
    from transformers import AutoConfig

    from pipeline.extract.hf import text_config
    from pipeline.model.info import validate_layer_ids
    trust = ctx.cfg.model.trust_remote_code
    mcfg = text_config(AutoConfig.from_pretrained(str(ctx.cfg.target_path()),
                                                  trust_remote_code=trust))
    try:
        layer_ids = validate_layer_ids(list(ctx.cfg.stages.extract.layer_ids),
                                       mcfg.num_hidden_layers)
    except ValueError as e:
        raise StageError(f"[stages.extract] layer_ids: {e}",
                         hint="vLLM convention: id k is the residual stream after k layers") from None
    dtype = ctx.cfg.dtype_name(bool(ctx.cfg.stage_devices("extract")))
    elem = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    stored_fp8 = ctx.cfg.stages.extract.hidden_states_dtype == "fp8"
    return {"layer_ids": layer_ids, "aux_layer_ids": layer_ids[:-1], "dtype": dtype,
            "stored": "fp8" if stored_fp8 else dtype, "hidden_size": mcfg.hidden_size,
            "bytes_per_token": fp8.bytes_per_token(len(layer_ids), mcfg.hidden_size)
            if stored_fp8 else len(layer_ids) * mcfg.hidden_size * elem + 8}


def resolve_draft_layer(ctx: StageContext) -> DraftChoice:
    """`[stages.train] draft_layer` for this run's target and vLLM (an
    algorithm with its own draft layers keeps them: the MLA layer is EAGLE-3's)."""
    from pipeline.model.info import read_model
    from pipeline.vllm.environment import probe
    algo = algorithms.get(ctx.section.algorithm)
    if not algo.eagle3_layers:
        return DraftChoice("own", f"{algo.name} trains its own draft layers (speculators')")
    info = read_model(ctx.cfg.target_path())
    return choose_draft_layer(ctx.section.draft_layer, info.mla,
                              lambda: probe(ctx.cfg.vllm_python()))


def write_draft_config(ctx: StageContext) -> tuple[Path, list[str]]:
    """The MLA draft's decoder config, derived from the target's, as a file
    `--draft-config` reads (and a user replaying the flags)."""
    raw = json.loads((ctx.cfg.target_path() / "config.json").read_text())
    cfg, notes = draft_layer_config(raw, algorithms.num_layers(ctx.section))
    path = ctx.out / "draft_config.json"
    ctx.write_json(path, cfg)
    return path, notes


@dataclass
class Training:
    """What body decided for the trainer, and what it gave back."""
    argv: list[str]
    choice: DraftChoice
    device_type: str
    budget: Budget | None = None
    servers: object | None = None   # OnlineServers, in online mode
    metrics: MetricEvents | None = None


def read_meta(ctx: StageContext) -> dict:
    """The hidden states' layout: extract's meta.json, or (online) what the servers will give."""
    if ctx.cfg.online:
        return online_meta(ctx)
    meta_path = ctx.out_of("extract") / "meta.json"
    if not meta_path.exists():
        raise StageError(f"{meta_path} is missing", hint="run the extract stage first")
    return json.loads(meta_path.read_text())


def plan_training(ctx: StageContext, meta: dict, torch_version: str) -> Training:
    """The trainer's flags: loss, attention and the draft's layer (an MLA
    draft's decoder config written for it)."""
    device_type = "cuda" if ctx.devices[0].startswith("cuda") else "cpu"
    loss, why = choose_loss(ctx.section.loss, device_type, torch_version)
    if why:
        ctx.events.warning(why, hint='set [stages.train] loss = "eager" to silence this')
    attn = choose_attention(ctx.section.attention, device_type)
    budget = plan_budget(ctx)
    argv = trainer_argv(ctx, meta, loss, attn, budget)
    choice = resolve_draft_layer(ctx)
    print(f"train: draft layer {choice.layer} ({choice.why})", flush=True)
    if choice.layer == "mla":
        draft_cfg, notes = write_draft_config(ctx)
        for note in notes:
            print(f"train: MLA draft: {note}", flush=True)
        print(f"train: MLA draft: decoder config {draft_cfg}; its layer classes are "
              "pipeline.train.mla_layer's (a replay of the flags needs "
              "pipeline.train.mla_layer.register() in the process); vLLM serves "
              f"{ctx.out / 'vllm'}/<epoch>/", flush=True)
        argv = mla_argv(argv, draft_cfg)
    return Training(argv, choice, device_type, budget)


def start_online(ctx: StageContext, meta: dict, training: Training) -> None:
    """Online mode: the vLLM servers that make hidden states on demand, and
    the trainer's flags pointed at them."""
    from datasets import load_from_disk

    from pipeline.train.online import OnlineServers, online_argv
    lengths = load_from_disk(str(ctx.out_of("prepare") / "data"))["seq_len"]
    servers = OnlineServers(ctx, meta, int(max(lengths)))
    training.servers = servers
    try:
        servers.start()
        ctx.check_stop()   # a stop while they started: stopped with them
    except BaseException:
        servers.stop()
        raise
    training.argv = replace_flags(training.argv, online_argv(servers, ctx.section))


def ranks_per_node(ctx: StageContext) -> int:
    """Training processes per node: one per GPU the stage is given; on a
    CPU-only node one, or `ranks_per_node` (data parallel over gloo)."""
    want = ctx.section.ranks_per_node
    if ctx.devices == ["cpu"]:
        return max(1, want)
    if want and want != len(ctx.devices):
        raise StageError(f"[stages.train] ranks_per_node = {want}, but the stage is given "
                         f"{len(ctx.devices)} GPU(s): one rank trains on each GPU",
                         hint="set ranks_per_node = 0 (one per GPU), or give the stage "
                              f"{want} GPUs ([gpus])")
    return len(ctx.devices)


def train_nodes(ctx: StageContext) -> int:
    """The nodes training spreads over: the Slurm allocation's tasks where
    `[cluster] nodes` > 1 (fewer than `nodes` when a resume got only those
    up, `min_nodes`), else this one."""
    if ctx.cfg.cluster.nodes <= 1:
        return 1
    return max(1, slurm.allocation_tasks() or ctx.cfg.cluster.nodes)


def run_trainer(ctx: StageContext, training: Training) -> None:
    """Train (torchrun with several ranks or nodes, else in this process);
    the online servers stopped however it ends."""
    servers = training.servers
    try:
        try:
            if ranks_per_node(ctx) > 1 or ctx.cfg.cluster.nodes > 1:
                run_torchrun(ctx, training.argv)
            else:
                training.metrics = run_in_process(ctx, training.argv, training.device_type,
                                                  servers)
        finally:
            if servers is not None:
                servers.stop()
    except Interrupted:
        # the online watchdog gave up on its servers and asked for the stop:
        # a failure with the server's error, not a user's cancel
        if servers is None or servers.fatal is None:
            raise
    if servers is not None and servers.fatal is not None:
        raise StageError(f"training stopped (a checkpoint was saved): {servers.fatal}",
                         hint=servers.fatal.hint)


def body(ctx: StageContext) -> TrainSummary:
    import torch

    meta = read_meta(ctx)
    tracking.require(ctx.cfg.tracking.loggers, StageError)
    # each tracker local, in the run, unless the user named a server (torchrun's ranks inherit it)
    tracking.apply_env(ctx.run.path, ctx.run.id, ctx.cfg.tracking.loggers)
    training = plan_training(ctx, meta, torch.__version__)
    save_path = ctx.out / "checkpoints"
    moved = set_aside_incomplete(save_path)
    if moved:
        ctx.events.warning(f"set aside incomplete checkpoint(s) {moved} (cut short by a kill); "
                           "resuming from the last complete one")
    if latest_checkpoint(save_path) is None:
        (ctx.out / "plateau.json").unlink(missing_ok=True)   # a fresh start: no history
    if ctx.cfg.online:
        start_online(ctx, meta, training)
    run_trainer(ctx, training)
    final, chosen = choose_checkpoint(save_path, plateau_watch(ctx))
    if final is None:
        raise StageError(f"training ended without a checkpoint in {save_path}",
                         hint=f"see {ctx.run.log_path('train')}")
    summary = replace(summarize(ctx, training, save_path, final), checkpoint_chosen_by=chosen)
    if chosen.startswith("highest"):   # that epoch's estimate, not the last one's
        watch = plateau_watch(ctx)
        summary = replace(summary, acceptance_length=dict(watch.history)[watch.best_epoch()])
    summary = budget_summary(ctx, training.budget, save_path, summary)
    if ctx.cfg.tracking.loggers:   # how to look (the panel and `status` say it)
        summary = replace(summary,
                          trackers=tracking.where(ctx.run.path, ctx.cfg.tracking.loggers))
    print(f"train: stopped: {summary.stopped}", flush=True)
    return summary


def choose_checkpoint(save_path: Path, watch: PlateauWatch) -> tuple[Path | None, str]:
    """The trained draft when nothing measures it: the epoch with the
    highest estimate, or a later one within min_delta of it (PlateauWatch.
    best_epoch; evaluate, when it runs, names the one vLLM measured best
    among those it serves); without estimates, latest_checkpoint's."""
    best, top = watch.best_epoch(), watch.top_epoch()
    folder = save_path / str(best) if best is not None else None
    if folder is not None and complete_checkpoint(folder):
        return folder, f"highest acceptance estimate, epoch {best + 1}" + (
            "" if best == top else f" (the latest within min_delta {watch.min_delta:g} of "
                                   f"epoch {top + 1}'s)")
    final = latest_checkpoint(save_path)
    return final, ("lowest validation loss" if (save_path / "checkpoint_best").exists()
                   else "last epoch")


def budget_summary(ctx: StageContext, budget: Budget | None, save_path: Path,
                   summary: TrainSummary) -> TrainSummary:
    """`summary` with what the budget planned and why training stopped, in words."""
    if budget is None:
        return summary
    watch = plateau_watch(ctx)
    done = [int(d.name) for d in save_path.iterdir() if d.name.isdigit()
            and complete_checkpoint(d)] if save_path.is_dir() else []
    epochs = max(done) + 1 if done else 0
    if watch.stopped:
        stopped = watch.stopped["reason"]
    elif ctx.section.max_steps and ctx.section.max_steps < budget.steps:
        stopped = f"max_steps {ctx.section.max_steps} reached"
    elif not budget.auto:
        stopped = f"epochs = {budget.epochs} done"
    elif "max_epochs" in budget.why:
        stopped = f"max_epochs reached ({budget.epochs})"
    else:
        stopped = f"the planned {budget.epochs} epochs done, still improving"
    return replace(summary, stopped=stopped, epochs_trained=epochs, epochs_planned=budget.epochs,
                   total_seq_len=budget.total_seq_len, steps_planned=budget.steps,
                   budget=budget.why, estimates=[round(v, 4) for _, v in watch.history])


def summarize(ctx: StageContext, training: Training, save_path: Path,
              final: Path) -> TrainSummary:
    """The final checkpoint's artifact (and an MLA draft's vLLM export), the
    provenance it carries, and the stage's summary."""
    metrics, servers, choice = training.metrics, training.servers, training.choice
    val = dict(metrics.last_val) if metrics and metrics.last_val else read_val_metrics(final)
    accept = estimate(ctx.cfg, val)
    size = sum(p.stat().st_size for p in final.rglob("*") if p.is_file())
    ctx.events.emit(EventType.ARTIFACT, path=str(final), kind="checkpoint", bytes=size)
    summary = TrainSummary(
        checkpoint=str(final), acceptance_length=accept, val_loss=val.get("loss"),
        train_argv="speculators train " + " ".join(training.argv),
        draft_layer=choice.layer, draft_layer_reason=choice.why,
        algorithm=ctx.section.algorithm,
        estimate_from=algorithms.get(ctx.section.algorithm).estimate_from)
    if choice.layer == "mla":
        export = vllm_export(ctx, save_path, final)
        summary = replace(summary, vllm_draft=str(export),
                          draft_config=str(ctx.out / "draft_config.json"))
        provenance.copy_to(export)
    provenance.copy_to(final)   # the draft carries what made it
    if metrics and metrics.first_loss is not None:
        summary = replace(summary, first_train_loss=metrics.first_loss,
                          last_train_loss=metrics.last_loss)
    if metrics and metrics.waits:
        summary = replace(summary,
                          data_wait_share=round(sum(metrics.waits) / len(metrics.waits), 4))
    if servers is not None:
        counts = servers.counts   # the dataloaders' (pipeline.train.online.read_counts)
        summary = replace(summary, mode=ctx.cfg.pipeline.mode,
                          buffer_peak_bytes=servers.peak_buffer,
                          server_restarts=servers.restarts, from_disk=counts.get("from_disk"),
                          from_servers=counts.get("from_servers"),
                          kept_bytes=counts.get("kept_bytes"))
    return summary


def vllm_export(ctx: StageContext, save_path: Path, final: Path) -> Path:
    """Every complete checkpoint's vLLM export up to date (those the
    trainer wrote as it went are kept); the final one checked and named."""
    export_root = ctx.out / "vllm"
    sync_exports(save_path, export_root)
    export = export_root / final.name
    problems = validate_export(export)
    if problems:
        raise StageError(f"the vLLM export {export} is not whole: {'; '.join(problems[:8])}",
                         hint="resume the train stage: it writes the export again")
    size = sum(p.stat().st_size for p in export.iterdir() if p.is_file())
    ctx.events.emit(EventType.ARTIFACT, path=str(export), kind="vllm_draft", bytes=size)
    return export


def replace_flags(argv: list[str], flags: list[str]) -> list[str]:
    """argv with each `--flag value` of `flags` set (replaced or added)."""
    out = list(argv)
    for name, value in zip(flags[::2], flags[1::2], strict=True):
        if name in out:
            out[out.index(name) + 1] = value
        else:
            out += [name, value]
    return out


def torchrun_command(module: str, args: list[str], nproc: int, nodes: int = 1,
                     rendezvous_timeout_s: float = 600.0) -> list[str]:
    """`python -m module args` under torchrun, `nproc` processes per node: on
    this node (--standalone), or over the `nodes` tasks of the Slurm
    allocation this runs in (srun starts one torchrun agent per node; they
    meet at the allocation's first node, c10d rendezvous keyed by the job,
    each wait of the rendezvous bounded by `rendezvous_timeout_s`)."""
    run = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    tail = ["-m", module, *args]
    if nodes <= 1:
        return [*run, "--standalone", *tail]
    wait = max(1, round(rendezvous_timeout_s))
    return ["srun", f"--ntasks={nodes}", "--kill-on-bad-exit=1", "--label", *run,
            f"--nnodes={nodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={slurm.rendezvous()}",
            f"--rdzv-id=eagle-panel-{os.environ.get('SLURM_JOB_ID', '0')}",
            f"--rdzv-conf=join_timeout={wait},read_timeout={wait}", *tail]


def run_torchrun(ctx: StageContext, argv: list[str]) -> None:
    """The ranks under torchrun (over the allocation's nodes with `[cluster]
    nodes` > 1); global rank 0 writes the events. A failure says what the
    scheduler knows of the allocation's nodes (a lost node: Slurm's reason)."""
    nodes, nproc = train_nodes(ctx), ranks_per_node(ctx)
    cmd = torchrun_command("pipeline.train.worker",
                           ["--run-dir", str(ctx.run.path), "--", *argv], nproc, nodes,
                           ctx.cfg.cluster.rendezvous_timeout_s)
    where = "GPUs" if ctx.devices != ["cpu"] else "CPU ranks (gloo)"
    print(f"train: torchrun over {nodes} node(s) x {nproc} {where}", flush=True)
    proc = subprocess.Popen(cmd, env=os.environ.copy())
    try:
        code = proc.wait()
    except KeyboardInterrupt:
        code = proc.wait()
    if ctx.stop_requested:
        raise Interrupted()
    if code != 0:
        down = slurm.allocation_nodes_down() if nodes > 1 else ""
        raise StageError(f"torchrun exited with code {code}" + (f"; {down}" if down else ""),
                         hint=("resume continues from the last checkpoint" + (
                             " (with [cluster] min_nodes below nodes, on the nodes that are up)"
                             if down else "") + f"; see {ctx.run.log_path('train')}"))


def main() -> None:
    main_for("train", body)


if __name__ == "__main__":
    main()
