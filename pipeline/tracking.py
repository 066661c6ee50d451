"""The trackers ML engineers already watch: TensorBoard, MLflow, W&B, Trackio.

`[tracking] loggers = ["tensorboard", "mlflow"]` hands them to speculators'
own trainer (`--logger`, `--log-dir`, `--run-name`: its handlers, not ours),
and evaluate logs what vLLM measured through the same handlers under the same
run name, so a tracker shows the measured acceptance beside the loss, at the
step of the checkpoint it was measured for.

Local by default, so nothing needs a network: everything lands in
`<run>/tracking/` (TensorBoard event files in `logs/<run id>/`, an MLflow
SQLite store `mlflow.db` — MLflow 3 refuses its old file store — W&B in
offline mode in `logs/wandb/`, Trackio's local store in `trackio/`). A variable the user set in the
stage's environment (`MLFLOW_TRACKING_URI` of a team server, `WANDB_MODE`)
wins over these defaults. MLflow and W&B resume the same run by name / id, so
train's and evaluate's figures are one run in each; speculators starts
Trackio's runs with `resume="never"` in its project "speculators", so there
evaluate's figures may be a second run of the same name (W&B and Trackio are
not installed here: their paths are read from speculators' handlers, not run).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

# logger name -> (modules it needs, the pip packages that provide them); the
# local MLflow store is SQLite, which mlflow-skinny reaches through SQLAlchemy
# and Alembic. (pipeline.envprobe looks for the same modules.)
TRACKERS = {
    "tensorboard": (("tensorboard",), "tensorboard"),
    "mlflow": (("mlflow", "sqlalchemy", "alembic"), "mlflow-skinny sqlalchemy alembic"),
    "wandb": (("wandb",), "wandb"),
    "trackio": (("trackio",), "trackio"),
}
EXPERIMENT = "eagle-panel"   # MLflow experiment / W&B project the runs go in


def tracking_dir(run_path: Path) -> Path:
    return Path(run_path) / "tracking"


def log_dir(run_path: Path) -> Path:
    """speculators' --log-dir: its TensorBoard handler writes <this>/<run
    name>/, its W&B handler <this>/wandb/ (`wandb.init(dir=)`, over WANDB_DIR)."""
    return tracking_dir(run_path) / "logs"


def stage_env(run_path: Path, run_id: str, loggers: list[str]) -> dict[str, str]:
    """The environment defaults that keep each tracker local, in the run."""
    if not loggers:
        return {}
    d = tracking_dir(run_path)
    env = {}
    if "mlflow" in loggers:
        env.update(MLFLOW_TRACKING_URI=f"sqlite:///{d / 'mlflow.db'}",
                   MLFLOW_EXPERIMENT_NAME=EXPERIMENT)
    if "wandb" in loggers:
        env.update(WANDB_MODE="offline", WANDB_DIR=str(d), WANDB_PROJECT=EXPERIMENT,
                   WANDB_RUN_ID=run_id, WANDB_RESUME="allow")
    if "trackio" in loggers:
        env.update(TRACKIO_DIR=str(d / "trackio"))
    return env


def apply_env(run_path: Path, run_id: str, loggers: list[str]) -> None:
    """Set `stage_env` in this process (a stage's), not over what the user set."""
    for k, v in stage_env(run_path, run_id, loggers).items():
        os.environ.setdefault(k, v)


def trainer_flags(run_path: Path, run_id: str, loggers: list[str]) -> list[str]:
    """speculators train's logger flags (`--logger ""`: none)."""
    return ["--logger", ",".join(loggers), "--log-dir", str(log_dir(run_path)),
            "--run-name", run_id]


def missing(loggers: list[str], have=None) -> list[tuple[str, str]]:
    """(logger, pip packages) for each configured tracker that cannot
    import; `have(module)`: whether a module is there (default: here)."""
    have = have or (lambda m: importlib.util.find_spec(m) is not None)
    return [(name, TRACKERS[name][1]) for name in loggers
            if not all(have(m) for m in TRACKERS[name][0])]


def require(loggers: list[str], error) -> None:
    """A configured tracker that cannot import fails the stage at its start
    (`error(message, hint=...)`: StageError), never at its first figure."""
    gone = missing(loggers)
    if gone:
        raise error(f"[tracking] loggers: {', '.join(n for n, _ in gone)} not installed in the "
                    "stages' environment",
                    hint=f"pip install {' '.join(p for _, p in gone)} (or scripts/install.sh "
                         "--trackers), or take it out of [tracking] loggers")


def log_measured(run_path: Path, run_id: str, loggers: list[str],
                 points: list[tuple[int, dict]]) -> None:
    """Evaluate's figures, each (step, {"eval": {...}}), to the trackers of
    the train stage's run, through speculators' own handlers."""
    if not loggers:
        return
    from speculators.train.logger import setup_metric_logger
    apply_env(run_path, run_id, loggers)
    setup_metric_logger(loggers=loggers, run_name=run_id, output_dir=str(log_dir(run_path)))
    log = logging.getLogger("speculators.metrics")
    try:
        for step, values in points:
            log.info(values, extra={"step": step})
    finally:
        close()


def close() -> None:
    """Flush and close the metric handlers (event files, the MLflow run)."""
    log = logging.getLogger("speculators.metrics")
    for h in list(log.handlers):
        h.flush()
        h.close()
        log.removeHandler(h)


def where(run_path: Path, loggers: list[str]) -> list[str]:
    """How to look at each tracker of a run: the command, local by default."""
    d = tracking_dir(run_path)
    out = []
    for name in loggers:
        if name == "tensorboard":
            out.append(f"tensorboard --logdir {log_dir(run_path)}")
        elif name == "mlflow":
            uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{d / 'mlflow.db'}"
            out.append(f"mlflow ui --backend-store-uri {uri}")
        elif name == "wandb":
            out.append(f"wandb sync {log_dir(run_path) / 'wandb'}")
        elif name == "trackio":
            out.append(f"TRACKIO_DIR={d / 'trackio'} trackio show")
    return out
