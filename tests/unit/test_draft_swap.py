"""Evaluate's one server for every checkpoint (pipeline/vllm/draft_swap.py,
swap_worker.py, route_guard.py), the parts that need no server: which vLLM
releases can swap (their real source), what a swap refuses, the shared
tensors it leaves alone, the key on the development routes. The swap
through the real vLLM, and that a swapped draft measures what a fresh
server does, are in tests/vllm/test_vllm_pipeline.py."""

import json

import pytest
import torch
from safetensors.torch import save_file

from pipeline.evaluate.servers import fresh_command
from pipeline.vllm import contract, draft_swap, route_guard, swap_worker
from pipeline.vllm import contract_strings as vs
from pipeline.vllm.compat import READ_RELEASES
from tests.fakes import vllm_releases


def checkpoint(folder, tensors: dict, config: dict | None = None):
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config or {"architectures": ["Eagle3"]}))
    return folder


def test_releases_that_can_swap_read_from_their_source():
    """0.29+ have get_draft_model on the model runner; the in-place reload and
    the /collective_rpc route of the releases that have them; each older one
    a line naming what it lacks (evaluate restarts the server there)."""
    why = {v: draft_swap.unavailable(vllm_releases.source(v), []) for v in READ_RELEASES}
    print("\n" + "\n".join(f"{v}: {w or 'swaps'}" for v, w in why.items()))
    assert why["0.32.0"] is None and why["0.33.0"] is None
    assert why["0.22.0"] and why["0.22.0"].startswith("vLLM 0.22.0: ")
    assert all(why[v] for v in ("0.11.0", "0.16.0"))
    # 0.34: V1 is gone; said so, not as a missing symbol of V1's
    assert why["0.34.0"].startswith("vLLM 0.34.0 removed Model Runner V1")
    assert "not in" not in why["0.34.0"] and "device_config.device" in why["0.34.0"]
    # a user's own worker extension: ours cannot be mixed in beside it
    got = draft_swap.unavailable(vllm_releases.source("0.32.0"),
                                 [vs.FLAG_WORKER_EXTENSION_CLS + "=my.Ext"])
    assert "of their own" in got


def test_the_swap_uses_are_declared_for_both_model_runners():
    names = [(u.name, u.modules) for u in contract.USES if "swap" in u.routes]
    assert ("GPUModelRunner.get_draft_model", ("v1.worker.gpu_model_runner",)) in names
    assert ("GPUModelRunner.get_draft_model", ("v1.worker.gpu.model_runner",)) in names
    assert any(n == "reload_weights" for n, _ in names)


def test_a_checkpoint_another_server_would_build_is_refused(tmp_path):
    t = {"fc.weight": torch.zeros(4, 8), "d2t": torch.zeros(4, dtype=torch.int64)}
    a = checkpoint(tmp_path / "0", t)
    assert draft_swap.incompatible(a, checkpoint(tmp_path / "1", {**t})) is None
    shape = checkpoint(tmp_path / "2", {**t, "fc.weight": torch.zeros(4, 9)})
    assert draft_swap.incompatible(a, shape) == "fc.weight is F32 [4, 9], the served one F32 [4, 8]"
    dtype = checkpoint(tmp_path / "3", {**t, "fc.weight": torch.zeros(4, 8, dtype=torch.bfloat16)})
    assert "fc.weight is BF16" in draft_swap.incompatible(a, dtype)
    named = checkpoint(tmp_path / "4", {**t, "extra.weight": torch.zeros(1)})
    assert draft_swap.incompatible(a, named) == "its tensors differ by name (extra.weight)"
    config = checkpoint(tmp_path / "5", t, {"architectures": ["Eagle3"], "draft_vocab_size": 9})
    assert "config.json differs from the served one's in draft_vocab_size" in \
        draft_swap.incompatible(a, config)
    assert "cannot read" in draft_swap.incompatible(a, tmp_path / "missing")


def test_tensors_shared_with_the_target_are_left_alone_or_refuse():
    """vLLM hands a draft the target's embed_tokens when the draft's equals it:
    the same copy in the new checkpoint is skipped (a fresh server shares it
    too); a different copy refuses the swap (a fresh server would not)."""
    target = torch.nn.Module()
    target.embed_tokens = torch.nn.Embedding(8, 4)
    drafter = torch.nn.Module()
    drafter.model = torch.nn.Module()
    drafter.model.embed_tokens = target.embed_tokens     # what vLLM does
    drafter.fc = torch.nn.Linear(4, 4)
    shared = swap_worker.shared_names(drafter, target)
    assert shared == {"model.embed_tokens.weight"}
    embed = torch.randn(8, 4)
    started = {"embed_tokens.weight": embed, "fc.weight": torch.zeros(4, 4)}
    new = {"embed_tokens.weight": embed.clone(), "fc.weight": torch.ones(4, 4)}
    own, kept = swap_worker.split(new, started, shared)
    assert [n for n, _ in own] == ["fc.weight"] and kept == ["embed_tokens.weight"]
    with pytest.raises(ValueError, match="embed_tokens.weight differs"):
        swap_worker.split({**new, "embed_tokens.weight": embed + 1}, started, shared)


@pytest.mark.parametrize("method,path,auth,key,ok", [
    ("GET", "/health", "", "k", True),                 # read-only, left open
    ("GET", "/metrics", "", "k", True),
    ("POST", "/v1/completions", "", "k", True),        # vLLM checks the key itself
    ("POST", "/collective_rpc", "", "k", False),       # vLLM leaves it open: we do not
    ("POST", "/collective_rpc", "Bearer wrong", "k", False),
    ("POST", "/collective_rpc", "Bearer k", "k", True),
    ("POST", "/reset_prefix_cache", "Bearer k", "k", True),
    ("POST", "/sleep", "", "k", False),
    ("POST", "/collective_rpc", "Bearer ", "", False),  # no key set: closed, not open
    ("GET", "/health/../collective_rpc", "", "k", False),
])
def test_the_development_routes_want_the_runs_key(method, path, auth, key, ok):
    assert route_guard.allowed(method, path, auth, key) is ok


def test_the_recorded_command_serves_the_swapped_draft_from_the_start():
    spec = json.dumps({"method": "eagle3", "model": "/r/checkpoints/0",
                       "num_speculative_tokens": 3})
    argv = ["python", "-m", "pipeline.vllm.launch", "serve", "/t", *draft_swap.SERVER_FLAGS,
            vs.FLAG_SPECULATIVE_CONFIG, spec]
    got = fresh_command(argv, "/r/checkpoints/2")
    assert got[:5] == argv[:5] and draft_swap.EXTENSION not in got and draft_swap.GUARD not in got
    assert json.loads(got[-1]) == {"method": "eagle3", "model": "/r/checkpoints/2",
                                   "num_speculative_tokens": 3}


def test_doctor_counts_the_target_loads_and_says_why_a_swap_cannot_be(tmp_path):
    from pipeline import doctor
    from pipeline.config import load
    from tests.configs import write
    write(tmp_path / "config.toml", {"stages": {"regenerate": {"enabled": True},
                                                "train": {"epochs": 4},
                                                "evaluate": {"checkpoints": "all"}}})
    cfg = load(tmp_path / "config.toml")

    def lines(version):
        x = doctor.Inputs(cfg, env={}, vllm=None, gpus=None,
                          source=vllm_releases.source(version), backend="vllm-server")
        return [(f.level, f.message) for f in doctor.check_target_loads(x)]
    new = lines("0.32.0")
    assert new[0][1].startswith("4 target loads: regenerate 1")
    assert "evaluate (4 checkpoints, the next ones swapped in) 1" in new[0][1] and len(new) == 1
    old = lines("0.22.0")
    assert old[0][1].startswith("7 target loads") and "evaluate (4 checkpoints) 4" in old[0][1]
    assert old[1] == (doctor.WARN, "evaluate: a server per checkpoint (vLLM 0.22.0: "
                      "reload_weights not in vllm.model_executor.model_loader.reload.inplace)")
