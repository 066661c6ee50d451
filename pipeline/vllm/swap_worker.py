"""Inside each vLLM worker: a new checkpoint's draft weights loaded into the
running drafter, so evaluate measures every checkpoint on one server (one
target load instead of one per checkpoint). Mixed into vLLM's workers by
`--worker-extension-cls pipeline.vllm.swap_worker.DraftSwap`; called by
evaluate through the server's /collective_rpc (pipeline/vllm/draft_swap.py,
which also checks, before calling, that the new checkpoint has the names,
shapes, dtypes and config of the one the server started with).

Why it loads the way it does:
- through vLLM's own in-place reload (`reload_weights`, the path RL
  frameworks update weights by), on the drafter model: on the CPU build a
  linear layer's weights are repacked for oneDNN after loading, so copying
  tensors into the parameters would change nothing the kernels read. The
  reload gives each layer its checkpoint layout back, loads through the
  drafter's own `load_weights` (its names: packed projections, d2t ->
  draft_id_to_target_id, t2d dropped) and processes the layer again into
  the same storage (CUDA graphs keep pointing at it).
- never into a tensor the drafter shares with the target: vLLM gives a
  draft the target's embed_tokens / lm_head when the draft's own are
  missing or equal to the target's (v1/spec_decode/llm_base_proposer.py),
  so writing the draft's copy would write into the target. A checkpoint's
  copy of a shared tensor is compared with the copy in the checkpoint the
  server started with: equal, a fresh server would share it too, and it is
  left alone; different, a fresh server would keep a copy of its own, which
  a swap cannot give: refused, and evaluate restarts the server instead.

vLLM and torch are imported inside the method: the project's tests import
this module without them.
"""

from __future__ import annotations

METHOD = "eagle_panel_swap_draft"   # what evaluate names in /collective_rpc


def read_weights(folder: str, only=None) -> dict:
    """The tensors of a checkpoint folder's *.safetensors, on the CPU: every
    one, or those whose names `only(name)` accepts."""
    from pathlib import Path

    from safetensors import safe_open
    out: dict = {}
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors in {folder}")
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as st:
            out.update({k: st.get_tensor(k) for k in st.keys() if only is None or only(k)})
    return out


def shared_names(drafter, target) -> set[str]:
    """The drafter's parameter names whose tensors are the target's own."""
    theirs = {id(p) for p in target.parameters()}
    return {n for n, p in drafter.named_parameters(remove_duplicate=False) if id(p) in theirs}


def is_shared(name: str, shared: set[str]) -> bool:
    """A checkpoint name that lands on a shared tensor: as it is, or under
    the drafter's `model.` (speculators' names lack it; load_weights adds it)."""
    return name in shared or f"model.{name}" in shared


def split(new: dict, started: dict, shared: set[str]) -> tuple[list, list[str]]:
    """(the tensors to load, the shared names left alone); a shared tensor
    that differs from the started checkpoint's copy refuses the swap."""
    import torch
    own, kept = [], []
    for name, t in new.items():
        if not is_shared(name, shared):
            own.append((name, t))
            continue
        old = started.get(name)
        if old is None or old.shape != t.shape or not torch.equal(old, t):
            raise ValueError(f"{name} differs from the copy in the checkpoint the server "
                             "started with, which vLLM shares with the target: a fresh "
                             "server would keep this one separate")
        kept.append(name)
    return own, kept


class DraftSwap:
    """The worker extension (vLLM mixes it into its Worker class)."""

    def eagle_panel_swap_draft(self, folder: str) -> dict:
        """Load `folder`'s weights into this worker's drafter. Returns what
        was done, or {"error": why} (nothing loaded): the HTTP route
        answers either way, and evaluate falls back to a restart."""
        import time
        from types import SimpleNamespace

        from vllm.model_executor.model_loader.reload.inplace import reload_weights
        t0 = time.perf_counter()
        try:
            runner = self.model_runner
            drafter = runner.get_draft_model()
            if drafter is None:
                return {"error": "this server has no draft model"}
            spec = self.vllm_config.speculative_config
            shared = shared_names(drafter, runner.get_model())
            # of the checkpoint the server started with, only what is shared is compared
            started = read_weights(spec.model, lambda n: is_shared(n, shared))
            own, kept = split(read_weights(folder), started, shared)
        except (ValueError, OSError, AttributeError) as e:
            return {"error": str(e)}
        # the draft's own model config (its dtype for the attention layers'
        # processing), the server's load config (not read: weights are given)
        # (device_config: 0.34's reload places the weights on load_config.device, which
        # defaults to None there, or else on device_config.device)
        config = SimpleNamespace(model_config=spec.draft_model_config,
                                 load_config=self.vllm_config.load_config,
                                 device_config=self.vllm_config.device_config,
                                 lora_config=None)
        reload_weights(config, drafter, weights_iterator=iter(own), weights_path=None,
                       is_checkpoint_format=True)
        took = time.perf_counter() - t0
        print(f"eagle-panel: draft weights of {folder} loaded into the running drafter "
              f"({len(own)} tensors; the target's {', '.join(sorted(kept)) or 'none'} "
              f"left shared) in {took:.2f} s", flush=True)
        return {"loaded": len(own), "shared": sorted(kept), "seconds": round(took, 3)}
