"""The share of each GPU a vLLM server takes when the run passes no
--gpu-memory-utilization, read from each source release's own rule
(pipeline/vllm/memory_fraction.py), and doctor's KV plan using it."""

import pytest

from pipeline import doctor
from pipeline.vllm.compat import READ_RELEASES
from pipeline.vllm.memory_fraction import ASSUMED, default_fraction
from tests.fakes import vllm_releases
from tests.unit.test_doctor import ENV_0_17, by_area, diagnose, kimi_on_8_h200

# Read by hand from each release's config/cache.py (CacheConfig.gpu_memory_utilization).
BY_HAND = {"0.11.0": 0.9, "0.12.0": 0.9, "0.13.0": 0.9, "0.14.1": 0.9, "0.16.0": 0.9,
           "0.17.0": 0.9, "0.18.0": 0.9, "0.22.0": 0.92, "0.29.0": 0.92, "0.32.0": 0.92,
           "0.33.0": 0.92}


@pytest.mark.parametrize("version", READ_RELEASES)
def test_each_releases_rule_read_from_its_source(version):
    src = vllm_releases.source(version)
    cuda, other = default_fraction(src, cuda=True), default_fraction(src, cuda=False)
    assert cuda.read and other.read
    if version == "0.34.0":   # None, resolved: 1.0 with the extensible KV cache, else 0.92
        assert (cuda.fraction, other.fraction) == (1.0, 0.92)
        assert "extensible KV cache" in cuda.why and "without" in other.why
    else:
        assert cuda.fraction == other.fraction == BY_HAND[version]
        assert cuda.why == f"vLLM {version}'s default"
    assert set(BY_HAND) | {"0.34.0"} >= set(READ_RELEASES), "a new release: read it by hand"


def test_no_source_is_said_to_be_assumed():
    rule = default_fraction(None, cuda=True)
    assert rule.fraction == ASSUMED and not rule.read and "assumed" in rule.why


@pytest.mark.parametrize("version,share", [("0.32.0", "92%"), ("0.34.0", "100%")])
def test_the_kv_plan_for_kimi_on_eight_h200_takes_the_releases_share(tmp_path, version, share):
    """The same run planned for two releases: 0.34's extensible KV cache takes
    the whole GPU (sized from memory measured free) where 0.32 takes 92%."""
    _, cfg, gpus = kimi_on_8_h200(tmp_path)
    env = dict(ENV_0_17, packages=dict(ENV_0_17["packages"], vllm=version))
    (kv,) = by_area(diagnose(cfg, env, gpus, version), "kv_cache")
    assert kv.level == doctor.OK
    assert f"{share} (vLLM {version}'s default" in kv.message, kv.message


def test_the_runs_own_flag_wins(tmp_path):
    _, cfg, gpus = kimi_on_8_h200(tmp_path)
    cfg.stages.extract.server_args = ["--gpu-memory-utilization", "0.8"]
    env = dict(ENV_0_17, packages=dict(ENV_0_17["packages"], vllm="0.34.0"))
    (kv,) = by_area(diagnose(cfg, env, gpus, "0.34.0"), "kv_cache")
    assert "80% (--gpu-memory-utilization in server_args)" in kv.message, kv.message
