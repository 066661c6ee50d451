"""Bad input: every config problem is one clear error, exit 2, nothing launched."""


import pytest

from pipeline import config as config_mod
from pipeline.config import ConfigError, parse
from pipeline.stage_graph import STAGE_NAMES
from tests.helpers import ROOT, cli


def err(text, base_dir=None):
    with pytest.raises(ConfigError) as e:
        parse(text, "my.toml", base_dir)
    return str(e.value)


def test_bundled_config_is_valid():
    cfg = config_mod.load(ROOT / "config.toml")
    assert cfg.stage_entry("train") == "pipeline.stages.train"
    assert set(cfg.runtime.env) >= set()


def test_defaults_and_derived_values():
    cfg = parse("[gpus]\ndevices = [0, 1, 2, 3]\ntrain = [2, 3]\n")
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
        "tensor_parallel = 2\n")


def test_missing_paths(tmp_path):
    msg = err('[model]\ntarget = "models/nope"\n', base_dir=tmp_path)
    assert "`model.target`" in msg and str(tmp_path / "models/nope") in msg
    assert "`data.path`" in err('[data]\npath = "/no/such.jsonl"\n')
    assert "not a built-in" in err('[model]\ntarget = "builtin:gpt5"\n')
    assert "`runtime.python`" in err('[runtime]\npython = "/no/python"\n')


def test_gpu_lists_checked_by_the_config_and_the_machine_by_doctor(monkeypatch):
    """The lists must agree with each other when the config is read; whether
    this machine has those GPUs is doctor's launch check (parsing a config
    never asks NVML: `status` or the panel on a login node reads it alike)."""
    from pipeline import doctor
    from pipeline.doctor import inputs
    assert "uses GPUs not in" in err("[gpus]\ndevices = [0]\ntrain = [1]\n")
    assert "twice" in err("[gpus]\ndevices = [0, 0]\n")
    monkeypatch.setattr(inputs, "nvml_gpus", lambda: (_ for _ in ()).throw(AssertionError(
        "NVML asked while parsing")))
    cfg = parse("[gpus]\ndevices = [0, 8]\n")
    assert cfg.gpus.devices == [0, 8]
    eight = [{"index": i, "name": "H200", "memory_total": 141 << 30} for i in range(8)]
    x = doctor.Inputs(cfg, env={}, vllm=None, gpus=eight)
    found = doctor.target.check_gpus(x)
    assert [f.level for f in found] == ["ok", "blocking"]
    assert "names GPU [8] but this machine has 8" in found[1].message
    none = doctor.target.check_gpus(doctor.Inputs(cfg, env={}, vllm=None, gpus=None))
    assert none[0].level == "blocking" and "no NVIDIA driver" in none[0].message


@pytest.mark.parametrize("text,needle", [
    ("[run\n", "not valid TOML"),
    ("[stages.prepare]\nseq_lenght = 5\n", "Did you mean `stages.prepare.seq_length`?"),
    ('[data]\npath = "missing.jsonl"\n', "does not exist"),
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
    assert config_mod.load(path).run.name == "bom"


def test_a_gate_at_the_most_a_step_can_accept_is_allowed():
    """min_acceptance counts the target's own token: k drafted + 1 is reachable."""
    cfg = config_mod.parse("[stages.evaluate]\nnum_speculative_tokens = 3\nmin_acceptance = 4.0\n")
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


def documented_keys(text: str) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """docs/config.md's keys by section: (the `names` in each table row's
    first cell under a heading that names the section, `[stages.train]`;
    the `names` in its other text)."""
    import re
    rows: dict[str, set[str]] = {}
    prose: dict[str, set[str]] = {}
    section = None
    for line in text.splitlines():
        if line.startswith("#"):
            named = re.search(r"`\[([a-z.*]+)\]`", line)
            section = named.group(1) if named else None
        elif section is not None:
            into, cell = (rows, line.split("|")[1]) if line.startswith("| ") else (prose, line)
            into.setdefault(section, set()).update(re.findall(r"`([a-z_0-9]+)`", cell))
    return rows, prose


def config_sections():
    """(the TOML section, its dataclass) for every section of config.toml."""
    import dataclasses
    import typing
    out = []
    for f in dataclasses.fields(config_mod.Config):
        tp = typing.get_type_hints(config_mod.Config).get(f.name)
        if f.name == "stages":
            out += [(f"stages.{s.name}", typing.get_type_hints(config_mod.StagesSection)[s.name])
                    for s in dataclasses.fields(config_mod.StagesSection)]
        elif dataclasses.is_dataclass(tp):
            out.append((f.name, tp))
    return out


def undocumented(docs: str) -> list[str]:
    """Every config key without its row in docs/config.md. The keys a stage
    inherits are documented once, under `[stages.*]`: the server keys
    (ServerCommon) in its table, `entry` and `env` (StageCommon) in its text."""
    import dataclasses
    rows, prose = documented_keys(docs)
    every = {f.name for f in dataclasses.fields(config_mod.StageCommon)}
    server = {f.name for f in dataclasses.fields(config_mod.ServerCommon)} - every
    missing = []
    for section, cls in config_sections():
        for f in dataclasses.fields(cls):
            staged = section.startswith("stages.")
            found = (prose.get("stages.*", set()) if staged and f.name in every else
                     rows.get("stages.*", set()) if staged and f.name in server else
                     rows.get(section, set()))
            if f.name not in found:
                missing.append(f"{section}.{f.name}")
    return missing


def test_every_key_has_its_row_in_docs_config_md():
    """Adding an option is its field (pipeline/config.py, with its rules:
    pipeline/config_fields.py) and its row in docs/config.md; this test
    holds the second half."""
    docs = (ROOT / "docs" / "config.md").read_text()
    assert undocumented(docs) == []
    # and it fails for a key whose row is missing
    assert undocumented(docs.replace("| `lr_schedule` |", "| |")) == ["stages.train.lr_schedule"]
    assert "stages.extract.server_args" in undocumented(docs.replace("| `server_args` |", "| |"))
    assert "stages.train.entry" in undocumented(docs.replace("`entry`", "entry"))


def test_a_new_option_is_one_field_with_its_rules():
    """`[stages.train] lr_schedule`, added as one field: a Literal of
    speculators' schedules, checked by the loader, passed as
    --scheduler-type (with the flags doctor's draft stand-in asks speculators
    about), and out of the fingerprint at its default (a run made before it
    stays up to date)."""
    from pipeline.train.flags import algorithm_flags
    assert "is not one of 'auto', 'linear', 'cosine', 'none'. Did you mean 'cosine'?" in err(
        '[stages.train]\nlr_schedule = "cosin"\n')
    assert "`stages.train.lr_schedule` must be a string" in err("[stages.train]\nlr_schedule = 1\n")
    plain, cosine = parse("[run]\n"), parse('[stages.train]\nlr_schedule = "cosine"\n')
    assert "lr_schedule" not in plain.section_dict("train")
    assert cosine.section_dict("train")["lr_schedule"] == "cosine"
    assert plain.fingerprint("train", {}) != cosine.fingerprint("train", {})
    assert algorithm_flags(plain.stages.train) == []
    assert algorithm_flags(cosine.stages.train) == ["--scheduler-type", "cosine"]
