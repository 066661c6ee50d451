import os
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def stagekit_config(tmp_path: Path, actions: dict[str, str] | None = None, extra: str = "",
                    name: str = "t") -> Path:
    """A config whose four stages are tests.stagekit, each with its action."""
    actions = actions or {}
    parts = [f'[run]\nname = "{name}"\nruns_dir = "runs"\n',
             '[runtime]\ncancel_grace_s = 2.0\nterm_grace_s = 2.0\n', extra]
    count = tmp_path / "starts.txt"
    for stage in ("prepare", "extract", "vocab", "train"):
        parts.append(textwrap.dedent(f"""
            [stages.{stage}]
            entry = "tests.stagekit"
            env = {{ STAGEKIT = "{actions.get(stage, 'ok')}", STAGEKIT_COUNT = "{count}" }}
            """))
    path = tmp_path / "config.toml"
    path.write_text("\n".join(parts))
    return path


@pytest.fixture
def stagekit(tmp_path):
    def make(actions=None, extra="", name="t"):
        return stagekit_config(tmp_path, actions, extra, name)
    return make


def pytest_collection_modifyitems(config, items):
    gpu = _has_gpu()
    for item in items:
        if "gpu" in item.keywords and not gpu:
            item.add_marker(pytest.mark.skip(reason="no NVIDIA GPU/driver on this machine"))


def _has_gpu() -> bool:
    try:
        import pynvml
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True
    except Exception:
        return False


os.environ.setdefault("PYTHONUNBUFFERED", "1")


def cli(*args, cwd, timeout=120, check=None):
    """Run the real `eagle-panel` CLI in a subprocess."""
    import subprocess
    env = os.environ.copy()
    env["PYTHONPATH"] = str(ROOT)
    p = subprocess.run([sys.executable, "-m", "app.cli", *map(str, args)], cwd=cwd,
                       capture_output=True, text=True, timeout=timeout, env=env)
    if check is not None:
        assert p.returncode == check, f"exit {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    return p


def wait_for(pred, timeout=30.0, poll=0.05, what="condition"):
    import time
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
