"""Engines that are servers in another process: vLLM (vllm.py) and SGLang (sglang.py)
behind one `ServerEngine` (reloadable.py), their HTTP client, process, venv, the gate
that holds requests while weights reload, and the versioned weight folders they load."""
