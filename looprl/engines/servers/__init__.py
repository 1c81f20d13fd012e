"""Engines that are servers in another process: vLLM (vllm.py) and SGLang (sglang.py),
each a `ServerEngine` (server_engine.py: the Engine protocol, weight updates, restarts;
the server's control calls are its abstract methods), their HTTP client, process, venv,
the gate that holds requests while weights reload, and the versioned weight folders
they load."""
