"""Model runners: how the local engine runs forwards and keeps the KV cache of its rows.

The engine (scheduling, sampling, bookkeeping) sees one interface. Rows are the
running sequences in the engine's order; new rows are appended at the end.

- `fits(reserved)`: whether rows needing these prompt+max_new_tokens sizes stay
  within the KV budget.
- `prefill(sequences)`: append rows for these token sequences; returns their (n, V)
  float32 next-token logits.
- `decode(tokens)`: feed each row one token; returns (B, V) float32 logits.
- `keep(indices)`: keep only these rows, in this order.
- `refill(sequences)`: recompute every row's cache from scratch (after a weight
  update), returning (B, V) logits.
- `reset()`: drop every row and free the cache.
- `reload(model)`: the model's weights changed in place.
- `adapt(adapter)`: serve the weights with this LoRA adapter applied (None: without);
  the model's own (base) weights are not touched. The fused runner merges it into its
  fused weights (W + B A, rebuilt from the base each time, so versions never drift);
  the Hugging Face one adds a low-rank term after each adapted module.
- `set_budget(tokens)`: the KV budget `fits` checks from now on; cache memory beyond
  it is released once no row is running (rows running past it keep their cache).
- `memory_bytes()`: {"weights": bytes of the model's parameters and the runner's own
  weight tensors, shared storage counted once, "kv_cache": bytes of the KV cache}.

`FusedRunner` (Llama-family models, `fused.py`, with the cpu or portable kernels) keeps
a preallocated slot cache (`kv_cache.py`) and shares one prefill among identical
prompts (the samples of a GRPO group). `HFRunner` runs any causal LM through its
Hugging Face forward and a `DynamicCache`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel

from looprl.engines.local.fused import FusedDecoder
from looprl.engines.local.graphs import GRAPHS, DecodeGraphs
from looprl.engines.local.kv_cache import PrefixStore, SlotCache, common_prefix_length
from looprl.types import LoraAdapter


class FusedRunner:
    def __init__(
        self,
        model: PreTrainedModel,
        budget_tokens: int,
        prefix_cache_tokens: int = 0,
        *,
        packed: bool = False,
        kernels: str = "cpu",
        graphs: str = "off",
    ) -> None:
        self._decoder = FusedDecoder(model, packed=packed, kernels=kernels)
        self._model = model  # the base: an adapter is merged into the fused copy only
        self._device = model.device
        self.cache = SlotCache(self._decoder, budget_tokens)
        # Decode steps: "off" FusedDecoder.decode; "cuda" the static decode replayed from
        # CUDA graphs; "eager" the same static decode run as is (graphs.py).
        if graphs not in GRAPHS:
            raise ValueError(f"graphs={graphs!r} must be one of {', '.join(GRAPHS)}")
        if graphs != "off" and kernels != "portable":
            raise ValueError(f"graphs={graphs!r} runs the portable kernels, not {kernels!r}")
        self.graphs = None
        if graphs != "off":
            self.graphs = DecodeGraphs(self._decoder, self.cache, capture=graphs == "cuda")
        self.prefixes = PrefixStore(prefix_cache_tokens) if prefix_cache_tokens else None
        self._slots: list[int] = []  # per row
        self._tokens: list[list[int]] = []  # per row: the tokens whose K/V are in the cache
        self._reserved: list[int] = []  # per row: columns it may grow to

    def reload(self, model: PreTrainedModel) -> None:
        self._decoder.load(model)
        self._loaded()

    def adapt(self, adapter: LoraAdapter | None) -> None:
        self._decoder.load(self._model, adapter)
        self._loaded()

    def _loaded(self) -> None:
        if self.prefixes is not None:
            self.prefixes.clear()
        if self.graphs is not None:
            self.graphs.weights_loaded()

    def set_budget(self, tokens: int) -> None:
        self.cache.budget_tokens = tokens
        if not self._slots:
            self.cache.clear()  # releases memory the budget no longer allows

    def memory_bytes(self) -> dict[str, int]:
        tensors = [*self._model.parameters(), *self._decoder.weights()]
        return {"weights": _unique_bytes(tensors), "kv_cache": self.cache.nbytes}

    def fits(self, reserved: list[int]) -> bool:
        top = max([*self._slots, -1]) + 1
        return self.cache.fits(max(top, len(reserved)), max(reserved, default=0))

    def prefill(self, sequences: list[list[int]], reserved: list[int]) -> torch.Tensor:
        taken = set(self._slots)
        free = (s for s in range(len(taken) + len(sequences)) if s not in taken)
        slots = [next(free) for _ in sequences]
        self._slots += slots
        self._tokens += [list(s) for s in sequences]
        self._reserved += reserved
        self.cache.reserve(max(self._slots) + 1, max(self._reserved))
        return self._prefill(sequences, slots)

    def _prefill(self, sequences: list[list[int]], slots: list[int]) -> torch.Tensor:
        # Identical sequences (the samples of a group) share one forward; their cache is
        # copied slot to slot. The others start after the longest prefix stored.
        keys = [tuple(s) for s in sequences]
        first: dict[tuple[int, ...], int] = {}
        source = [first.setdefault(key, i) for i, key in enumerate(keys)]
        unique = sorted(set(source))
        starts = {i: 0 for i in unique}
        if self.prefixes is not None:
            self._store_common_prefix([keys[i] for i in unique], slots[unique[0]])
            starts = {i: self.prefixes.restore(keys[i], self.cache, slots[i]) for i in unique}
        logits = self._forward(
            [sequences[i] for i in unique], [slots[i] for i in unique], [starts[i] for i in unique]
        )
        copies = [i for i in range(len(sequences)) if source[i] != i]
        if copies:
            width = max(len(sequences[i]) for i in unique)
            dst = torch.tensor([slots[i] for i in copies], device=self._device)
            src = torch.tensor([slots[source[i]] for i in copies], device=self._device)
            self.cache.copy_slots(src, dst, width)
        row_of = {i: row for row, i in enumerate(unique)}
        return logits[torch.tensor([row_of[i] for i in source], device=self._device)]

    def _forward(
        self, sequences: list[list[int]], slots: list[int], starts: list[int]
    ) -> torch.Tensor:
        """Prefill each sequence from its start (the K/V before it already in its slot)."""
        lengths = [len(s) - start for s, start in zip(sequences, starts, strict=True)]
        ids = torch.zeros(len(sequences), max(lengths), dtype=torch.long)
        for row, (sequence, start) in enumerate(zip(sequences, starts, strict=True)):
            ids[row, : len(sequence) - start] = torch.tensor(sequence[start:])
        device = self._device
        return self._decoder.prefill(
            self.cache,
            ids.to(device),
            torch.tensor(lengths, device=device),
            torch.tensor(slots, device=device),
            torch.tensor(starts, device=device) if any(starts) else None,
        )

    def _store_common_prefix(self, keys: list[tuple[int, ...]], slot: int) -> None:
        """Compute the prefix all `keys` share once, in `slot`, and store it (unless the
        store already has it), so that every row's prefill starts after it."""
        if len(keys) < 2:
            return
        length = min(len(k) for k in keys) - 1
        for key in keys[1:]:
            length = min(length, common_prefix_length(keys[0], key))
        prefix = keys[0][:length]
        if length < self.prefixes.min_tokens or self.prefixes.match(prefix)[1] >= length - 1:
            return
        start = self.prefixes.restore(prefix, self.cache, slot)
        self._forward([list(prefix)], [slot], [start])
        self.prefixes.save(prefix, self.cache, slot)

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        lengths = [len(t) for t in self._tokens]
        if self.graphs is not None:
            logits = self.graphs.decode(tokens, lengths, self._slots)
        else:
            positions = torch.tensor(lengths, device=self._device)
            slots = torch.tensor(self._slots, device=self._device)
            logits = self._decoder.decode(self.cache, tokens.to(self._device), positions, slots)
        for row, token in zip(self._tokens, tokens.tolist(), strict=True):
            row.append(token)
        return logits

    def refill(self, sequences: list[list[int]]) -> torch.Tensor:
        self._tokens = [list(s) for s in sequences]
        return self._prefill(sequences, self._slots)

    def keep(self, indices: list[int]) -> None:
        if self.prefixes is not None:  # finished rows: a later prompt may extend them
            kept = set(indices)
            for row, (slot, tokens) in enumerate(zip(self._slots, self._tokens, strict=True)):
                if row not in kept:
                    self.prefixes.save(tuple(tokens), self.cache, slot)
        self._slots = [self._slots[i] for i in indices]
        self._tokens = [self._tokens[i] for i in indices]
        self._reserved = [self._reserved[i] for i in indices]
        if not indices:
            self.cache.clear()

    def reset(self) -> None:
        self._slots, self._tokens, self._reserved = [], [], []
        self.cache.clear()


class HFRunner:
    """Rows left-padded into one `DynamicCache`, each with explicit position ids.

    New rows are prefilled in one forward and their cache padded and stacked onto the
    running one; columns that are padding in every row are dropped when rows leave.
    """

    def __init__(self, model: PreTrainedModel, budget_tokens: int) -> None:
        self._model = model
        self._device = model.device
        self._budget_tokens = budget_tokens
        self._cache: DynamicCache | None = None
        self._mask = torch.zeros(0, 0, dtype=torch.long)  # (B, S) 1 = real token
        self._positions = torch.zeros(0, dtype=torch.long)  # (B,) position of the next token
        self._adapter_hooks: list[torch.utils.hooks.RemovableHandle] = []

    def reload(self, model: PreTrainedModel) -> None:
        self.adapt(None)  # new full weights replace base + adapter; the forward reads them

    def adapt(self, adapter: LoraAdapter | None) -> None:
        """A forward hook per adapted module adds scaling x (x A^T) B^T to its output."""
        terms = []
        for name in adapter.modules() if adapter is not None else []:
            try:
                module = self._model.get_submodule(name)
            except AttributeError as e:
                raise ValueError(f"the adapter adapts {name!r}, which the model has not") from e
            a = adapter.tensors[f"{name}.lora_A.weight"]
            b = adapter.scaling * adapter.tensors[f"{name}.lora_B.weight"]
            dtype = self._model.dtype
            terms.append((module, a.to(self._device, dtype), b.to(self._device, dtype)))
        for hook in self._adapter_hooks:  # only a whole adapter is ever applied
            hook.remove()
        self._adapter_hooks = []
        for module, a, b in terms:

            def add_lowrank(_module, inputs, output, a=a, b=b):
                return output + F.linear(F.linear(inputs[0], a), b)

            self._adapter_hooks.append(module.register_forward_hook(add_lowrank))

    def set_budget(self, tokens: int) -> None:
        self._budget_tokens = tokens  # the cache is freed whenever no row is running

    def memory_bytes(self) -> dict[str, int]:
        layers = self._cache.layers if self._cache is not None else []
        kv = sum(t.nbytes for layer in layers for t in (layer.keys, layer.values))
        return {"weights": _unique_bytes(list(self._model.parameters())), "kv_cache": kv}

    def fits(self, reserved: list[int]) -> bool:
        return sum(reserved) <= self._budget_tokens

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        self._mask = F.pad(self._mask, (0, 1), value=1)
        out = self._model(
            input_ids=tokens.to(self._device)[:, None],
            attention_mask=self._mask,
            position_ids=self._positions[:, None],
            past_key_values=self._cache,
            use_cache=True,
        )
        self._positions = self._positions + 1
        return out.logits[:, -1].float()

    def refill(self, sequences: list[list[int]]) -> torch.Tensor:
        self.reset()
        return self.prefill(sequences, [])

    @torch.inference_mode()
    def prefill(self, sequences: list[list[int]], reserved: list[int]) -> torch.Tensor:
        width = max(len(s) for s in sequences)
        ids = torch.zeros(len(sequences), width, dtype=torch.long)
        mask = torch.zeros(len(sequences), width, dtype=torch.long)
        for i, sequence in enumerate(sequences):
            ids[i, width - len(sequence) :] = torch.tensor(sequence)
            mask[i, width - len(sequence) :] = 1
        ids, mask = ids.to(self._device), mask.to(self._device)
        lengths = mask.sum(dim=-1)
        cache = DynamicCache()
        out = self._model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        if self._cache is None:
            self._cache, self._mask, self._positions = cache, mask, lengths
        else:
            # Left-pad the shorter of the two caches (masked out) so both have S columns.
            s = max(self._mask.shape[1], width)
            for old_layer, new_layer in zip(self._cache.layers, cache.layers, strict=True):
                old_layer.keys = torch.cat(
                    [_left_pad(old_layer.keys, s), _left_pad(new_layer.keys, s)]
                )
                old_layer.values = torch.cat(
                    [_left_pad(old_layer.values, s), _left_pad(new_layer.values, s)]
                )
            self._mask = torch.cat([_left_pad(self._mask, s, dim=1), _left_pad(mask, s, dim=1)])
            self._positions = torch.cat([self._positions, lengths])
        return out.logits[:, -1].float()

    def keep(self, indices: list[int]) -> None:
        if not indices:
            self.reset()
            return
        index = torch.tensor(indices, device=self._device)
        self._mask = self._mask[index]
        self._positions = self._positions[index]
        first = int(self._mask.any(dim=0).int().argmax())
        for layer in self._cache.layers:
            layer.keys = layer.keys[index, :, first:]
            layer.values = layer.values[index, :, first:]
        self._mask = self._mask[:, first:]

    def reset(self) -> None:
        self._cache = None
        self._mask = self._mask[:0, :0]
        self._positions = self._positions[:0]


def _left_pad(t: torch.Tensor, size: int, dim: int = 2) -> torch.Tensor:
    """Zero-pad `t` on the left of `dim` up to `size` (dim 2 of (B, H, S, D) KV tensors)."""
    missing = size - t.shape[dim]
    if missing == 0:
        return t
    pad = [0, 0] * (t.dim() - 1 - dim) + [missing, 0]
    return F.pad(t, pad)


def _unique_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes held by `tensors`, each storage once (views and shared weights count once;
    oneDNN-packed tensors, which expose no storage, by their own size)."""
    sizes = {}
    for t in tensors:
        if t.is_mkldnn:
            sizes[id(t)] = t.numel() * t.element_size()
        else:
            storage = t.untyped_storage()
            sizes[storage.data_ptr()] = storage.nbytes()
    return sum(sizes.values())
