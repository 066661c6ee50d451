"""The flags of a vLLM server that captures hidden states: extract's own
servers, online training's, and the server regenerate shares with extract
(pipeline.extract.shared_server) are all started with these."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.vllm import compat
from pipeline.vllm import contract_strings as vs


def extraction_flags(layer_ids: list[int], storage: Path, own_connector: bool,
                     fp8: bool = False, linear_layers: bool = False) -> list[str]:
    """The server's extraction flags. fp8: our connector writes FP8 files
    itself; with the stock connector the stage quantizes as it takes each
    staged file (take_staged). linear_layers (a hybrid target: gated delta
    net, KDA): no prefix caching, which for them is vLLM's mamba cache mode
    'align' and requires the chunked prefill turned off here (vLLM 0.32:
    "Chunked prefill is required for mamba cache mode 'align'")."""
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}}}
    kv = {"kv_connector": compat.STOCK_CONNECTOR, "kv_role": "kv_producer",
          "kv_connector_extra_config": {"shared_storage_path": str(storage)}}
    if own_connector:
        kv.update(kv_connector=compat.OWN_CONNECTOR_CLASS,
                  kv_connector_module_path=compat.OWN_CONNECTOR_MODULE)
        kv["kv_connector_extra_config"][compat.FP8_KEY] = fp8
    return [vs.FLAG_NO_CHUNKED_PREFILL, *([vs.FLAG_NO_PREFIX_CACHING] if linear_layers else []),
            vs.FLAG_SPECULATIVE_CONFIG, json.dumps(spec), vs.FLAG_KV_TRANSFER_CONFIG,
            json.dumps(kv)]
