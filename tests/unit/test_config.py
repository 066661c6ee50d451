"""Bad input: every config problem is one clear error, exit 2, nothing launched."""


import pytest

from pipeline import config as config_mod
from pipeline.config import ConfigError, parse
from pipeline.stage_graph import STAGE_NAMES
from tests.helpers import ROOT, cli


def err(text, gpu_count=None, base_dir=None):
    with pytest.raises(ConfigError) as e:
        parse(text, "my.toml", base_dir, gpu_count=gpu_count)
    return str(e.value)


def test_bundled_config_is_valid():
    cfg = config_mod.load(ROOT / "config.toml", gpu_count=None)
    assert cfg.stage_entry("train") == "pipeline.stages.train"
    assert set(cfg.runtime.env) >= set()


def test_defaults_and_derived_values():
    cfg = parse("[gpus]\ndevices = [0, 1, 2, 3]\ntrain = [2, 3]\n", gpu_count=lambda: 8)
    assert cfg.stage_devices("extract") == [0, 1, 2, 3]
    assert cfg.stage_devices("train") == [2, 3]
    assert cfg.stage_devices("prepare") == []
    fps = {}
    for s in STAGE_NAMES:
        fps[s] = cfg.fingerprint(s, fps)
    assert len(set(fps.values())) == len(STAGE_NAMES)


def test_unknown_key_suggests_nearest():
    msg = err("[stages.train]\nepochz = 3\n")
    assert "my.toml" in msg and "`stages.train.epochz`" in msg
    assert "Did you mean `stages.train.epochs`?" in msg
    assert "unknown key `stagez`" in err("[stagez]\n") and "`stages`" in err("[stagez]\n")


def test_wrong_types():
    assert "`stages.train.epochs` must be an integer, got str '3'" in err(
        '[stages.train]\nepochs = "3"\n')
    assert "`model.trust_remote_code` must be true or false" in err("[model]\ntrust_remote_code = 1\n")
    assert "`gpus.devices[1]` must be an integer" in err('[gpus]\ndevices = [0, "1"]\n')
    assert "`runtime.env` must be a table of strings" in err("[runtime]\nenv = { A = 1 }\n")
    assert "must be a table" in err("stages = 3\n")


def test_malformed_toml_names_the_line():
    msg = err("[run]\nname = \n")
    assert "my.toml: not valid TOML" in msg and "line 2" in msg


def test_bad_values():
    assert "is not one of" in err('[stages.extract]\nbackend = "tensorrt"\n')
    assert "must be positive" in err("[stages.train]\nttt_steps = 0\n")
    assert "`stages.train.loss_weights.ce` must be a number" in err(
        '[stages.train]\nloss_weights = { ce = "high" }\n')
    assert "train_ratio" in err("[stages.train]\ntrain_ratio = 1.5\n")
    assert "plain folder name" in err('[run]\nname = "a/b"\n')
    assert "`stages.extract.gpu_memory_utilization` must be in (0, 1]" in err(
        "[stages.extract]\ngpu_memory_utilization = 1.5\n")
    assert "`stages.extract.max_num_seqs` must be positive" in err(
        "[stages.extract]\nmax_num_seqs = 0\n")
    assert "`cluster.min_nodes` = 3 is more than `cluster.nodes` = 2" in err(
        '[cluster]\nscheduler = "slurm"\nnodes = 2\nmin_nodes = 3\n')
    assert "`cluster.collective_timeout_s` must be positive" in err(
        "[cluster]\ncollective_timeout_s = 0\n")
    assert "`stages.regenerate.chunk_size` must be positive" in err(
        "[stages.regenerate]\nchunk_size = 0\n")
    assert "`stages.regenerate.chunk_size` must be an integer" in err(
        '[stages.regenerate]\nchunk_size = "ten"\n')
    assert "each vLLM server / engine takes 2" in err(
        '[gpus]\ndevices = [0, 1, 2]\n[stages.extract]\nbackend = "vllm-engine"\n'
        "tensor_parallel = 2\n", gpu_count=lambda: 8)


def test_missing_paths(tmp_path):
    msg = err('[model]\ntarget = "models/nope"\n', base_dir=tmp_path)
    assert "`model.target`" in msg and str(tmp_path / "models/nope") in msg
    assert "`data.path`" in err('[data]\npath = "/no/such.jsonl"\n')
    assert "not a built-in" in err('[model]\ntarget = "builtin:gpt5"\n')
    assert "`runtime.python`" in err('[runtime]\npython = "/no/python"\n')


def test_gpu_indices_checked_against_the_machine():
    assert "names GPU 8, but this machine has 8 GPU(s) (0..7)" in err(
        "[gpus]\ndevices = [0, 8]\n", gpu_count=lambda: 8)
    assert "no NVIDIA driver" in err("[gpus]\ndevices = [0]\n", gpu_count=lambda: None)
    assert "uses GPUs not in" in err("[gpus]\ndevices = [0]\ntrain = [1]\n", gpu_count=lambda: 8)
    assert "twice" in err("[gpus]\ndevices = [0, 0]\n", gpu_count=lambda: 8)


@pytest.mark.parametrize("text,needle", [
    ("[run\n", "not valid TOML"),
    ("[stages.prepare]\nseq_lenght = 5\n", "Did you mean `stages.prepare.seq_length`?"),
    ('[data]\npath = "missing.jsonl"\n', "does not exist"),
    ("[gpus]\ndevices = [99]\n", "`gpus.devices`"),
    ('[tracking]\nloggers = ["tensorbord"]\n', "Did you mean 'tensorboard'?"),
    ('[tracking]\nloggers = ["mlflow", "mlflow"]\n', "names 'mlflow' twice"),
])
def test_cli_bad_config_exits_2_and_launches_nothing(tmp_path, text, needle):
    (tmp_path / "config.toml").write_text(text)
    p = cli("run", cwd=tmp_path, check=2)
    assert needle in p.stderr and "config.toml" in p.stderr
    assert not (tmp_path / "runs").exists()


def test_cli_missing_config_and_bad_run_dir(tmp_path):
    p = cli("--config", tmp_path / "nope.toml", "run", cwd=tmp_path, check=2)
    assert "config file not found" in p.stderr
    (tmp_path / "runs" / "junk").mkdir(parents=True)
    (tmp_path / "runs" / "junk" / "x").write_text("")
    p = cli("status", tmp_path / "runs" / "junk", cwd=tmp_path, check=2)
    assert "no such run directory" in p.stderr or "not an eagle-panel run" in p.stderr
    (tmp_path / "config.toml").write_text('[run]\nname = "junk"\n[stages.extract]\nlayer_ids = '
                                          '[1, 2, 3]\n[stages.vocab]\ndraft_vocab_size = 256\n')
    p = cli("run", cwd=tmp_path, check=2)
    assert "is not an eagle-panel run" in p.stderr
    assert sorted(x.name for x in (tmp_path / "runs" / "junk").iterdir()) == ["x"]


def test_bad_config_leaves_existing_run_untouched(tmp_path, stagekit):
    cfg = stagekit()
    cli("run", "--wait", cwd=tmp_path, check=0)
    frozen = (tmp_path / "runs/t/config.toml").read_text()
    state = (tmp_path / "runs/t/state.json").read_text()
    cfg.write_text(cfg.read_text().replace("[stages.train]\n", "[stages.train]\nbogus = 1\n"))
    cli("run", cwd=tmp_path, check=2)
    assert (tmp_path / "runs/t/config.toml").read_text() == frozen
    assert (tmp_path / "runs/t/state.json").read_text() == state


# The malformed-config fuzz (and four more families of hostile input) is
# tests/integration/test_fuzz.py, over tests/config_fuzz.py.


def test_a_config_with_a_byte_order_mark_is_read(tmp_path):
    """Windows editors save a BOM: it is not part of the TOML."""
    path = tmp_path / "config.toml"
    path.write_bytes(b'\xef\xbb\xbf[run]\nname = "bom"\n')
    assert config_mod.load(path, gpu_count=None).run.name == "bom"


def test_a_gate_at_the_most_a_step_can_accept_is_allowed():
    """min_acceptance counts the target's own token: k drafted + 1 is reachable."""
    cfg = config_mod.parse("[stages.evaluate]\nnum_speculative_tokens = 3\nmin_acceptance = 4.0\n",
                           gpu_count=None)
    assert cfg.stages.evaluate.min_acceptance == 4.0
    assert "can never be met" in err("[stages.evaluate]\nnum_speculative_tokens = 3\n"
                                     "min_acceptance = 4.01\n")


def test_a_named_config_is_never_replaced_by_another(tmp_path):
    """`--config ""`, a folder or a missing file: an error, never the bundled config."""
    from pipeline import control
    for bad in ("", "  ", str(tmp_path), str(tmp_path / "nope.toml")):
        with pytest.raises(config_mod.ConfigError):
            control.load_config(bad)
        with pytest.raises(config_mod.ConfigError):
            control.runs_dir(bad, None)


def test_owned_server_flags_are_recognised_in_every_spelling():
    from pipeline.config import owned_flag
    for arg in ("--host", "--host=::", "--HOST", "--api_key=x", "--api-k", "--uds", "--por"):
        assert owned_flag(arg), arg
    for arg in ("--hostname-check", "--max-num-seqs", "0.0.0.0", "-h", "--served-model-name"):
        assert owned_flag(arg) is None, arg
