"""Everything that knows vLLM, in one package; nothing here imports vLLM at
module level (doctor and the panel read it without vLLM installed).

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
    connector.py       our KV connector, loaded by vLLM: writes hs_{i}.safetensors
    extract_server.py  the vllm-server extract backend
    engine.py          the vllm-engine extract backend (vLLM 0.11-0.16 in-process)
    capture.py         hooks inside the engine's workers (vllm-engine)
"""
