"""eagle-panel's KV connector: vLLM loads it into the server
(`--kv-transfer-config` with `kv_connector_module_path`) and it writes each
request's hidden states straight into our format (pipeline.model.hsfile):
`<storage>/hs_{i}.safetensors`, tmp + rename, the token ids beside them, i
taken from the request (`kv_transfer_params.eagle_panel_index`). No
staging folder, no second move, and it works on a CPU as on a GPU.

It extends vLLM's own ExampleHiddenStatesConnector of the generation that
reads a finished request's hidden states from the KV cache
(`_submit_async_write`, vLLM 0.29+; pipeline.vllm.compat checks that every
name used here is in the installed release before the stage picks this
connector). What changes:
  - the file name comes from the sample index, not the request id;
  - a request marked `eagle_panel_skip` is not saved at all (regenerate's
    generations on the server it shares with extract);
  - the write goes to a temp name and is renamed (the stock one writes in
    place: a kill mid-write leaves a file that looks whole);
  - non-finite values are refused (logged, no file): the stage checks only
    each file's header and token ids;
  - on a CPU the copy is a plain clone: the stock path allocates pinned
    memory (refused without an accelerator) and polls a CUDA event that the
    CPU platform does not have.
The lock protocol is vLLM's: `<file>.lock` is held until the write ends.
Imported only inside vLLM's processes.
"""

from __future__ import annotations

import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector as stock

from pipeline.model.hsfile import hs_path, write_sample
from pipeline.vllm.compat import FP8_KEY, INDEX_KEY, SKIP_KEY


class _Done:
    """Stands for the copy event when the copy already happened (CPU)."""

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class HiddenStatesConnector(stock.ExampleHiddenStatesConnector):

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # FP8 files in speculators' layout ([stages.extract] hidden_states_dtype = "fp8")
        self._fp8 = bool(self._kv_transfer_config.get_from_extra_config(FP8_KEY, False))

    def build_connector_meta(self, scheduler_output):
        meta = super().build_connector_meta(scheduler_output)
        for new_req in scheduler_output.scheduled_new_reqs:
            params = new_req.sampling_params
            extra = (params.extra_args or {}) if params is not None else {}
            kv = extra.get("kv_transfer_params") or {}
            if kv.get(SKIP_KEY):
                # a generation on a shared server (regenerate's): nothing saved, and
                # no filename, so request_finished frees its blocks at once
                self._request_filenames.pop(new_req.req_id, None)
                meta.new_req_filenames.pop(new_req.req_id, None)
                continue
            index = kv.get(INDEX_KEY)
            if index is None:
                continue   # a request of someone else's: the stock name
            filename = str(hs_path(self._storage_path, int(index)))
            self._request_filenames[new_req.req_id] = filename
            meta.new_req_filenames[new_req.req_id] = filename
        return meta

    def _write_tensors(self, tensors, event, filename, lock_fd) -> None:
        try:
            event.synchronize()
            # Non-finite values are refused here, where the tensor is in memory:
            # the stage then reads only the file's header.
            write_sample(filename, tensors["hidden_states"], tensors["token_ids"],
                         check_finite=True, fp8=self._fp8)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)   # releases the client waiting on the lock

    def _submit_async_write(self, pending) -> None:
        if self._kv_cache is None or self._kv_cache.device.type != "cpu":
            return super()._submit_async_write(pending)
        if not self._is_tp_rank_zero:
            return
        size = self._block_size
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (torch.arange(size, dtype=torch.long).reshape(1, size)
                 + blocks.reshape(-1, 1) * size).flatten()
        n = pending.token_ids.shape[0]
        # A copy now: the blocks are freed once get_finished reports the request.
        hidden = stock.extract_from_kv_cache(self._kv_cache, slots, n)   # indexing copies
        tensors = {"hidden_states": hidden, "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        future = self._executor.submit(self._write_tensors, tensors, _Done(), pending.filename,
                                       lock_fd)
        self._req_copy_events[pending.req_id] = _Done()
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
