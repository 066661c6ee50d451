"""The extract job and its backends behind one interface: the job (job),
transformers (hf, parallel), vLLM's server (vllm_server) and engine
(vllm_engine, vllm_capture), the backend table (backends) and the node
workers (nodes). Imports pipeline.vllm; pipeline.vllm never imports it."""
