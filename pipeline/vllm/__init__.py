"""Everything that knows vLLM, in one package; nothing here imports vLLM at
module level (doctor and the panel read it without vLLM installed).

    contract.py        every vLLM module, symbol, signature and field used, declared
                       once: the engine route's imports and doctor's checks
    contract_strings.py  every `vllm serve` flag, route, metric and log line, declared once
    compat.py          the API drift between releases and the adaptations, decided
                       from what is installed (signatures, fields, module paths)
    source.py          vLLM's source read with ast (doctor, tests), never imported
    kv.py              KV-cache figures: server log lines, /metrics, an engine's
                       KVCacheConfig -> `kv_cache` / `kv_usage` events
    metrics.py         a server's /metrics read; speculative-decoding counters ->
                       acceptance length
    environment.py     which interpreter runs vLLM, which build it is, how to start it
    server.py          one `vllm serve` process: start, health, API key, metrics,
                       error quoting, process-tree stop
    launch.py          the server command, run in vLLM's interpreter
    startup.py         a server's start, phase by phase, from its log
    target_flags.py    the flags a target needs (multimodal wrapper, MLA on a CPU build)
    acceptance.py      acceptance per request, category and position
    connector.py       our KV connector, loaded by vLLM: writes hs_{i}.safetensors
(the extract backends that drive vLLM are pipeline/extract/vllm_*.py)
"""
