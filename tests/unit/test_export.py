"""`eagle-panel export` on a finished run of test stages with evaluate's
records written as the real stage writes them (the real vLLM path: the
pipeline test serves an export and measures it again): what is shipped and
what is not, the model card's figures for the checkpoint asked for, the
command it gives, and every refusal an exit 2 that names the file and
leaves no half folder."""

import json

import pytest

from pipeline import export as export_mod
from pipeline.run.events import EventWriter
from pipeline.run.rundir import RunDir
from tests.helpers import cli

MEASURED = {"drafts": 40, "draft_tokens": 120, "accepted_tokens": 70, "prompts": 8,
            "per_position": [0.8, 0.6, 0.35], "per_category": {}}


@pytest.fixture
def run(tmp_path, stagekit):
    """Run `t`, its evaluate having measured checkpoints 0 (2.5) and 1 (2.75,
    the chosen one) against a baseline at 40 tokens/s."""
    stagekit()
    cli("run", "--wait", cwd=tmp_path, check=0)
    rd = RunDir(tmp_path / "runs" / "t")
    vocab = rd.out_dir("vocab")
    for kind in ("d2t", "t2d"):
        (vocab / f"{kind}-64.npy").write_bytes(b"npy")
    (vocab / "d2t-32.npy").write_bytes(b"stale")   # another size's: not this draft's
    results = {"checkpoints": {}, "baseline": {"decode_tokens_per_s": 40.0}, "speedup": 1.25,
               "num_speculative_tokens": 3, "temperature": 0.0, "concurrency": 1,
               "max_tokens": 48, "seed": 0, "prompts": "validation split"}
    for name, acc, tps in (("0", 2.5, 30.0), ("1", 2.75, 50.0)):
        ckpt = rd.out_dir("train") / "checkpoints" / name
        ckpt.mkdir(parents=True)
        for f in ("model.safetensors", "config.json", "optimizer_state_dict.pt",
                  "training_state.json"):
            (ckpt / f).write_text("{}")
        spec = json.dumps({"method": "eagle3", "model": str(ckpt), "num_speculative_tokens": 3})
        command = (f"/venv/bin/python -m pipeline.vllm.launch serve /cache/snapshots/abc "
                   f"--host 127.0.0.1 --port 4242 --dtype float32 --speculative-config '{spec}'")
        results["checkpoints"][name] = {**MEASURED, "acceptance_length": acc,
                                        "decode_tokens_per_s": tps, "served": str(ckpt),
                                        "vllm_command": command, "estimate": acc - 0.1,
                                        "checkpoint": {"name": name, "global_step": 10 + int(name)}}
    out = rd.out_dir("evaluate")
    (out / "results.json").write_text(json.dumps(results))
    (out / "prompts.jsonl").write_text('{"question_id": "0", "prompt": [1, 2]}\n')
    with EventWriter(rd.events_path("vocab")) as ev:
        ev.emit("stage_finished", status="succeeded", duration_s=1.0, summary={
            "draft_vocab_size": 64, "d2t": str(vocab / "d2t-64.npy"),
            "t2d": str(vocab / "t2d-64.npy")})
    with EventWriter(rd.events_path("evaluate")) as ev:
        ev.emit("stage_finished", status="succeeded", duration_s=1.0,
                summary={"checkpoint": "1", "acceptance_length": 2.75})
    return tmp_path, rd


def test_the_chosen_draft_ships_with_its_card(run):
    tmp, rd = run
    p = cli("export", cwd=tmp, check=0)
    out = rd.path / "export" / "1"
    assert f"exported to {out}" in p.stdout
    assert sorted(f.name for f in out.iterdir()) == [
        "README.md", "config.json", "d2t-64.npy", "measured.json", "model.safetensors",
        "prompts.jsonl", "t2d-64.npy"]
    card = (out / "README.md").read_text()
    assert "acceptance length **2.750** at `num_speculative_tokens` 3, over 8 prompts" in card
    # the card's figures, as `watch --draft` reads them
    from pipeline.watch import measured
    m, r = measured.from_export(out), measured.from_run(rd)
    assert (m.acceptance_length, m.num_speculative_tokens) == (2.75, 3), m
    assert (r.acceptance_length, r.per_position, r.num_speculative_tokens) == \
        (m.acceptance_length, m.per_position, m.num_speculative_tokens), (r, m)
    assert r.source == "run t, checkpoint 1" and m.source == f"export {out}"
    assert "(speedup 1.25x)" in card and "seed 0" in card
    serve = card.split("## Serve it")[1].split("```")[1].strip()
    assert serve.startswith("vllm serve /cache/snapshots/abc --dtype float32 ")
    assert "--port" not in serve and f'"model": "{out}"' in serve
    assert f"hf upload <user>/<repo> {out}" in card
    assert "CPU build" not in card   # no vLLM recorded as a CPU build's


def test_another_checkpoint_has_its_own_speedup_and_a_relative_folder_is_made_absolute(run):
    tmp, rd = run
    cli("export", "--checkpoint", "0", "--to", "ship/zero", cwd=tmp, check=0)
    out = tmp / "ship" / "zero"
    card = (out / "README.md").read_text()
    assert "acceptance length **2.500**" in card
    assert "30.0 tokens/s with the draft, 40.0 without (speedup 0.75x)" in card   # not 1.25x
    assert "this checkpoint is epoch 1 (step 10)" in card and f'"model": "{out}"' in card


def test_a_hub_target_is_served_by_its_id_at_the_commit_measured():
    command = ("/v/python -m pipeline.vllm.launch serve /hf/models--o--m/snapshots/c0ffee "
               "--port 1 --speculative-config '{\"model\": \"/run/ckpt\"}'")
    pin = {"repo_id": "o/m", "commit": "c0ffee"}
    assert export_mod.served_command(command, "/x", pin) == \
        "vllm serve o/m --revision c0ffee --speculative-config '{\"model\": \"/x\"}'"


@pytest.mark.parametrize("damage, says", [
    ("results", "results.json cannot be read"),
    ("unfinished", "evaluate did not finish, so it named no draft (measured: 0, 1)"),
    ("unmeasured", "checkpoint '7' was not measured by evaluate (measured: 0, 1)"),
    ("gone", "the served draft"),
])
def test_each_refusal_is_exit_2_naming_what_to_do(run, damage, says):
    tmp, rd = run
    out = rd.out_dir("evaluate")
    args = ["export"]
    if damage == "results":
        (out / "results.json").write_text('{"checkpoints": ')
    elif damage == "unfinished":   # evaluate's last attempt failed: no summary
        with EventWriter(rd.events_path("evaluate")) as ev:
            ev.emit("stage_finished", status="failed", duration_s=1.0, summary={})
    elif damage == "unmeasured":
        args += ["--checkpoint", "7"]
    else:
        import shutil
        shutil.rmtree(rd.out_dir("train") / "checkpoints" / "1")
    p = cli(*args, cwd=tmp, check=2)
    assert says in p.stderr and "Traceback" not in p.stderr
    assert not (rd.path / "export").exists() or not any((rd.path / "export").iterdir())


def test_a_write_cut_short_leaves_no_half_folder(run, monkeypatch):
    tmp, rd = run

    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(export_mod, "model_card", full_disk)
    with pytest.raises(export_mod.ExportError, match="No space left on device; nothing was left"):
        export_mod.export(rd)
    assert list((rd.path / "export").iterdir()) == []
    monkeypatch.undo()
    assert export_mod.export(rd) == rd.path / "export" / "1"   # and it can be done again


def test_a_draft_measured_on_the_cpu_build_says_what_that_build_needs(run, monkeypatch):
    tmp, rd = run
    monkeypatch.setattr(export_mod, "versions", lambda prov: {
        "vllm (evaluate's servers)": "0.32.0+cpu"})
    card = (export_mod.export(rd) / "README.md").read_text()
    assert "Measured on vLLM's CPU build: give it a KV-cache size, e.g. " \
        "`VLLM_CPU_KVCACHE_SPACE=4` (GiB)" in card
    assert '"vllm (evaluate\'s servers)": "0.32.0+cpu"' in card


def test_the_card_says_the_measured_servers_kv_cache_beside_its_plan(run, monkeypatch):
    """The kv_cache report of the server that served the draft, and its plan
    (pipeline.run.plans): the card gives vLLM's count beside the plan, and
    on the CPU build the space that server was given, not a guess — not the
    baseline's server, reported last."""
    from pipeline.vllm.kv_plan import cpu_plan
    tmp, rd = run
    plan = cpu_plan(8, 392, 1 << 16)   # 8 x 392 tokens x 64 KiB x 1.5, in whole GiB: 1
    with EventWriter(rd.events_path("evaluate")) as ev:
        for k, label, cap in ((0, "vLLM server (checkpoint 1)", 16_384),
                              (1, "vLLM server (no draft)", 99_999)):
            ev.emit("kv_cache", num_blocks=128, block_size=128, bytes_per_block=1 << 23,
                    total_bytes=1 << 30, tokens_capacity=cap, max_concurrency=41.8,
                    max_model_len=392, groups=[], source="log+metrics", server=k, devices=[],
                    label=label, planned=cpu_plan(8, 392, 1 << 14).to_json() if k else
                    plan.to_json())
    monkeypatch.setattr(export_mod, "versions", lambda prov: {
        "vllm (evaluate's servers)": "0.32.0+cpu"})
    card = (export_mod.export(rd) / "README.md").read_text()
    assert "The measured server's KV cache: 16,384 tokens as vLLM counted them " \
        f"({plan.space_gib} GiB on the CPU build, planned ~{plan.tokens:,})." in card
    assert f"`VLLM_CPU_KVCACHE_SPACE={plan.space_gib}` (GiB)" in card
