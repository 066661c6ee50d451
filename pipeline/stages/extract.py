"""Stage 2, extract: the target's hidden states for every prepared sample.

    extract/out/hidden_states/hs_{i}.safetensors   (pipeline.model.hsfile)
    extract/out/meta.json   layer ids, hidden size, dtype, stored (fp8 or the dtype; last)

The stage decides what is left (on resume every existing file is validated:
shape, dtype, finite, token ids; only missing or bad ones are redone), the
layers, the dtype and the disk budget, and hands one `ExtractJob` to the
configured backend (pipeline.extract.job):

    hf            transformers forward with hooks (extract_hf)
    vllm-server   vLLM serving the target, our connector writing the files
                  (pipeline.extract.vllm_server)
    vllm-engine   vLLM 0.11-0.16's engine driven in-process (pipeline.extract.vllm_engine)
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from pipeline.drive.stage_context import StageContext, StageError, main_for, torch_dtype
from pipeline.extract.backends import backend_runner
from pipeline.extract.job import GB, DiskGuard, ExtractJob, RowIds
from pipeline.model import fp8
from pipeline.model.hsfile import Counters, hs_path, remove_leftovers, validate_file
from pipeline.run.diskspace import fmt_bytes
from pipeline.run.events import EventType
from pipeline.run.summaries import ExtractSummary
from pipeline.vllm import compat
from pipeline.vllm.environment import choose_backend, probe
from pipeline.vllm.kv import combine_usage


def resolve_backend(ctx: StageContext, devices: list[int]):
    """(backend, VllmEnv or None): "auto" becomes vllm-server where vLLM can
    run here, else hf with a warning saying why; a vLLM backend that cannot
    run is an error naming what and the fix."""
    sec = ctx.section
    if sec.backend == "hf":
        ctx.events.emit(EventType.BACKEND, backend="hf", why="[stages.extract] backend = \"hf\"")
        return "hf", None
    env = probe(ctx.cfg.vllm_python())
    try:   # the target's linear attention decides "auto" on vLLM's CPU build
        from pipeline.model.info import read_model
        model = read_model(ctx.cfg.target_path())
    except (OSError, ValueError, KeyError):
        model = None
    from pipeline.vllm.validation import model_refused
    backend, why = choose_backend(sec.backend, env, devices, model,
                                  ctx.cfg.dtype_name(bool(devices)),
                                  model_refused(env.python, ctx.cfg.target_path(), env.vllm_dir))
    if sec.backend == "auto" and backend == "hf":
        ctx.events.warning(why, hint="scripts/install.sh installs vLLM's CPU build; on a GPU "
                                     "server set [runtime] vllm_python")
        ctx.events.emit(EventType.BACKEND, backend="hf", why=why)
        return "hf", None
    problem = env.unusable(devices)
    if problem:
        raise StageError(f"[stages.extract] backend = {sec.backend!r}: {problem}",
                         hint='or set backend = "hf" (or "auto")')
    if backend == "vllm-engine" and env.python != ctx.cfg.python():
        raise StageError("the vllm-engine backend runs vLLM inside the stage process, but vLLM "
                         f"is in {env.python}, not the stages' {ctx.cfg.python()}",
                         hint=f"set [runtime] python = {env.python!r}, or use backend = "
                              '"vllm-server"')
    print(f"extract: backend {backend}: {why}", flush=True)
    ctx.events.emit(EventType.BACKEND, backend=backend, why=why)
    return backend, env


def run_backend(ctx: StageContext, job: ExtractJob, backend: str) -> Counters:
    """On this node, or across the nodes of the Slurm allocation the stage
    runs in (`[cluster] nodes` > 1; pipeline.extract.nodes)."""
    cluster = ctx.cfg.cluster
    if cluster.nodes > 1:
        from pipeline.cluster.slurm import allocation_tasks
        from pipeline.extract.nodes import run_across_nodes
        tasks = allocation_tasks()
        if tasks > 1:
            return run_across_nodes(job, backend, ctx.run.stage_dir("extract") / "queue", tasks,
                                    cluster.lost_after_s, ctx.events.warning)
        ctx.events.warning(f"[cluster] nodes = {cluster.nodes}, but this process is not in a "
                           "Slurm allocation of several tasks: extracting on this node only",
                           hint='the stage spreads over nodes when run as a Slurm job '
                                '([cluster] scheduler = "slurm")')
    return backend_runner(backend)(job)


@dataclass
class Layout:
    """What the files hold: the layers, the width, the dtypes and the bytes."""
    target: Path
    trust: bool
    num_layers: int
    layer_ids: list[int]
    hidden: int
    dtype: object       # torch dtype the target computes in
    fp8: bool           # stored in FP8 ([stages.extract] hidden_states_dtype = "fp8")

    @property
    def stored(self):
        import torch
        return torch.float8_e4m3fn if self.fp8 else self.dtype

    @property
    def bytes_per_token(self) -> int:
        import torch
        if self.fp8:
            return fp8.bytes_per_token(len(self.layer_ids), self.hidden)
        elem = torch.empty((), dtype=self.dtype).element_size()
        return len(self.layer_ids) * self.hidden * elem + 8


def layout(ctx: StageContext, devices: list[int]) -> Layout:
    from transformers import AutoConfig

    from pipeline.extract.hf import text_config
    from pipeline.model.info import validate_layer_ids
    target = ctx.cfg.target_path()
    trust = ctx.cfg.model.trust_remote_code
    mcfg = text_config(AutoConfig.from_pretrained(str(target), trust_remote_code=trust))
    try:
        layer_ids = validate_layer_ids(list(ctx.section.layer_ids), mcfg.num_hidden_layers)
    except ValueError as e:
        raise StageError(f"[stages.extract] layer_ids: {e}",
                         hint="vLLM convention: id k is the residual stream after k layers") from None
    want_fp8 = ctx.section.hidden_states_dtype == "fp8"
    if want_fp8:
        check_fp8_readable()
    return Layout(target, trust, mcfg.num_hidden_layers, layer_ids, mcfg.hidden_size,
                  torch_dtype(ctx.cfg, bool(devices)), want_fp8)


def check_fp8_readable() -> None:
    """FP8 files are useless if this torch cannot make them or speculators'
    loader cannot read them: said before any extraction."""
    why = fp8.available()
    if why is None:
        try:
            from hs_connectors import HiddenStatesBackend
            if "fp8" not in HiddenStatesBackend.registry:
                why = ("the installed hs-connectors has no FP8 hidden-states backend, so the "
                       "train stage could not read FP8 files (hs-connectors 0.9 has one)")
        except ImportError:
            why = "hs-connectors (speculators' hidden-state loaders) is not installed"
    if why:
        raise StageError(f'[stages.extract] hidden_states_dtype = "fp8": {why}',
                         hint='use hidden_states_dtype = "auto", or install hs-connectors 0.9 '
                              "(scripts/install.sh does)")


def resume(ctx: StageContext, lay: Layout, rows, folder: Path) -> tuple[list[int], int]:
    """(rows still to do, files kept): every existing file is validated;
    bad ones are removed and redone."""
    todo, kept, bad = [], 0, 0
    for i in range(len(rows)):
        p = hs_path(folder, i)
        if p.exists():
            why = validate_file(p, rows[i], len(lay.layer_ids), lay.hidden, lay.stored)
            if why is None:
                kept += 1
                continue
            bad += 1
            print(f"extract: {p.name} is invalid ({why}); recomputing", flush=True)
            p.unlink()
        todo.append(i)
    if kept:
        print(f"extract: resuming, {kept}/{len(rows)} files already valid", flush=True)
    if bad:
        ctx.events.warning(f"{bad} existing hidden-state files were invalid and are recomputed")
    return todo, kept


def forecast(ctx: StageContext, bytes_per_token: int, tokens_left: int, folder: Path) -> None:
    need = tokens_left * bytes_per_token
    free = shutil.disk_usage(folder).free
    min_free = ctx.section.min_free_gb * GB
    if need > free - min_free:
        ctx.events.warning(
            f"disk forecast: {fmt_bytes(need)} of hidden states still to write "
            f"({fmt_bytes(bytes_per_token)}/token x {tokens_left:,} tokens), but only "
            f"{fmt_bytes(max(0, free - min_free))} is free above min_free_gb at {folder}",
            hint="the stage stops cleanly before the disk fills; free space or move "
                 "[run] runs_dir, then resume")


class Reporter:
    """The stage's progress (rates from when the backend is up, not from
    loading) and its vLLM backends' events (several servers' live use is one
    combined event)."""

    def __init__(self, ctx: StageContext, n: int, kept: int, base_bytes: int,
                 bytes_per_token: int, tokens_left: int, folder: Path):
        self.ctx, self.n, self.kept, self.base_bytes = ctx, n, kept, base_bytes
        self.bytes_per_token, self.tokens_left, self.folder = bytes_per_token, tokens_left, folder
        self.t0, self.emitted, self.ready = time.time(), 0.0, False
        self.usage: dict = {}

    def progress(self, c: Counters, force: bool = False) -> None:
        now = time.time()
        if not self.ready:
            # A backend reports zero once its model or server is up.
            self.ready = True
            if not c.samples:
                self.t0 = now
        if not force and now - self.emitted < 0.5:
            return
        self.emitted = now
        dt = max(now - self.t0, 1e-9)
        self.ctx.progress(self.kept + c.samples, self.n, "samples",
                          rate=c.samples / dt if c.samples else None,
                          tokens_per_s=c.tokens / dt, bytes_written=self.base_bytes + c.bytes,
                          bytes_per_token=self.bytes_per_token,
                          disk_needed_bytes=(self.tokens_left - c.tokens) * self.bytes_per_token,
                          disk_free_bytes=shutil.disk_usage(self.folder).free)

    def event(self, kind: str, fields: dict) -> None:
        if kind == EventType.KV_USAGE:
            self.usage[fields.get("server", 0)] = fields
            self.ctx.events.emit(kind, **combine_usage(list(self.usage.values())))
        else:
            self.ctx.events.emit(kind, **fields)


def body(ctx: StageContext) -> ExtractSummary:
    sec = ctx.section
    data_dir = ctx.out_of("prepare") / "data"
    if not data_dir.exists():
        raise StageError(f"{data_dir} is missing", hint="run the prepare stage first")
    devices = ctx.cfg.stage_devices("extract")
    lay = layout(ctx, devices)
    backend, vllm_env = resolve_backend(ctx, devices)
    rows = RowIds(data_dir)
    lengths = rows.lengths()
    folder = ctx.out / "hidden_states"
    folder.mkdir(parents=True, exist_ok=True)
    remove_leftovers(folder)   # writes cut short by a kill: never renamed, never valid
    todo, kept = resume(ctx, lay, rows, folder)
    tokens_left = sum(lengths[i] for i in todo)
    forecast(ctx, lay.bytes_per_token, tokens_left, folder)
    todo_set = set(todo)
    base = sum(hs_path(folder, i).stat().st_size for i in range(len(lengths))
               if i not in todo_set)
    report = Reporter(ctx, len(lengths), kept, base, lay.bytes_per_token, tokens_left, folder)
    job = ExtractJob(
        target=lay.target, layer_ids=lay.layer_ids, dtype=lay.dtype, hidden=lay.hidden,
        trust_remote_code=lay.trust, rows=rows, lengths=lengths, todo=todo, folder=folder,
        bytes_per_token=lay.bytes_per_token, disk=DiskGuard(folder, sec.min_free_gb * GB),
        section=sec, devices=devices, vllm=vllm_env, log_dir=ctx.run.stage_dir("extract"),
        term_grace_s=ctx.cfg.runtime.term_grace_s, should_stop=lambda: ctx.stop_requested,
        on_progress=report.progress, on_event=report.event, fp8=lay.fp8)
    done = Counters()
    if todo:
        report.t0 = time.time()
        done = run_backend(ctx, job, backend)
    report.progress(done, force=True)
    ctx.check_stop()
    elapsed = max(time.time() - report.t0, 1e-9)
    ctx.write_json(ctx.out / "meta.json", {
        "layer_ids": lay.layer_ids, "aux_layer_ids": lay.layer_ids[:-1],
        "num_layers": lay.num_layers, "hidden_size": lay.hidden, "dtype": job.dtype_name,
        "stored": "fp8" if lay.fp8 else job.dtype_name, "samples": len(lengths),
        "bytes_per_token": lay.bytes_per_token, "backend": backend})
    return ExtractSummary(samples=len(lengths), computed=done.samples, reused=kept,
                          tokens=done.tokens, bytes_written=done.bytes,
                          tokens_per_s=round(done.tokens / elapsed, 1),
                          gb_per_s=round(done.bytes / elapsed / 1e9, 4),
                          layer_ids=lay.layer_ids, hidden_states=str(folder), backend=backend,
                          stored="fp8" if lay.fp8 else job.dtype_name,
                          bytes_per_token=lay.bytes_per_token,
                          adaptations=sorted(compat.fired_so_far()))


def main() -> None:
    main_for("extract", body)


if __name__ == "__main__":
    main()
