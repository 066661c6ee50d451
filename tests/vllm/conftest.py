"""What every test of the vllm tier may ask for: `vllm_env`, this machine's real
vLLM (.venv-vllm) probed once per module, or the test skipped with the reason."""

import pytest

from pipeline.paths import VLLM_VENV


@pytest.fixture(scope="module")
def vllm_env():
    from pipeline.vllm.environment import probe
    py = VLLM_VENV / "bin" / "python"
    if not py.exists():
        pytest.skip(f"no real vLLM: {VLLM_VENV} is missing (scripts/install.sh makes it)")
    env = probe(str(py))
    why = env.unusable([])
    if why:
        pytest.skip(f"the installed vLLM cannot run here: {why}")
    return env
