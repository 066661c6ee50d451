"""vLLM asked, not only read (pipeline/vllm/validate.py, validation.py,
pipeline/doctor/validation.py): the servers a config plans, as the stages
build theirs; vLLM's words made readable; the cache key; the launch check
reading doctor's answer; and, through the real vLLM of this machine, a
server vLLM refuses blocked by doctor and by the launch, in vLLM's words,
beside the servers it accepts.

The vllm tier's part of tests/unit/test_vllm_validation.py."""

import json
import shutil
from pathlib import Path

import pytest

from pipeline import doctor
from pipeline.model.info import read_model
from tests.configs import merged, tiny_pipeline, write
from tests.helpers import cli
from tests.unit.test_vllm_validation import BATCHED_64, load


def test_doctor_and_the_launch_block_what_vllm_refuses(tmp_path):
    """Through the real vLLM: extract's server with fewer batched tokens than
    its longest request (extraction turns chunked prefill off) and
    regenerate's with a flag vLLM does not have are refused in vLLM's words;
    evaluate's is accepted in the same process. `run` is then refused from
    doctor's cached answer, starting nothing; doctor asks again while vLLM
    refuses, and once the config is fixed, its answer is cached."""
    from pipeline.paths import VLLM_VENV
    from pipeline.vllm.environment import probe
    py = VLLM_VENV / "bin" / "python"
    if not py.exists() or probe(str(py)).unusable([]):
        pytest.skip(f"no usable real vLLM in {VLLM_VENV} (scripts/install.sh makes it)")
    # a target of its own (config.json names this test): vLLM is asked, not a cache
    built = load(tmp_path, {}).target_path()
    target = shutil.copytree(built, tmp_path / "target")
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "_test": str(tmp_path)}))
    write(tmp_path / "config.toml", merged(tiny_pipeline(), {
        "model": {"target": str(target)},
        "stages": {"regenerate": {"enabled": True, "server_args": ["--no-such-flag"]},
                   "extract": {"backend": "vllm-server", "server_args": BATCHED_64}}}))
    p = cli("doctor", cwd=tmp_path, timeout=600)
    assert p.returncode == 1, p.stdout + p.stderr
    refused = [ln for ln in p.stdout.splitlines() if "refuses" in ln]
    assert len(refused) == 2, p.stdout
    assert "regenerate's server" in refused[0] and "unrecognized arguments: --no-such-flag" \
        in refused[0], refused
    assert "extract's server: SchedulerConfig: max_num_batched_tokens (64) is smaller than " \
           "max_model_len (200)" in refused[1], refused
    assert "accepts evaluate (the target alone)" in p.stdout and "(cached)" not in p.stdout
    assert "the model built from it on the meta device" in p.stdout
    # evaluate's server with the draft train will make: speculators builds a config-only
    # stand-in from the stage's flags, and vLLM is asked about the server that serves it
    assert "speculators 0.9.0 takes the train stage's flags and builds the EAGLE-3 draft's " \
           "config" in p.stdout, p.stdout
    assert "accepts evaluate (with the EAGLE-3 draft)" in p.stdout, p.stdout
    launch = cli("run", cwd=tmp_path, timeout=120)
    assert launch.returncode == 2 and "max_num_batched_tokens (64)" in launch.stdout + \
        launch.stderr, launch.stdout + launch.stderr
    assert not (tmp_path / "runs" / "p" / "state.json").exists()   # nothing was started
    # a refusal is asked again (the fix may be in); the fixed config is accepted, and
    # that answer is cached
    again = cli("doctor", cwd=tmp_path, timeout=600)
    # (only the draft's stand-in and its server, which vLLM accepted, come from the cache)
    assert again.stdout.count("(cached)") == 2 and again.stdout.count("refuses") == 2, \
        again.stdout
    write(tmp_path / "config.toml", merged(tiny_pipeline(), {
        "model": {"target": str(target)},
        "stages": {"regenerate": {"enabled": True}, "extract": {"backend": "vllm-server"}}}))
    fixed = cli("doctor", cwd=tmp_path, timeout=600)
    assert fixed.returncode == 0 and "refuses" not in fixed.stdout, fixed.stdout
    cached = cli("doctor", cwd=tmp_path, timeout=120)
    assert "accepts regenerate, extract, evaluate (the target alone)" in cached.stdout and \
        "(cached)" in cached.stdout, cached.stdout
    assert cached.stdout.count("(cached)") == 3, cached.stdout   # + the stand-in, its server


def int4_kimi(tmp_path: Path) -> Path:
    """tiny-kimi's config and tokenizer (no weights: vLLM is asked about the
    config alone) with its routed experts in Kimi-K2.5's released format:
    compressed-tensors INT4, group 32, symmetric; attention, the shared
    experts, the dense MLP and lm_head left unquantized (issue 51)."""
    from pipeline import builtin
    built = builtin.target("builtin:tiny-kimi").ensure_built()
    folder = tmp_path / "kimi-int4"
    shutil.copytree(built, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    scheme = {"targets": ["Linear"], "format": "pack-quantized", "input_activations": None,
              "output_activations": None,
              "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                          "group_size": 32, "dynamic": False, "actorder": None,
                          "observer": "minmax"}}
    quant = {"quant_method": "compressed-tensors", "format": "pack-quantized",
             "quantization_status": "compressed", "config_groups": {"group_0": scheme},
             "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                        r"re:.*mlp\.(gate|up|gate_up|down)_proj.*", "re:.*lm_head.*",
                        "re:vision_tower.*", "re:mm_projector.*"],
             "kv_cache_scheme": None, "_test": str(tmp_path)}
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = config["text_config"]["quantization_config"] = quant
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_target_whose_kernels_vllm_lacks_is_blocked_before_the_run(tmp_path):
    """Kimi-K2.5's INT4 experts on vLLM's CPU build (issue 51: doctor said
    ready, extract failed 38 s in): vLLM builds the model on the meta device
    with its own loader, the MoE picks its INT4 backend as it is made, and
    finds none; doctor blocks every server with vLLM's words, and the launch
    is refused from that answer, nothing created."""
    from pipeline.paths import VLLM_VENV
    from pipeline.vllm.environment import probe
    py = VLLM_VENV / "bin" / "python"
    if not py.exists() or probe(str(py)).unusable([]):
        pytest.skip(f"no usable real vLLM in {VLLM_VENV} (scripts/install.sh makes it)")
    write(tmp_path / "config.toml", merged(tiny_pipeline(), {
        "model": {"target": str(int4_kimi(tmp_path)), "trust_remote_code": True},
        "stages": {"extract": {"backend": "vllm-server"}}}))
    p = cli("doctor", cwd=tmp_path, timeout=600)
    assert p.returncode == 1, p.stdout + p.stderr
    wna16 = "No WNA16 MoE backend supports the deployment configuration"
    blocked = [ln for ln in p.stdout.splitlines() if ln.startswith("[ BLOCK ]")]
    assert len(blocked) == 1 and "extract's model" in blocked[0] and wna16 in blocked[0], \
        p.stdout
    # the fix names what runs without vLLM's kernels here; evaluate, which cannot either,
    # is planned as skipped (the run ends at train's estimate), not a block
    assert '[stages.extract] backend = "hf"' in p.stdout
    (skip,) = [ln for ln in p.stdout.splitlines() if "evaluate will be skipped" in ln]
    assert skip.startswith("[ WARN  ]") and wna16 in skip and "train's estimate" in skip
    launch = cli("run", cwd=tmp_path, timeout=120)
    assert launch.returncode == 2 and "No WNA16 MoE backend" in launch.stdout + launch.stderr
    assert not (tmp_path / "runs").exists()


def test_auto_runs_around_a_target_vllm_cannot_build(tmp_path):
    """The same INT4 Kimi with backend = "auto" (issue 51: routes that can run
    win): vLLM's own answer, not a version table, sends extract to hf and
    plans evaluate as skipped; doctor says both and blocks nothing; the
    recorded answer is what the next doctor's backend line, the launch checks
    and the stages decide by."""
    from pipeline import config as config_mod
    from pipeline.paths import VLLM_VENV
    from pipeline.vllm import validation
    from pipeline.vllm.environment import choose_backend, probe
    py = VLLM_VENV / "bin" / "python"
    env = probe(str(py)) if py.exists() else None
    if env is None or env.unusable([]):
        pytest.skip(f"no usable real vLLM in {VLLM_VENV} (scripts/install.sh makes it)")
    target = int4_kimi(tmp_path)
    write(tmp_path / "config.toml", merged(tiny_pipeline(), {
        "model": {"target": str(target), "trust_remote_code": True}}))
    p = cli("doctor", cwd=tmp_path, timeout=600)
    assert p.returncode == 0 and "[ BLOCK ]" not in p.stdout, p.stdout + p.stderr
    assert 'backend = "auto" -> hf: vLLM 0.32.0+cpu cannot build the target here (' \
           "NotImplementedError: No WNA16 MoE backend" in p.stdout, p.stdout
    assert "evaluate will be skipped" in p.stdout
    refused = validation.model_refused(env.python, target, env.vllm_dir)
    assert refused and "No WNA16 MoE backend" in refused
    # the next doctor picks hf up front, from the recorded answer
    again = cli("doctor", cwd=tmp_path, timeout=600)
    assert again.returncode == 0 and 'backend = "auto" -> hf: vLLM 0.32.0+cpu cannot build ' \
        "the target here (NotImplementedError: No WNA16" in again.stdout, again.stdout
    # so do the launch checks (nothing blocks) and the extract stage's own choice
    cfg = config_mod.load(tmp_path / "config.toml")
    assert not doctor.blocking(doctor.launch_findings(cfg))
    assert choose_backend("auto", env, [], read_model(target), "float32", refused)[0] == "hf"
    # a target vLLM builds again (fixed kernels, another config) clears the record
    validation.record_model(env.python, target, None, env.vllm_dir)
    assert validation.model_refused(env.python, target, env.vllm_dir) is None
