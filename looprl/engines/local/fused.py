"""A lean forward pass for Llama-family decoders, over a preallocated slot KV cache.

Why it exists. At decode time on a CPU, a Hugging Face forward spends more time in
Python and small tensor ops than in matrix multiplies: per layer it runs separate
q/k/v and gate/up projections, recomputes rotary tables, grows a `DynamicCache` with
`torch.cat` and builds a 4-D mask. This module does the same math with fused weights
(one q|k|v matmul, one gate|up matmul), a rotary table computed once, and a KV cache
preallocated as one tensor per K and V that new tokens are written into in place.

On CPU, weights can also be
reordered once into oneDNN's blocked layout (`packed=True`, `mkldnn._linear_pointwise`),
faster than `F.linear` on decode shapes; where oneDNN cannot pack the dtype (bfloat16
without AVX-512 BW/VL/DQ or AVX-NE-CONVERT, a GPU) the same forward runs plain
`F.linear` (`precision.py` decides). Decode attention is two batched matmuls, several
times faster than scaled_dot_product_attention's CPU kernel for one query row
(`bench/engine_choices.py` measures both).

What it covers: decoder-only models whose layers are Llama's (Llama, Mistral without a
sliding window, Qwen2 with q/k/v biases, Qwen3 with per-head q/k norms).
`unsupported_reason` says why any other model is left to the Hugging Face forward.

The cache. `SlotCache` holds V as (layers, slots, kv_heads, T, head_dim), K transposed. A
sequence owns one slot from admission to finish, and its token at position p lives at
column p. Slots and columns grow on demand (rounded up, never past the budget the
engine checks with `fits`); the memory is kept for the next batch. Decode attends
from every slot up to the highest in use, each row masked to its own length; a free
slot's query is a zero row whose output is discarded.

`PrefixStore` keeps the K/V of prefixes computed earlier (a system prompt, a previous
turn), so a prefill starts after the longest one its sequence begins with.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F
from transformers import PretrainedConfig, PreTrainedModel

from looprl.types import LoraAdapter

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")
_SLOT_ROUND, _COLUMN_ROUND = 8, 64


def unsupported_reason(cfg: PretrainedConfig) -> str | None:
    """Why a model of config `cfg` cannot run on the fused forward, or None when it can."""
    if cfg.model_type not in SUPPORTED:
        return f"model_type {cfg.model_type!r} is not one of {', '.join(SUPPORTED)}"
    if getattr(cfg, "use_sliding_window", False) or (
        cfg.model_type == "mistral" and getattr(cfg, "sliding_window", None)
    ):
        return "the model uses sliding-window attention"
    if getattr(cfg, "mlp_bias", False):
        return "the model's MLP has biases"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r} is not 'silu'"
    layer_types = getattr(cfg, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        return "some layers do not use full attention"
    return None


class FusedDecoder:
    """The fused-weight forward of `model` (already in the engine's dtype), its weights in
    oneDNN's packed layout when `packed` (CPU only), else plain.

    `load(model)` rebuilds the fused weights after the model's parameters change.
    """

    def __init__(self, model: PreTrainedModel, *, packed: bool = False) -> None:
        reason = unsupported_reason(model.config)
        if reason:
            raise ValueError(f"the fused forward cannot run this model: {reason}")
        cfg = model.config
        self.num_layers = cfg.num_hidden_layers
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.eps = cfg.rms_norm_eps
        self.scale = self.head_dim**-0.5
        self.dtype = model.dtype
        self.device = model.device
        if packed and self.device.type != "cpu":
            raise ValueError(
                f"packed weights are oneDNN's CPU layout; the model is on {self.device}"
            )
        self.packed = packed
        self.max_positions = cfg.max_position_embeddings
        # Rotary tables for every position, from the model's own rotary module (so any
        # rope scaling it implements is honoured): (max_positions, head_dim) each.
        positions = torch.arange(self.max_positions, device=self.device)[None]
        probe = torch.zeros((), dtype=torch.float32, device=self.device)
        with torch.no_grad():
            cos, sin = model.model.rotary_emb(probe, positions)
        # Rotating x is `x * cos + x.roll(d/2) * sin` with sin's first half negated: that
        # turns roll's [x2, x1] into rotate_half's [-x2, x1].
        half = self.head_dim // 2
        sin = torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)
        self.cos, self.sin = cos[0].to(self.dtype), sin.to(self.dtype)
        # Per q|k head: q's carry the attention scale, so attention needs no extra multiply.
        self.qk_scale = torch.ones(self.num_heads + self.num_kv_heads, dtype=self.dtype)
        self.qk_scale[: self.num_heads] = self.scale
        self.qk_scale = self.qk_scale.to(self.device)
        self.intermediate_size = cfg.intermediate_size
        self.load(model)

    @torch.no_grad()
    def load(self, model: PreTrainedModel, adapter: LoraAdapter | None = None) -> None:
        """(Re)build the fused weights from `model`'s current parameters, with `adapter`
        (if any) merged into them: each fused weight W becomes W + B A (one addmm, which
        accumulates in float32 and rounds once), `model` itself is left as it is. An
        adapter that does not fit raises before anything changes."""
        deltas = self._adapter_deltas(adapter)
        inner = model.model
        pack = _pack if self.packed else lambda w: w

        def fused(i: int, group: str, weight: torch.Tensor) -> torch.Tensor:
            factors = deltas[i].get(group)
            if factors is not None:
                weight = torch.addmm(weight, *factors)
            return pack(weight)

        self.embed = inner.embed_tokens.weight
        self.final_norm = inner.norm.weight
        self.lm_head = pack(model.get_output_embeddings().weight)
        self.layers = []
        for i, layer in enumerate(inner.layers):
            attn, mlp = layer.self_attn, layer.mlp
            projections = (attn.q_proj, attn.k_proj, attn.v_proj)
            bias = None
            if attn.q_proj.bias is not None:
                bias = torch.cat([p.bias for p in projections])
            q_norm = getattr(attn, "q_norm", None)
            k_norm = getattr(attn, "k_norm", None)
            self.layers.append(
                (
                    layer.input_layernorm.weight,
                    fused(i, "qkv", torch.cat([p.weight for p in projections])),
                    bias,
                    None if q_norm is None else q_norm.weight,
                    None if k_norm is None else k_norm.weight,
                    fused(i, "o", attn.o_proj.weight),
                    layer.post_attention_layernorm.weight,
                    fused(i, "gu", torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])),
                    fused(i, "d", mlp.down_proj.weight),
                )
            )

    def _adapter_deltas(
        self, adapter: LoraAdapter | None
    ) -> list[dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        """Per layer, the low-rank factors (B (out, R), A (R, in)) of `adapter`'s delta of
        each fused weight it adapts, in the engine's dtype: A stacks the projections'
        lora_A, B places scaling x each lora_B in its projection's rows (q|k|v and
        gate|up stacked as their weights are), so B A is the fused weight's delta.
        Raises naming the modules the fused forward has no weight for."""
        deltas: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [
            {} for _ in range(self.num_layers)
        ]
        if adapter is None:
            return deltas
        h, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        hidden, inter = self.embed.shape[1], self.intermediate_size
        groups = {
            "qkv": (
                ("self_attn.q_proj", h * d),
                ("self_attn.k_proj", kv * d),
                ("self_attn.v_proj", kv * d),
            ),
            "o": (("self_attn.o_proj", hidden),),
            "gu": (("mlp.gate_proj", inter), ("mlp.up_proj", inter)),
            "d": (("mlp.down_proj", hidden),),
        }
        applied = set()
        for i, layer_deltas in enumerate(deltas):
            for group, parts in groups.items():
                names = [f"model.layers.{i}.{part}" for part, _ in parts]
                present = [n for n in names if f"{n}.lora_A.weight" in adapter.tensors]
                if not present:
                    continue
                a = torch.cat([adapter.tensors[f"{n}.lora_A.weight"] for n in present])
                b = torch.zeros(sum(size for _, size in parts), a.shape[0])
                row = column = 0
                for name, (_, size) in zip(names, parts, strict=True):
                    if name in present:
                        block = adapter.tensors[f"{name}.lora_B.weight"]
                        b[row : row + size, column : column + adapter.rank] = block
                        column += adapter.rank
                    row += size
                layer_deltas[group] = (
                    (adapter.scaling * b).to(self.device, self.dtype),
                    a.to(self.device, self.dtype),
                )
                applied.update(present)
        left = sorted(set(adapter.modules()) - applied)
        if left:
            raise ValueError(
                f"the adapter adapts {left[:3]}, which the fused forward does not apply "
                "(it adapts the attention and MLP projections); leave them out of "
                "model.lora.target_modules, or set engine.impl=hf"
            )
        return deltas

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # As Hugging Face's RMSNorm: statistics in float32, weight applied in the model
        # dtype. (F.rms_norm is no single kernel on CPU and measured slower.)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True).add_(self.eps))
        return weight * x32.to(x.dtype)

    def _rotary(self, positions: torch.Tensor, heads_dim: int) -> tuple[torch.Tensor, ...]:
        """cos and signed sin at `positions`, scaled per q|k head along `heads_dim`."""
        cos, sin = self.cos[positions], self.sin[positions]  # (..., d)
        scale = self.qk_scale.view(-1, *[1] * (cos.dim() - heads_dim))
        return cos.unsqueeze(heads_dim) * scale, sin.unsqueeze(heads_dim) * scale

    def _rope(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return torch.addcmul(qk * cos, qk.roll(self.head_dim // 2, dims=-1), sin)

    def _qk(self, qkv: torch.Tensor, layer: tuple, heads_dim: int) -> torch.Tensor:
        """q|k heads of `qkv`, normalized per head where the model does it (Qwen3)."""
        q_norm, k_norm = layer[3], layer[4]
        h, kv = self.num_heads, self.num_kv_heads
        qk = qkv.narrow(heads_dim, 0, h + kv)
        if q_norm is None:
            return qk
        q, k = qk.split((h, kv), dim=heads_dim)
        return torch.cat((self._norm(q, q_norm), self._norm(k, k_norm)), dim=heads_dim)

    @torch.inference_mode()
    def prefill(
        self,
        cache: SlotCache,
        ids: torch.Tensor,
        lengths: torch.Tensor,
        slots: torch.Tensor,
        starts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run right-padded `ids` (B, P); write their K/V into `slots`.

        Row r's tokens sit at positions starts[r].. (default 0); columns below
        starts[r] must already hold the K/V of the tokens before them (a reused prefix).
        Returns (B, V) float32 logits at each row's last real token (`lengths` - 1).
        From position 0, padding columns write K/V past each row's length; decode
        overwrites column `length` before any row attends to it, and never attends
        beyond. After a prefix, only real tokens are written.
        """
        b, p = ids.shape
        h, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        offsets = torch.arange(p, device=ids.device)
        extend = starts is not None and bool(starts.any())
        if extend:
            positions = starts[:, None] + offsets  # (b, p)
            real = offsets < lengths[:, None]
            rows, columns = real.nonzero(as_tuple=True)
            written_slots, written_columns = slots[rows], positions[rows, columns]
            width = int((starts + lengths).max())
            # Each query sees the columns up to its own position: prefix and suffix alike.
            visible = torch.arange(width, device=ids.device) <= positions[..., None]
            visible = visible[:, None]  # (b, 1, p, width)
            cos, sin = self._rotary(positions.clamp(max=self.max_positions - 1), heads_dim=1)
        else:
            cos, sin = self._rotary(offsets, heads_dim=0)  # (h+kv, p, d)
        x = F.embedding(ids, self.embed)
        for i, layer in enumerate(self.layers):
            norm1, wqkv, bqkv, _, _, wo, norm2, wgu, wd = layer
            qkv = _linear(self._norm(x, norm1), wqkv, bqkv).view(b, p, h + 2 * kv, d)
            qkv = qkv.transpose(1, 2)  # (b, heads, p, d)
            q, k = self._rope(self._qk(qkv, layer, 1), cos, sin).split((h, kv), dim=1)
            v = qkv[:, h + kv :]
            if extend:
                cache.k[i, written_slots, :, :, written_columns] = k.transpose(1, 2)[rows, columns]
                cache.v[i, written_slots, :, written_columns] = v.transpose(1, 2)[rows, columns]
                keys = cache.k[i, slots, :, :, :width].transpose(-1, -2)
                values = cache.v[i, slots, :, :width]
                out = F.scaled_dot_product_attention(
                    q, keys, values, attn_mask=visible, scale=1.0, enable_gqa=kv != h
                )
            else:
                cache.k[i, slots, :, :, :p] = k.transpose(-1, -2)
                cache.v[i, slots, :, :p] = v
                out = F.scaled_dot_product_attention(
                    q, k, v, is_causal=True, scale=1.0, enable_gqa=kv != h
                )
            x = x + _linear(out.transpose(1, 2).reshape(b, p, h * d), wo)
            x = x + self._mlp(self._norm(x, norm2), wgu, wd)
        last = x[torch.arange(b, device=x.device), lengths - 1]
        return self._logits(last)

    @torch.inference_mode()
    def decode(
        self, cache: SlotCache, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor
    ) -> torch.Tensor:
        """Feed one token per row (`ids` (B,) at `positions` (B,) in `slots` (B,)).

        Returns (B, V) float32 logits for each row's next token.
        """
        b = ids.shape[0]
        h, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        top = int(slots.max()) + 1
        width = int(positions.max()) + 1
        # Every slot below `top` attends; row r of the batch is slot slots[r]. When the
        # rows are exactly slots 0..b-1 (the usual case) no scatter/gather is needed.
        in_order = top == b and bool((slots == torch.arange(b, device=slots.device)).all())
        keys = torch.arange(width, device=ids.device)
        limit = torch.zeros(top, dtype=torch.long, device=ids.device)
        limit[slots] = positions
        hidden = (keys[None, :] > limit[:, None])[:, None, None, :]  # (top, 1, 1, width)
        group = h // kv  # query heads per KV head
        if not in_order:  # free slots below `top` get a zero query, their output dropped
            query = torch.zeros(top, kv, group, d, dtype=self.dtype, device=ids.device)
        cos, sin = self._rotary(positions, heads_dim=1)  # (b, h+kv, d)
        x = F.embedding(ids, self.embed)  # (B, hidden)
        for i, layer in enumerate(self.layers):
            norm1, wqkv, bqkv, _, _, wo, norm2, wgu, wd = layer
            qkv = _linear(self._norm(x, norm1), wqkv, bqkv).view(b, h + 2 * kv, d)
            q, k = self._rope(self._qk(qkv, layer, 1), cos, sin).split((h, kv), dim=1)
            cache.k[i, slots, :, :, positions] = k
            cache.v[i, slots, :, positions] = qkv[:, h + kv :]
            if in_order:
                query = q.reshape(b, kv, group, d)
            else:
                query[slots] = q.reshape(b, kv, group, d)
            scores = torch.matmul(query, cache.k[i, :top, :, :, :width])
            # softmax of bf16 accumulates in float32 inside the kernel.
            probs = scores.masked_fill_(hidden, -torch.inf).softmax(dim=-1)
            out = torch.matmul(probs, cache.v[i, :top, :, :width])  # (top, kv, group, d)
            if not in_order:
                out = out[slots]
            x = x + _linear(out.reshape(b, h * d), wo)
            x = x + self._mlp(self._norm(x, norm2), wgu, wd)
        return self._logits(x)

    def _mlp(self, x: torch.Tensor, wgu: torch.Tensor, wd: torch.Tensor) -> torch.Tensor:
        gate, up = _linear(x, wgu).chunk(2, dim=-1)
        return _linear(F.silu(gate) * up, wd)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(self._norm(x, self.final_norm), self.lm_head).float()


def _pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` (out, in) in oneDNN's blocked layout, for `_linear` on CPU."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 32)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class SlotCache:
    """K and V of the running sequences, one tensor each for all layers.

    V is (layers, slots, kv_heads, T, head_dim); K is stored transposed, (layers,
    slots, kv_heads, head_dim, T). Decode reads only the first `width` columns (at
    decode the cache read is as large as the weights', both memory-bound). In bf16,
    bmm copies such a column slice first (its batch stride is not width x head_dim),
    ~15% of a decode step at 64 rows; attending over every column instead, with the
    columns grown as sequences lengthen, saved that but lost it again to the copies
    each growth makes, so the columns are reserved up front. (With K as (T, head_dim)
    its sliced transpose cost more: ~1.7x slower, `bench/engine_choices.py`.)

    With no rows (`clear`), the memory is kept and viewed in the next batch's shape:
    allocating and zeroing it again costs ~0.5 s for 64 slots x 192 columns of
    SmolLM2-135M. Columns beyond a row's length hold finite leftovers, masked out.
    """

    def __init__(self, decoder: FusedDecoder, budget_tokens: int) -> None:
        self._decoder = decoder
        self.budget_tokens = budget_tokens
        self._storage = (torch.zeros(0, dtype=decoder.dtype, device=decoder.device),) * 2
        self.clear()

    def _view(self, slots: int, columns: int) -> None:
        """K and V as (slots, columns) views of the start of their storage."""
        d = self._decoder
        outer = (d.num_layers, slots, d.num_kv_heads)
        numel = d.num_layers * slots * d.num_kv_heads * d.head_dim * columns
        k, v = (storage[:numel] for storage in self._storage)
        self.k = k.view(*outer, d.head_dim, columns)
        self.v = v.view(*outer, columns, d.head_dim)

    @property
    def shape(self) -> tuple[int, int]:
        """(slots, columns) in use."""
        return self.v.shape[1], self.v.shape[3]

    @property
    def nbytes(self) -> int:
        """Bytes allocated (K and V), including any kept from an earlier, larger batch."""
        return sum(s.nbytes for s in self._storage)

    def fits(self, slots: int, columns: int) -> bool:
        """Whether `slots` sequences of up to `columns` tokens stay within the budget."""
        return slots * columns <= self.budget_tokens

    def reserve(self, slots: int, columns: int) -> None:
        """Grow to at least (slots, columns), rounded up but within the budget.

        The caller asks for slots up to the highest in use and columns up to the longest
        row, so slots or columns beyond those (kept from earlier rounding) are dropped
        when keeping them would pass the budget.
        """
        have_slots, have_columns = self.shape
        if slots <= have_slots and columns <= have_columns:
            return
        if self.fits(max(slots, have_slots), max(columns, have_columns)):
            slots, columns = max(slots, have_slots), max(columns, have_columns)
        elif self.fits(slots, max(columns, have_columns)):
            columns = max(columns, have_columns)
        elif self.fits(max(slots, have_slots), columns):
            slots = max(slots, have_slots)
        rounded_slots = -(-slots // _SLOT_ROUND) * _SLOT_ROUND
        rounded_columns = -(-columns // _COLUMN_ROUND) * _COLUMN_ROUND
        if self.fits(rounded_slots, columns):
            slots = rounded_slots
        if self.fits(slots, rounded_columns):
            columns = rounded_columns
        old_k, old_v = self.k, self.v
        d = self._decoder
        numel = d.num_layers * slots * d.num_kv_heads * d.head_dim * columns
        if old_v.numel() or numel > self._storage[0].numel():
            # zeros: V must be finite where no token was written (0 x NaN is NaN)
            self._storage = tuple(
                torch.zeros(numel, dtype=d.dtype, device=d.device) for _ in range(2)
            )
        self._view(slots, columns)
        kept_slots, kept_columns = min(slots, have_slots), min(columns, have_columns)
        self.k[:, :kept_slots, ..., :kept_columns] = old_k[:, :kept_slots, ..., :kept_columns]
        self.v[:, :kept_slots, :, :kept_columns] = old_v[:, :kept_slots, :, :kept_columns]

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor, columns: int) -> None:
        """Copy the first `columns` of slots `src` into slots `dst` (pairwise)."""
        self.k[:, dst, ..., :columns] = self.k[:, src, ..., :columns]
        self.v[:, dst, :, :columns] = self.v[:, src, :, :columns]

    def clear(self) -> None:
        """No rows hold K/V any more: shape (0, 0), memory kept for the next batch."""
        self._view(0, 0)

    def release(self) -> None:
        """Free the memory."""
        self._storage = tuple(s[:0].clone() for s in self._storage)
        self.clear()


class PrefixStore:
    """K/V of token sequences computed earlier, for new sequences that start the same way.

    Entries are the shared prefix of a prefill batch (a system prompt, a few-shot
    preamble) and every finished sequence (a multi-turn session's next prompt extends
    its previous one). A new sequence takes the longest match among entries, as long
    as at least `min_tokens` match, and its prefill starts after it. Entries are
    evicted least recently used beyond `capacity_tokens`; an entry that is a prefix of
    a newer one is dropped, the newer one serving both. K/V computed under old weights
    are useless, so the runner clears the store on every weight update.
    """

    def __init__(self, capacity_tokens: int, min_tokens: int = 16) -> None:
        self.capacity_tokens = capacity_tokens
        self.min_tokens = min_tokens
        self._entries: OrderedDict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = (
            OrderedDict()
        )
        self.tokens = 0  # held
        self.reused_tokens = 0  # prefill tokens skipped thanks to the store, since creation

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, sequence: tuple[int, ...]) -> tuple[tuple[int, ...] | None, int]:
        """The entry sharing the longest prefix with `sequence`, and how many tokens of it
        are usable (at least one token of `sequence` is always left to compute)."""
        best, best_length = None, 0
        for key in self._entries:
            length = min(common_prefix_length(key, sequence), len(sequence) - 1)
            if length > best_length:
                best, best_length = key, length
        if best_length < self.min_tokens:
            return None, 0
        return best, best_length

    def restore(self, sequence: tuple[int, ...], cache: SlotCache, slot: int) -> int:
        """Copy the K/V of `sequence`'s longest stored prefix into `slot`; its length."""
        key, length = self.match(sequence)
        if key is None:
            return 0
        k, v = self._entries[key]
        self._entries.move_to_end(key)
        cache.k[:, slot, ..., :length] = k[..., :length]
        cache.v[:, slot, :, :length] = v[:, :, :length]
        self.reused_tokens += length
        return length

    def save(self, tokens: tuple[int, ...], cache: SlotCache, slot: int) -> None:
        """Keep the K/V of `tokens`, which `slot` holds in its first len(tokens) columns."""
        n = len(tokens)
        if n < self.min_tokens or n > self.capacity_tokens:
            return
        if tokens in self._entries:
            self._entries.move_to_end(tokens)
            return
        for key in [key for key in self._entries if tokens[: len(key)] == key]:
            self._drop(key)
        while self.tokens + n > self.capacity_tokens:
            self._drop(next(iter(self._entries)))
        self._entries[tokens] = (
            cache.k[:, slot, ..., :n].clone(),
            cache.v[:, slot, :, :n].clone(),
        )
        self.tokens += n

    def _drop(self, key: tuple[int, ...]) -> None:
        del self._entries[key]
        self.tokens -= len(key)

    def clear(self) -> None:
        self._entries.clear()
        self.tokens = 0


def common_prefix_length(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Length of the common prefix of `a` and `b` (binary search over C-speed compares)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n  # a[:low] == b[:low], a[:high] != b[:high]
    while high - low > 1:
        middle = (low + high) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle
    return low
