"""Provenance (pipeline/run/provenance.py): each stage attempt records the
versions, its command, its vLLM servers' commands and the adaptations that
fired; `status --json` shows them; doctor warns when the installed versions
changed since a run's stages ran.

The parts in other tiers: tests/integration/test_provenance.py."""



from pipeline.run import provenance


def test_changed_versions_compare_servers_on_the_vllm_that_serves():
    recorded = {
        "train": {"python": "3.11.7", "packages": {"torch": "2.13.0", "vllm": None},
                  "servers": []},
        "evaluate": {"python": "3.11.7", "packages": {"torch": "2.13.0", "vllm": None},
                     "servers": [{"vllm": "0.32.0+cpu"}]},
    }
    now = {"torch": "2.13.0", "vllm": None, "transformers": None}
    assert provenance.changed_versions(recorded, now, "3.11.7", "0.32.0+cpu") == []
    assert provenance.changed_versions(recorded, now, "3.11.7", "0.33.0") == [
        "vllm 0.32.0+cpu -> 0.33.0"]
    assert provenance.changed_versions(recorded, dict(now, torch="2.14.1"), "3.12.1",
                                       "0.32.0+cpu") == ["torch 2.13.0 -> 2.14.1",
                                                         "python 3.11.7 -> 3.12.1"]


