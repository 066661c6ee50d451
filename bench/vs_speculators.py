"""eagle-panel's pipeline against speculators' own CLI chain, on one target,
the same conversations and the same training settings, in one run.

    python bench/vs_speculators.py [--target builtin:tiny-llama] [--samples 0] [--epochs E]
                                   [--eval-prompts 40] [--json PATH] [--keep DIR]
    python bench/vs_speculators.py --samples 16 --epochs 1 --eval-prompts 4 --max-tokens 16 \
                                   --no-probes    # the smallest (CI)

theirs, as a user runs speculators 0.9 (the `speculators` console script):
  1. a vLLM server the way their scripts/launch_vllm.py starts one (speculative method
     `extract_hidden_states` with the aux layer ids + the last layer, a hidden-state KV
     connector) plus `--enable-scale-out`, whose /v1/chat/completions/render endpoint
     `speculators prepare-data` needs for natural-language rows;
  2. `speculators prepare-data --render-endpoint ... --no-skip-token-freq`;
  3. `speculators generate-offline-data --endpoint .../v1`;
  4. `speculators train` with the flags eagle-panel's train stage used (the same epochs,
     lr, seq len, layer ids, draft vocab size, loss and attention), the vocabulary mapping
     built by their trainer from prepare-data's token_freq.pt.
ours: `eagle-panel run --wait` (regenerate off; prepare, extract through vLLM, vocab,
train, evaluate).

Both sides at defaults: ours trains as the bundled config.toml says, by default the
budget rule (pipeline.train.budget: epochs and total_seq_len from the data, a plateau
stop); theirs gets the flags ours' train stage used, so the epochs and total_seq_len ours
chose (`--epochs E` fixes ours' epochs instead).

Then (unless --no-match-steps) ours again from train on, with total_seq_len scaled so
that it takes as many optimizer steps as theirs, and the whole chain's wall time with it:
their prepare-data makes a row per assistant turn holding the conversation so far, so at
the same total_seq_len their trainer takes more, smaller steps over the same supervised
tokens (1.74x as many on the bundled data), which the acceptance after a few epochs shows.

What cannot run on a CPU is run anyway, once, to quote the error and the line of source
it comes from (`cannot run here:` lines, `cannot_run` in the JSON; `--no-probes` leaves
those runs out, `probes` false in the JSON), and the chain goes on with the smallest
substitute, named in the output:
  - generate-offline-data against the stock ExampleHiddenStatesConnector (launch_vllm.py's
    `file` backend) fails on the CPU build; their chain uses eagle-panel's CPU-aware
    connector in the same server instead (`kv_connector_module_path`), with their client;
  - `speculators train` assumes an accelerator; their chain runs their CLI's train
    command in a process with eagle-panel's CPU patches
    (pipeline.train.cpu_patches: their trainer, not their CLI as shipped).

Each step's wall time, peak RSS (the sum of RSS over the step's process tree, a vLLM
server it needs included, sampled every 0.25 s), bytes its outputs hold on disk; the
final validation loss (each trainer's own split); and the acceptance length vLLM
measures when it serves each draft: ours by the evaluate stage, theirs by the same stage
on a run directory holding their checkpoint (the same server flags, prompts, greedy
decoding, draft tokens). Ours is the checkpoint evaluate measured (train's choice);
theirs both ways: their last epoch, and the epoch speculators marks `checkpoint_best`
(its lowest validation loss; measured only where it is another epoch). The prompts
are the first turns of bundled conversations that neither pipeline trains on (the last
--eval-prompts of them), since the two trainers hold out different validation rows.
The acceptance measurements and the probes of what cannot run are not in the wall
times (they run concurrently at the end, to save time).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NEEDS = ("vllm",)   # to run at its defaults (bench/run_all.py): their server and both acceptances
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

import psutil  # noqa: E402
import train_direct  # noqa: E402

from pipeline.builtin import conversations_path  # noqa: E402
from pipeline.paths import VLLM_VENV, pythonpath_with_project  # noqa: E402
from pipeline.vllm import contract_strings as vs  # noqa: E402
from tests.configs import merged, render, write  # noqa: E402

SPECULATORS = Path(sys.executable).with_name("speculators")
MiB = 1 << 20

# their trainer with eagle-panel's CPU patches, through their CLI's train command;
# each validation's figures also go to $VS_VAL_LOG (speculators writes val_metrics.json
# only for an epoch that improves on the best: the last epoch's may not be on disk)
PATCHED_TRAIN = """
import json, os, sys
from speculators.train import checkpointer as ck_mod, trainer as tr_mod
from pipeline.train.cpu_patches import patch_for_cpu
patch_for_cpu(tr_mod, ck_mod)
val_epoch = tr_mod.Trainer.val_epoch
def recorded(self, epoch, *args, **kwargs):
    out = val_epoch(self, epoch, *args, **kwargs)
    with open(os.environ["VS_VAL_LOG"], "a") as f:
        f.write(json.dumps({"epoch": epoch, **{k: float(v) for k, v in out.items()}}) + "\\n")
    return out
tr_mod.Trainer.val_epoch = recorded
from speculators.cli import app
sys.argv = ["speculators", "train", *sys.argv[1:]]
app()
"""


# -- measuring ------------------------------------------------------------------------

class TreeRss(threading.Thread):
    """The sum of RSS over this process's descendants, every `interval` s.
    This process is made a child subreaper, so what a child detaches (the
    run's driver, a vLLM engine) stays in the tree."""

    def __init__(self, interval: float = 0.25):
        super().__init__(daemon=True)
        self.interval, self.samples, self.stopped = interval, [], threading.Event()
        with contextlib.suppress(Exception):   # Linux: PR_SET_CHILD_SUBREAPER
            ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)

    def run(self):
        me = psutil.Process()
        while not self.stopped.is_set():
            total = 0
            for p in me.children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    total += p.memory_info().rss
            self.samples.append((time.time(), total))
            self.stopped.wait(self.interval)

    def peak(self, t0: float, t1: float) -> int:
        return max((r for t, r in self.samples if t0 <= t <= t1 + self.interval), default=0)


def disk_bytes(*paths: Path) -> int:
    total = 0
    for p in paths:
        if p.is_file():
            total += p.stat().st_size
        elif p.is_dir():
            total += sum(f.stat().st_size for f in p.rglob("*") if f.is_file() and not f.is_symlink())
    return total


def rows_tokens(data: Path) -> tuple[int, int, int]:
    """(rows, tokens, supervised tokens) of a prepared dataset."""
    from datasets import load_from_disk
    ds = load_from_disk(str(data)).with_format(None)
    masks = ds["loss_mask"]
    return len(ds), sum(len(m) for m in masks), sum(sum(m) for m in masks)


def project_env(**extra) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", **extra)
    # speculators' CLI (typer + rich): plain Python tracebacks, log lines unwrapped
    env.update(TYPER_STANDARD_TRACEBACK="1", COLUMNS="400")
    env["PYTHONPATH"] = pythonpath_with_project(os.environ.get("PYTHONPATH"))
    return env


def run(args: list[str], log: Path, cwd: Path, timeout: float, env=None) -> tuple[int, float]:
    """Run a command, its output to `log`; (exit status, wall s)."""
    t0 = time.time()
    with open(log, "ab") as f:
        f.write(f"$ {' '.join(map(str, args))}\n".encode())
        f.flush()
        p = subprocess.Popen([str(a) for a in args], cwd=cwd, stdout=f, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, env=env or project_env(),
                             start_new_session=True)
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            rc = p.wait()
            f.write(f"\n[bench: killed after {timeout:.0f} s]\n".encode())
    return rc, time.time() - t0


def tail(path: Path, n: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:])


# what vLLM puts before a line of its log: "(EngineCore_DP0 pid=7) ERROR 12-01 05:57:46 [f.py:9] "
LOG_PREFIX = r"^(\(\w+ pid=\d+\)\s*)?((DEBUG|INFO|WARNING|ERROR) \d\d-\d\d [\d:]+ \[[^\]]*\]\s?)?"


def root_cause(text: str, source: str) -> tuple[str | None, str | None]:
    """The first traceback through a file under `source` (a path fragment):
    its exception line and its deepest frame there ("RuntimeError: ...",
    "path:line (code)")."""
    frame = None
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = re.search(r'File "([^"]*' + re.escape(source) + r'[^"]*)", line (\d+)', line)
        if m:
            code = re.sub(LOG_PREFIX, "", lines[i + 1]).strip() if i + 1 < len(lines) else ""
            frame = f"{m.group(1).split('site-packages/')[-1]}:{m.group(2)}"
            if code and not code.startswith(("File ", "^", "~")):
                frame += f" ({code[:120]})"
            continue
        if frame is not None and 'File "' not in line:
            e = re.search(r"\b(\w+(?:Error|Exception)): (.+)$", line)
            if e and not line.lstrip().startswith("raise"):
                return f"{e.group(1)}: {e.group(2).strip()[:300]}", frame
    return None, frame


# -- the two chains ---------------------------------------------------------------------

class Bench:
    def __init__(self, a, work: Path):
        self.a, self.work = a, work
        self.rss = TreeRss()
        self.rss.start()
        demo = tomllib.loads((ROOT / "config.toml").read_text())["stages"]
        st, ev = demo["train"], demo["evaluate"]
        self.s = {"seq_length": demo["prepare"]["seq_length"],
                  "layer_ids": demo["extract"]["layer_ids"],
                  "draft_vocab_size": demo["vocab"]["draft_vocab_size"],
                  "epochs": a.epochs or st.get("epochs", 0), "lr": a.lr or st["lr"],
                  "total_seq_len": st.get("total_seq_len", 0), "ttt_steps": st["ttt_steps"],
                  "rule": {**{k: st[k] for k in ("target_steps", "min_steps", "max_epochs",
                                                 "patience", "min_delta") if k in st},
                           **{k: getattr(a, k) for k in ("target_steps", "min_steps",
                                                          "max_epochs") if getattr(a, k)}},
                  "num_layers": st["num_layers"], "train_ratio": st["train_ratio"],
                  "seed": st["seed"], "num_speculative_tokens": ev["num_speculative_tokens"],
                  "max_tokens": a.max_tokens or ev["max_tokens"]}
        self.kimi = "kimi" in a.target
        self.out = {"target": a.target, "settings": self.s, "cannot_run": []}

    # data: the same conversations for both; held-out first turns for acceptance
    def write_data(self) -> None:
        convs = [json.loads(x) for x in conversations_path().read_text().splitlines() if x]
        held = convs[-self.a.eval_prompts:]
        pool = convs[:-self.a.eval_prompts]
        train = pool[:self.a.samples] if self.a.samples else pool
        with open(self.work / "conversations.jsonl", "w") as f:        # ours: `messages`
            for c in train:
                f.write(json.dumps(c) + "\n")
        with open(self.work / "conversations_sp.jsonl", "w") as f:     # theirs: `conversations`
            for c in train:
                f.write(json.dumps({"conversations": c["messages"]}) + "\n")
        with open(self.work / "prompts.jsonl", "w") as f:
            for c in held:
                first = next(i for i, m in enumerate(c["messages"]) if m["role"] == "user")
                f.write(json.dumps({"messages": c["messages"][:first + 1],
                                    "category": "held-out"}) + "\n")
        self.out.update(conversations=len(train), eval_prompts=len(held))

    def config_text(self, name: str) -> str:
        s = self.s
        return render({
            "run": {"name": name, "runs_dir": "runs"},
            "model": {"target": self.a.target, "trust_remote_code": self.kimi},
            "data": {"path": str(self.work / "conversations.jsonl")},
            "runtime": {"vllm_python": self.a.vllm_python},
            "stages": {
                "regenerate": {"enabled": False},
                "prepare": {"seq_length": s["seq_length"]},
                "extract": {"backend": "auto", "layer_ids": s["layer_ids"]},
                "vocab": {"draft_vocab_size": s["draft_vocab_size"]},
                "train": {"epochs": s["epochs"], "lr": s["lr"],
                          "total_seq_len": s["total_seq_len"], "ttt_steps": s["ttt_steps"],
                          "num_layers": s["num_layers"], "train_ratio": s["train_ratio"],
                          "seed": s["seed"], **s["rule"]},
                "evaluate": {"enabled": True, "prompts": str(self.work / "prompts.jsonl"),
                             "max_prompts": self.a.eval_prompts, "max_tokens": s["max_tokens"],
                             "num_speculative_tokens": s["num_speculative_tokens"],
                             "baseline": False}}})

    # -- ours ---------------------------------------------------------------------------
    def ours(self) -> dict:
        d = self.work / "ours"
        d.mkdir()
        (d / "config.toml").write_text(self.config_text("ours"))
        t0 = time.time()
        rc, wall = run([sys.executable, "-m", "app.cli", "run", "--wait"], d / "run.log", d,
                       self.a.timeout)
        rd = d / "runs" / "ours"
        if rc != 0:
            raise SystemExit(f"ours: `eagle-panel run --wait` exited {rc}:\n{tail(d / 'run.log')}")
        state = json.loads((rd / "state.json").read_text())["stages"]
        steps, end = {}, t0
        for stage in ("prepare", "extract", "vocab", "train"):
            st = state[stage]
            steps[stage] = {"wall_s": st["ended_at"] - st["started_at"],
                            "peak_rss": self.rss.peak(st["started_at"], st["ended_at"]),
                            "disk_bytes": disk_bytes(rd / stage / "out")}
            end = st["ended_at"]
        rows, tokens, sup = rows_tokens(rd / "prepare/out/data")
        steps["prepare"].update(rows=rows, tokens=tokens, supervised_tokens=sup)
        total = {"wall_s": end - t0, "peak_rss": self.rss.peak(t0, end),
                 "disk_bytes": sum(s["disk_bytes"] for s in steps.values()),
                 "run_dir_bytes": disk_bytes(rd)}
        self.ours_rd = rd
        return {"steps": steps, "total": total, "run_wait_s": wall,
                "train_argv": train_direct.recorded_argv(rd), **self.ours_draft(rd, state)}

    def ours_draft(self, rd: Path, state: dict) -> dict:
        """The last epoch's validation (the train stage's summary), and the
        checkpoint evaluate measured (train's choice: not the last epoch's after a
        plateau stop), its optimizer steps and acceptance."""
        ev = state["evaluate"]
        events = [json.loads(x) for x in (rd / "train/events.jsonl").read_text().splitlines() if x]
        summary = [e for e in events if e["type"] == "stage_finished"][-1]["summary"]
        ckpt = measured_checkpoint(rd)
        m = json.loads((rd / "evaluate/out/results.json").read_text())["checkpoints"][ckpt.name]
        return {"val_loss": summary.get("val_loss"), "estimate": summary.get("acceptance_length"),
                "epochs": summary.get("epochs_trained"), "stopped": summary.get("stopped"),
                # the epochs the measured checkpoint holds (named by its epoch, from 0)
                "epochs_measured": int(ckpt.name) + 1 if ckpt.name.isdigit() else None,
                "total_seq_len": summary.get("total_seq_len") or self.s["total_seq_len"],
                "budget": summary.get("budget"),
                "optimizer_steps": optimizer_steps(ckpt), "checkpoint": str(ckpt),
                "evaluate_s": ev["ended_at"] - ev["started_at"],
                "acceptance": m["acceptance_length"], "per_position": m["per_position"],
                "drafts": m["drafts"]}

    def ours_matched(self, theirs: dict, ours: dict) -> dict:
        """Ours again from train on (prepare, extract and vocab are kept: their config
        is unchanged), with total_seq_len scaled so that it takes as many optimizer
        steps per epoch as theirs: theirs has one row per assistant turn, ours one per
        conversation, so at the same tokens per step theirs takes more, smaller steps."""
        d = self.ours_rd.parent.parent
        seq, why = matched_total_seq_len(ours, theirs, self.s["seq_length"])
        if seq is None:
            return {"skipped": why}
        # the epochs ours trained, fixed: the budget rule would re-plan them for the new size
        write(d / "config.toml", merged(tomllib.loads((d / "config.toml").read_text()), {
            "stages": {"train": {"total_seq_len": seq,
                                 "epochs": ours["epochs"] or self.s["epochs"]}}}))
        rc, _ = run([sys.executable, "-m", "app.cli", "run", "--wait"], d / "run.log", d,
                    self.a.timeout)
        if rc != 0:   # optional: the figures measured before it are kept
            return {"failed": f"`eagle-panel run --wait` exited {rc}: {tail(d / 'run.log', 8)}"}
        state = json.loads((self.ours_rd / "state.json").read_text())["stages"]
        st = state["train"]
        return {"total_seq_len": seq, "train_wall_s": st["ended_at"] - st["started_at"],
                **self.ours_draft(self.ours_rd, state)}

    # -- theirs -------------------------------------------------------------------------
    def server(self, name: str, connector: dict, extra: list[str]):
        """A vLLM server for their chain: launch_vllm.py's flags, served the way
        every eagle-panel stage serves (CPU platform, KV space, --enforce-eager)."""
        from pipeline.model.info import kv_bytes_per_token, read_model
        from pipeline.vllm.environment import probe
        from pipeline.vllm.server import make_server
        target = self.target_path()
        info = read_model(target)
        layers = list(self.s["layer_ids"]) + [info.layers]
        spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layers}}}
        max_len = self.s["seq_length"] + 8
        per_token = kv_bytes_per_token(info, 1, 4) + len(layers) * info.hidden * 4
        srv = make_server(0, probe(self.a.vllm_python), target, [], self.sp / f"vllm-{name}.log",
                          "float32", max_len, self.kimi,
                          [vs.FLAG_SPECULATIVE_CONFIG, json.dumps(spec),
                           vs.FLAG_KV_TRANSFER_CONFIG, json.dumps(connector), *extra],
                          kv_tokens=32 * max_len, kv_bytes_per_token=per_token)
        srv.api_key = ""   # their clients send no key (render) or "EMPTY" (openai): none set
        return srv

    def cannot_run(self, step: str, log: Path, rc, substitute: str) -> None:
        error, frame = root_cause(log.read_text(errors="replace"), "speculators/")
        self.out["cannot_run"].append({"step": step, "ran": False, "exit": rc, "error": error,
                                       "source": frame, "log": str(log),
                                       "substitute": substitute})

    def start(self, srv) -> None:
        with open(self.sp / "chain.log", "a") as f, contextlib.redirect_stdout(f):
            srv.start()   # its command line to the log
        self.out.setdefault("their_servers", []).append(srv.argv)

    def target_path(self) -> Path:
        from pipeline import config as config_mod
        return config_mod.load(self.work / "ours" / "config.toml").target_path()

    def theirs(self, ours_argv: list[str]) -> dict:
        sp = self.sp = self.work / "theirs"
        sp.mkdir()
        env = project_env(HF_DATASETS_CACHE=str(sp / "hf_datasets_cache"))
        from pipeline.vllm import compat
        target = self.target_path()
        trust = ["--trust-remote-code"] if self.kimi else []
        steps = {}

        def step(name, t0, t1, *paths, **more):
            steps[name] = {"wall_s": t1 - t0, "peak_rss": self.rss.peak(t0, t1),
                           "disk_bytes": disk_bytes(*paths), **more}

        own = {"kv_connector": compat.OWN_CONNECTOR_CLASS, "kv_role": "kv_producer",
               "kv_connector_module_path": compat.OWN_CONNECTOR_MODULE,
               "kv_connector_extra_config": {"shared_storage_path": str(sp / "staging")}}
        srv = self.server("hs", own, [vs.FLAG_ENABLE_SCALE_OUT])
        t_all = time.time()
        self.start(srv)
        try:
            srv.wait_ready(self.a.timeout, lambda: False)
            t1 = time.time()
            step("vllm server start", t_all, t1)
            rc, wall = run([SPECULATORS, "prepare-data", "--model", target,
                            "--data", self.work / "conversations_sp.jsonl",
                            "--output", sp / "data", "--seq-length", self.s["seq_length"],
                            "--seed", self.s["seed"], "--render-endpoint", srv.url,
                            "--no-skip-token-freq", *trust], sp / "prepare-data.log", sp,
                           self.a.timeout, env)
            step("prepare-data", t1, t1 + wall, sp / "data", sp / "hf_datasets_cache")
            if rc:
                # e.g. a Kimi-K2.5 wrapper: their prepare-data loads the target's
                # AutoProcessor first, whose image processor needs torchvision
                self.cannot_run("speculators prepare-data", sp / "prepare-data.log", rc,
                                "eagle-panel's prepared rows (speculators' format: the "
                                "prepare stage's data/ and token_freq.pt) instead")
                steps["prepare-data"]["ran"] = False
                shutil.rmtree(sp / "data", ignore_errors=True)
                shutil.copytree(self.ours_rd / "prepare/out/data", sp / "data")
                shutil.copy(self.ours_rd / "prepare/out/token_freq.pt", sp / "data")
            rows, tokens, sup = rows_tokens(sp / "data")
            steps["prepare-data"].update(rows=rows, tokens=tokens, supervised_tokens=sup)
            t2 = time.time()
            rc, wall = run([SPECULATORS, "generate-offline-data", "--endpoint", srv.url + vs.API_V1,
                            "--preprocessed-data", sp / "data", "--fail-on-error"],
                           sp / "generate.log", sp, self.a.timeout, env)
            if rc:
                raise SystemExit(f"theirs: generate-offline-data exited {rc}:\n"
                                 f"{tail(sp / 'generate.log')}\n{tail(sp / 'vllm-hs.log')}")
        finally:
            t3 = time.time()
            srv.stop()
        t4 = time.time()
        step("generate-offline-data", t2, t4, sp / "data" / "hidden_states", sp / "staging",
             server_stop_s=t4 - t3)

        self.sp_argv = their_train_argv(ours_argv, sp, self.s["num_layers"])
        t5 = time.time()
        rc, wall = run([sys.executable, "-c", PATCHED_TRAIN, *self.sp_argv], sp / "train.log",
                       sp, self.a.timeout, {**env, "VS_VAL_LOG": str(sp / "val.jsonl")})
        if rc:
            raise SystemExit(f"theirs: train (their CLI, CPU patches) exited {rc}:\n"
                             f"{tail(sp / 'train.log')}")
        step("train", t5, t5 + wall, sp / "ckpt", sp / "logs")
        end = t5 + wall
        ckpt = self.theirs_ckpt = last_checkpoint(sp / "ckpt")
        self.theirs_best = best_checkpoint(sp / "ckpt")
        vals = [json.loads(x) for x in (sp / "val.jsonl").read_text().splitlines() if x]
        val = {k.removesuffix("_epoch"): v for k, v in vals[-1].items()}
        total = {"wall_s": end - t_all, "peak_rss": self.rss.peak(t_all, end),
                 "disk_bytes": sum(s["disk_bytes"] for s in steps.values())}
        return {"steps": steps, "total": total, "val_loss": val.get("loss"), "epochs": len(vals),
                "estimate": estimate(val, self.s["ttt_steps"]),
                "optimizer_steps": optimizer_steps(ckpt), "checkpoint": str(ckpt),
                "checkpoint_best": str(self.theirs_best) if self.theirs_best else None,
                "train_argv": self.sp_argv}

    # -- untimed: acceptance of theirs, the probes of what cannot run ---------------------
    def their_acceptance(self, ckpt: Path | None = None,
                         name: str = "theirs") -> tuple[dict | None, str | None]:
        ckpt = ckpt or self.theirs_ckpt
        d = self.work / f"{name}-eval"
        rd = d / "runs" / name
        dest = rd / "train" / "out" / "checkpoints" / ckpt.name
        dest.parent.mkdir(parents=True)
        shutil.copytree(ckpt, dest, copy_function=os.link)
        (d / "config.toml").write_text(self.config_text(name))
        rc, _ = run([sys.executable, "-m", "pipeline.stages.evaluate", "--run-dir", rd,
                     "--config", d / "config.toml"], d / "evaluate.log", d, self.a.timeout)
        res = rd / "evaluate/out/results.json"
        if rc or not res.exists():
            events = [json.loads(x) for x in (rd / "evaluate/events.jsonl").read_text()
                      .splitlines() if x] if (rd / "evaluate/events.jsonl").exists() else []
            errs = [e["message"] for e in events if e["type"] == "error"]
            return None, (errs[-1] if errs else f"evaluate exited {rc}: "
                          f"{tail(d / 'evaluate.log', 5)}")
        m = json.loads(res.read_text())["checkpoints"][ckpt.name]
        return m, None

    def theirs_default_epochs(self) -> dict:
        """Their train again at their own default epochs (speculators' 20:
        --epochs left out), on the same rows and hidden states; its draft's
        acceptance measured by the same evaluate."""
        sp, argv = self.sp, list(self.sp_argv)
        i = argv.index("--epochs")
        del argv[i:i + 2]
        argv[argv.index("--save-path") + 1] = str(sp / "ckpt-default")
        argv[argv.index("--log-dir") + 1] = str(sp / "logs-default")
        env = project_env(HF_DATASETS_CACHE=str(sp / "hf_datasets_cache"),
                          VS_VAL_LOG=str(sp / "val-default.jsonl"))
        rc, wall = run([sys.executable, "-c", PATCHED_TRAIN, *argv], sp / "train-default.log",
                       sp, self.a.timeout, env)
        if rc:
            raise SystemExit(f"theirs (default epochs): train exited {rc}:\n"
                             f"{tail(sp / 'train-default.log')}")
        ckpt = last_checkpoint(sp / "ckpt-default")
        vals = [json.loads(x) for x in (sp / "val-default.jsonl").read_text().splitlines() if x]
        val = {k.removesuffix("_epoch"): v for k, v in vals[-1].items()}
        m, why = self.their_acceptance(ckpt, "theirs-default")
        return {"epochs": len(vals), "train_wall_s": wall, "optimizer_steps": optimizer_steps(ckpt),
                "val_loss": val.get("loss"), "estimate": estimate(val, self.s["ttt_steps"]),
                "acceptance": m["acceptance_length"] if m else None, "why": why}

    def probe_stock_connector(self) -> dict:
        """generate-offline-data against launch_vllm.py's own `file` backend."""
        stock = {"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
                 "kv_connector_extra_config": {"shared_storage_path": str(self.sp / "stock")}}
        srv = self.server("stock", stock, [])
        log = self.sp / "probe-generate.log"
        self.start(srv)
        try:
            srv.wait_ready(self.a.timeout, lambda: False)
            rc, _ = run([SPECULATORS, "generate-offline-data", "--endpoint", srv.url + vs.API_V1,
                         "--preprocessed-data", self.sp / "data", "--output",
                         self.sp / "stock_hs", "--max-samples", "1", "--fail-on-error",
                         "--max-retries", "0"], log, self.sp, 300,
                        project_env(HF_DATASETS_CACHE=str(self.sp / "hf_datasets_cache")))
            time.sleep(2)   # the engine's traceback reaches its log
        except Exception as e:  # noqa: BLE001 - a server that does not start is the finding
            rc = f"server: {e}"
        finally:
            srv.stop()
        client = [x for x in log.read_text(errors="replace").splitlines()
                  if "Fatal" in x or "Error code" in x][-1:] if log.exists() else []
        # rich's log line: "[06:03:06] ERROR    Fatal: ...      generate_offline_data.py:174"
        client = [re.sub(r"\s{2,}\S+\.py:\d+\s*$", "",
                         re.sub(r"^\[[\d:]+\]\s+[A-Z]+\s+", "", x.strip())) for x in client]
        error, frame = root_cause(srv.log_path.read_text(errors="replace"),
                                  "example_hidden_states_connector.py")
        return {"step": "generate-offline-data with the stock ExampleHiddenStatesConnector",
                "ran": rc == 0, "exit": rc, "client": client[0].strip()[:300] if client else None,
                "error": error, "source": frame, "log": str(srv.log_path),
                "then": self.stock_next_blocker(),
                "substitute": "eagle-panel's CPU-aware connector (pipeline.vllm.connector, "
                              "kv_connector_module_path) in the same server, with their client"}

    def stock_next_blocker(self) -> str | None:
        """What stops the stock connector next (read from the installed source;
        run with pinned memory patched out in docs/FACTS.md): get_finished
        polls `event.query()` on the copy event, and the CPU worker's
        torch.cuda.Event stand-in has no `query`."""
        from pipeline.vllm.environment import probe
        root = Path(probe(self.a.vllm_python).vllm_dir or "")
        conn = root / "distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py"
        shm = root / "v1/worker/cpu/shm.py"
        if not conn.exists() or not shm.exists():
            return None
        at = [n for n, x in enumerate(conn.read_text().splitlines(), 1) if ".query()" in x]
        text = shm.read_text()
        holder = text[text.find("class _EventPlaceholder"):].split("\nclass ", 2)[0]
        if not at or "class _EventPlaceholder" not in text or "query" in holder:
            return None
        return (f"then get_finished polls event.query() (vllm/{conn.relative_to(root)}:{at[0]}) "
                f"on the CPU worker's torch.cuda.Event stand-in, vllm/{shm.relative_to(root)}'s "
                "_EventPlaceholder, which has no query (AttributeError)")

    def probe_plain_train(self) -> dict:
        argv = list(self.sp_argv)
        argv[argv.index("--save-path") + 1] = str(self.sp / "probe_ckpt")
        log = self.sp / "probe-train.log"
        rc, _ = run([SPECULATORS, "train", *argv], log, self.sp, 300,
                    project_env(HF_DATASETS_CACHE=str(self.sp / "hf_datasets_cache")))
        error, frame = root_cause(log.read_text(errors="replace"), "speculators/")
        return {"step": "speculators train (as shipped)", "ran": rc == 0, "exit": rc,
                "error": error, "source": frame, "log": str(log),
                "substitute": "their CLI's train command in a process with eagle-panel's three "
                              "CPU patches (pipeline.train.cpu_patches): their trainer, not "
                              "their CLI as shipped"}


def their_train_argv(ours: list[str], sp: Path, num_layers: int) -> list[str]:
    """Ours' recorded trainer flags with their paths; the vocabulary mapping
    left to their trainer (--draft-vocab-size + prepare-data's token_freq.pt),
    and eagle-panel's own MLA draft layer (pipeline.train.mla_draft.mla_argv:
    --draft-config, --no-norm-before-fc instead of --num-layers) undone: stock
    speculators trains a Llama-layer draft."""
    if "--draft-config" in ours:
        ours = [x for x in ours if x != "--no-norm-before-fc"] + ["--num-layers", str(num_layers)]
    out, skip = [], {"--d2t-path", "--t2d-path", "--draft-config", "--hidden-states-path"}
    paths = {"--data-path": sp / "data", "--save-path": sp / "ckpt", "--log-dir": sp / "logs"}
    it = iter(range(len(ours)))
    for i in it:
        tok = ours[i]
        if tok in skip:
            next(it, None)
            continue
        out.append(tok)
        if tok in paths:
            out.append(str(paths[tok]))
            next(it, None)
    return out


def measured_checkpoint(rd: Path) -> Path:
    """The checkpoint a run's evaluate measured (its summary's checkpoint_path),
    else the last one."""
    events = [json.loads(x) for x in (rd / "evaluate/events.jsonl").read_text().splitlines() if x]
    done = [e for e in events if e["type"] == "stage_finished"]
    path = done[-1]["summary"].get("checkpoint_path") if done else None
    return Path(path) if path else last_checkpoint(rd / "train/out/checkpoints")


def matched_total_seq_len(ours: dict, theirs: dict, seq_length: int) -> tuple[int | None, str]:
    """(ours' total_seq_len at which it takes as many optimizer steps per epoch as
    theirs, or None; why not). Per epoch, not per run: ours may stop on a plateau
    before the epochs theirs trains. Config refuses a total_seq_len given below
    seq_length (a whole sample must fit; only the budget rule, which knows the
    data, goes down to the longest sample)."""
    # ours' steps are the measured checkpoint's: per epoch, by the epochs it holds
    o_ep, t_ep = ours.get("epochs_measured") or ours.get("epochs") or 0, theirs.get("epochs") or 0
    if not (ours.get("optimizer_steps") and theirs.get("optimizer_steps") and o_ep and t_ep):
        return None, "the optimizer steps or epochs of one side are unknown"
    per_ours, per_theirs = ours["optimizer_steps"] / o_ep, theirs["optimizer_steps"] / t_ep
    seq = round(ours["total_seq_len"] * per_ours / per_theirs)
    if seq < seq_length:
        return None, (f"theirs takes {per_theirs:.0f} steps an epoch, ours {per_ours:.0f} at "
                      f"total_seq_len {ours['total_seq_len']}: matching needs total_seq_len "
                      f"{seq}, below seq_length {seq_length}, the least config takes for a "
                      "total_seq_len it is given (a whole sample must fit)")
    return seq, ""


def best_checkpoint(save: Path) -> Path | None:
    """The epoch folder speculators marks `checkpoint_best` (its lowest
    validation loss), None where it marked none."""
    best = save / "checkpoint_best"
    return save / best.resolve().name if best.exists() else None   # as last_checkpoint names it


def last_checkpoint(save: Path) -> Path:
    """The last epoch's checkpoint (what evaluate's `checkpoints = "last"` serves)."""
    return max((p for p in save.iterdir() if p.name.isdigit() and not p.is_symlink()),
               key=lambda p: int(p.name))


def optimizer_steps(ckpt: Path) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        return json.loads((ckpt / "training_state.json").read_text()).get("global_step")
    return None


def estimate(val: dict, ttt_steps: int) -> float | None:
    """Train's estimate of the acceptance length: 1 + the full accuracies."""
    accs = [val.get(f"full_acc_{i}") for i in range(ttt_steps)]
    return None if None in accs else 1.0 + sum(accs)


# -- report -------------------------------------------------------------------------------

def fmt(x, spec: str = ".3f") -> str:
    return "n/a" if x is None else format(x, spec)


def line(who: str, step: str, s: dict) -> str:
    extra = f"  rows {s['rows']:,}  tokens {s['tokens']:,}" if "rows" in s else ""
    return (f"{who:6} {step:22} {s['wall_s']:7.1f} s  peak RSS {s['peak_rss'] / MiB:8.1f} MiB  "
            f"disk {s['disk_bytes']:>13,} B{extra}")


def count(text: str) -> int:
    """A whole number >= 0 (argparse: anything else is exit 2, said)."""
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: a whole number >= 0")
    return int(text)


def positive_or_zero(text: str) -> float:
    """A learning rate: a number >= 0 (0: the demo's)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: a number >= 0, e.g. 0.01")
    return value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="builtin:tiny-llama",
                    help="builtin:tiny-llama | builtin:tiny-kimi | a local model folder")
    ap.add_argument("--samples", type=int, default=0,
                    help="train on the first N bundled conversations (0: all but the held-out)")
    ap.add_argument("--epochs", type=int, default=0,
                    help="0: the demo's (config.toml: by default the budget rule)")
    ap.add_argument("--eval-prompts", type=int, default=40,
                    help="bundled conversations held out from both: their first turns are "
                         "the prompts vLLM measures acceptance on")
    ap.add_argument("--max-tokens", type=int, default=0, help="per prompt; 0: the demo's")
    ap.add_argument("--lr", type=positive_or_zero, default=0.0,
                    help="both trainers' learning rate; 0: the demo's (a small size reaches "
                         "its plateau in few steps only at a larger one)")
    for opt in ("target-steps", "min-steps", "max-epochs"):   # the budget rule, smaller
        ap.add_argument(f"--{opt}", type=count, default=0,
                        help=f"[stages.train] {opt.replace('-', '_')} for the rule (with "
                             "--epochs 0); 0: the demo's")
    ap.add_argument("--vllm-python", default=os.environ.get(
        "VLLM_PYTHON", str(VLLM_VENV / "bin" / "python")))
    ap.add_argument("--timeout", type=float, default=1800, help="per step, seconds")
    ap.add_argument("--no-match-steps", dest="match_steps", action="store_false",
                    help="leave out ours again from train on with as many optimizer steps as "
                         "theirs (total_seq_len scaled; after everything else)")
    ap.add_argument("--their-default-epochs", action="store_true",
                    help="also train theirs at speculators' own default epochs (20), its "
                         "acceptance measured (minutes more on a CPU)")
    ap.add_argument("--no-probes", dest="probes", action="store_false",
                    help="leave out the runs of what cannot run here (the stock connector, "
                         "their train as shipped: a server start and a training whose errors "
                         "are the same on every CPU run); said in the output")
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--keep", type=Path, help="work in this folder and keep it")
    a = ap.parse_args()
    if a.keep:
        a.keep.mkdir(parents=True, exist_ok=False)
    work = a.keep or Path(tempfile.mkdtemp(prefix="vs-sp-"))
    b = Bench(a, work)
    try:
        b.write_data()
        s = b.s
        print(f"target {a.target}: {b.out['conversations']} conversations, "
              f"{b.out['eval_prompts']} more held out for acceptance; epochs {s['epochs']}, "
              f"lr {s['lr']}, seq_length {s['seq_length']}, total_seq_len {s['total_seq_len']}, "
              f"layer ids {s['layer_ids']}, draft vocab {s['draft_vocab_size']}, "
              f"{s['num_speculative_tokens']} draft tokens", flush=True)
        ours = b.ours()
        for name, st in ours["steps"].items():
            print(line("ours", name, st), flush=True)
        print(line("ours", "all (run --wait)", ours["total"]) + f"  (+ evaluate "
              f"{ours['evaluate_s']:.1f} s)", flush=True)
        print(f"ours: {ours['epochs']} epochs at total_seq_len {ours['total_seq_len']}, "
              f"{ours['optimizer_steps']} optimizer steps; stopped: {ours['stopped']} "
              f"(budget: {ours['budget']}); measured: epoch "
              f"{Path(ours['checkpoint']).name} ({ours['epochs_measured']} epochs' training)",
              flush=True)
        theirs = b.theirs(ours["train_argv"])
        for name, st in theirs["steps"].items():
            print(line("theirs", name, st), flush=True)
        print(line("theirs", "all", theirs["total"]), flush=True)

        # untimed, side by side: their acceptance, the two probes
        results = {}

        def bg(key, fn):
            try:
                results[key] = fn()
            except BaseException as e:  # noqa: BLE001 - reported, never lost
                results[key] = e
        jobs = [("acc", b.their_acceptance)]
        best = b.theirs_best
        if best is not None and best.name != b.theirs_ckpt.name:   # speculators' own pick too
            jobs.append(("best", lambda: b.their_acceptance(best, "theirs-best")))
        if a.probes:
            jobs += [("stock", b.probe_stock_connector), ("train", b.probe_plain_train)]
        else:
            print("probes left out (--no-probes): the stock connector and speculators train "
                  "as shipped were not run", flush=True)
        threads = [threading.Thread(target=bg, args=job) for job in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if isinstance(results.get("best"), BaseException):   # optional: the rest is kept
            e = results["best"]
            results["best"] = (None, f"{type(e).__name__}: {e}")
        for k, _ in jobs:
            if isinstance(results[k], BaseException):
                raise results[k]
        their_m, why = results["acc"]
        b.out["cannot_run"] += [results[k] for k, _ in jobs if k not in ("acc", "best")]
        b.out["probes"] = a.probes
        for c in b.out["cannot_run"]:
            if c["ran"]:
                print(f"runs here after all: {c['step']}", flush=True)
                continue
            print(f"cannot run here: {c['step']}: {c['error']} [{c['source']}]"
                  + (f"; their client: {c['client']}" if c.get("client") else "")
                  + (f"; {c['then']}" if c.get("then") else "")
                  + f"; instead: {c['substitute']}", flush=True)

        # the steps both ran: a step of theirs that could not run, and ours' counterpart, out
        pairs = [("prepare", ("prepare-data",)),
                 ("extract", ("vllm server start", "generate-offline-data")),
                 ("train", ("train",))]
        skipped = [(o, t) for o, t in pairs
                   if not all(theirs["steps"][x].get("ran", True) for x in t)]
        both = {k: {"ours": ours["total"][k] - sum(ours["steps"][o][k] for o, _ in skipped),
                    "theirs": theirs["total"][k] - sum(theirs["steps"][x][k]
                                                       for _, t in skipped for x in t)}
                for k in ("wall_s", "disk_bytes")}
        wall_ratio = both["wall_s"]["ours"] / both["wall_s"]["theirs"]
        disk_ratio = both["disk_bytes"]["ours"] / max(1, both["disk_bytes"]["theirs"])
        rss_ratio = ours["total"]["peak_rss"] / max(1, theirs["total"]["peak_rss"])
        left_out = f" (without {', '.join(o for o, _ in skipped)}: theirs could not run)" \
            if skipped else ""
        print(f"wall, prepare to trained draft{left_out}: ours {both['wall_s']['ours']:.1f} s, "
              f"theirs {both['wall_s']['theirs']:.1f} s: {wall_ratio:.2f}x (target <= 1.0x)")
        tok_o, tok_t = ours["steps"]["prepare"]["tokens"], theirs["steps"]["prepare-data"]["tokens"]
        for o, t in pairs:
            tw = sum(theirs["steps"][x]["wall_s"] for x in t)
            print(f"  {o:8} ours {ours['steps'][o]['wall_s']:7.1f} s  theirs {tw:7.1f} s  "
                  f"{ours['steps'][o]['wall_s'] / tw:.2f}x" +
                  ("  (theirs did not run)" if (o, t) in skipped else ""))
        sup_o = ours["steps"]["prepare"]["supervised_tokens"]
        sup_t = theirs["steps"]["prepare-data"]["supervised_tokens"]
        print(f"  prepared rows: ours {ours['steps']['prepare']['rows']:,} ({tok_o:,} tokens, "
              f"{sup_o:,} supervised), theirs {theirs['steps']['prepare-data']['rows']:,} "
              f"({tok_t:,} tokens, {sup_t:,} supervised)"
              + ("; theirs is a row per assistant turn, each with its conversation so far: "
                 "at the same total_seq_len it takes more, smaller optimizer steps"
                 if tok_t > tok_o else ""))
        print(f"disk{left_out}: ours {both['disk_bytes']['ours']:,} B, theirs "
              f"{both['disk_bytes']['theirs']:,} B: {disk_ratio:.2f}x (target <= 1.0x)")
        print(f"peak RSS: ours {ours['total']['peak_rss'] / MiB:.1f} MiB, theirs "
              f"{theirs['total']['peak_rss'] / MiB:.1f} MiB: {rss_ratio:.2f}x")
        print(f"val loss, last epoch (each trainer's own split): ours "
              f"{fmt(ours['val_loss'], '.4f')}, theirs {fmt(theirs['val_loss'], '.4f')}; "
              f"optimizer steps: ours {ours['optimizer_steps']}, theirs "
              f"{theirs['optimizer_steps']}; train's estimate: ours {fmt(ours['estimate'])}, "
              f"theirs {fmt(theirs['estimate'])}")
        acc_o = ours["acceptance"]
        acc_t = their_m["acceptance_length"] if their_m else None
        n = b.out["eval_prompts"]
        if acc_t is not None:
            print(f"acceptance length (vLLM, {n} held-out prompts): ours {acc_o:.3f}, theirs "
                  f"{acc_t:.3f}: ours / theirs {acc_o / acc_t:.3f} (target >= 1.02)", flush=True)
        else:
            print(f"acceptance length (vLLM, {n} held-out prompts): ours {acc_o:.3f}, theirs "
                  f"not measured: {why}", flush=True)
        best_m, best_why = results.get("best", (their_m, why) if best is not None else
                                       (None, "speculators marked none"))
        acc_b = best_m["acceptance_length"] if best_m else None
        if best is None:
            print("theirs' checkpoint_best: speculators marked none", flush=True)
        else:
            same = " (their last epoch: the same checkpoint)" \
                if best.name == b.theirs_ckpt.name else ""
            print(f"theirs' checkpoint_best (epoch {best.name}){same}: acceptance length "
                  + (f"{acc_b:.3f}: ours / theirs' best {acc_o / acc_b:.3f} (target >= 1.0)"
                     if acc_b else f"not measured: {best_why}"), flush=True)
        matched = b.ours_matched(theirs, ours) if a.match_steps else None
        if matched is not None and ("skipped" in matched or "failed" in matched):
            print(f"ours, steps matched: not measured: {matched.get('skipped') or matched['failed']}",
                  flush=True)
        elif matched is not None:
            ratio = f": ours / theirs {matched['acceptance'] / acc_t:.3f}" if acc_t else ""
            print(f"ours, steps matched (total_seq_len {matched['total_seq_len']}): "
                  f"{matched['optimizer_steps']} optimizer steps, train "
                  f"{matched['train_wall_s']:.1f} s (theirs "
                  f"{theirs['steps']['train']['wall_s']:.1f} s), val loss "
                  f"{fmt(matched['val_loss'], '.4f')}, acceptance length "
                  f"{matched['acceptance']:.3f}{ratio}", flush=True)
            # the whole chain again, ours' train being the matched one
            mw = both["wall_s"]["ours"] - ours["steps"]["train"]["wall_s"] + matched["train_wall_s"]
            matched.update(wall_s=mw, wall_ratio=mw / both["wall_s"]["theirs"])
            print(f"wall, prepare to trained draft, steps matched: ours {mw:.1f} s, theirs "
                  f"{both['wall_s']['theirs']:.1f} s: {matched['wall_ratio']:.2f}x", flush=True)
        if a.their_default_epochs:
            td = b.theirs_default_epochs()
            td["wall_s"] = both["wall_s"]["theirs"] - theirs["steps"]["train"]["wall_s"] \
                + td["train_wall_s"]
            print(f"theirs at their default epochs ({td['epochs']}): {td['optimizer_steps']} "
                  f"optimizer steps, train {td['train_wall_s']:.1f} s, val loss "
                  f"{fmt(td['val_loss'], '.4f')}, estimate {fmt(td['estimate'])}, acceptance "
                  f"length {fmt(td['acceptance'])}"
                  + (f": ours / theirs {acc_o / td['acceptance']:.3f}" if td["acceptance"] else
                     f" ({td['why']})")
                  + f"; wall, prepare to trained draft: ours {both['wall_s']['ours']:.1f} s, "
                  f"theirs {td['wall_s']:.1f} s: {both['wall_s']['ours'] / td['wall_s']:.2f}x",
                  flush=True)
            b.out["theirs_default_epochs"] = td
        b.out.update(
            ours=ours, theirs=theirs, wall_ratio=wall_ratio, disk_ratio=disk_ratio,
            compared_steps=[o for o, t in pairs if (o, t) not in skipped], both=both,
            rss_ratio=rss_ratio, acceptance_ours=acc_o, acceptance_theirs=acc_t,
            acceptance_theirs_reason=why, acceptance_theirs_best=acc_b,
            theirs_best_epoch=best.name if best else None,
            acceptance_theirs_best_reason=best_why if acc_b is None else None,
            acceptance_theirs_per_position=their_m["per_position"] if their_m else None,
            acceptance_theirs_drafts=their_m["drafts"] if their_m else None,
            ours_steps_matched=matched)
        if a.json:
            a.json.write_text(json.dumps(b.out, indent=1, default=str) + "\n")
    finally:
        b.rss.stopped.set()
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
