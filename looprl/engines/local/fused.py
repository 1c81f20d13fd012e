"""A lean forward pass for Llama-family decoders, over a preallocated slot KV cache.

Why it exists. At decode time on a CPU, a Hugging Face forward spends more time in
Python and small tensor ops than in matrix multiplies: per layer it runs separate
q/k/v and gate/up projections, recomputes rotary tables, grows a `DynamicCache` with
`torch.cat` and builds a 4-D mask. This module does the same math with fused weights
(one q|k|v matmul, one gate|up matmul), a rotary table computed once, and a KV cache
preallocated as one tensor per K and V that new tokens are written into in place
(`kv_cache.py`).

Two sets of kernels (`kernels`, engine.kernels), the same math:
- "cpu", tuned for CPUs. Weights can be reordered once into oneDNN's blocked layout
  (`packed=True`, `mkldnn._linear_pointwise`), faster than `F.linear` on decode shapes;
  where oneDNN cannot pack the dtype (bfloat16 without AVX-512 BW/VL/DQ or
  AVX-NE-CONVERT) the same forward runs plain `F.linear` (`precision.py` decides).
  Decode attention is two batched matmuls over K stored transposed, several times
  faster than scaled_dot_product_attention's CPU kernel for one query row
  (`bench/engine_choices.py` measures both).
- "portable", plain torch that is right on any device, for GPUs (start-up picks it
  there): `F.linear`, and scaled_dot_product_attention for prefill and decode alike,
  reading the cache in place (views, no gather): K is stored as V is, (T, head_dim)
  with a unit last stride, which GPU attention kernels require and the transposed cpu
  layout lacks. At decode each KV head's `group` query heads are the query rows of one
  SDPA head (query (slots, kv_heads, group, head_dim), one mask row per slot): grouped
  query attention without `enable_gqa`, which CUDA's memory-efficient kernel does not
  take and which makes the CPU kernel copy K and V per query head (~5x slower in bf16
  here). On a CPU it is slower than "cpu" (`bench/engine.py --kernels both`).

What it covers: decoder-only models whose layers are Llama's (Llama, Mistral without a
sliding window, Qwen2 with q/k/v biases, Qwen3 with per-head q/k norms).
`unsupported_reason` says why any other model is left to the Hugging Face forward.

Decode attends from every slot up to the highest in use, each row masked to its own
length; a free slot's query is a zero row whose output is discarded.

Weight updates. `load` writes plain weights into the fused tensors it built before
(slice copies, no allocation), and uses the model's own tensor where a weight is one
tensor of the model (o, down, the LM head) and no adapter changes it: an update costs
no memory beyond the model's own, which matters where the engine and a trainer share a
GPU. Packed weights are packed anew.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import PretrainedConfig, PreTrainedModel

from looprl.engines.local.kv_cache import SlotCache
from looprl.types import LoraAdapter

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")
KERNELS = ("cpu", "portable")
# The portable decode attends to the columns in use rounded up to a multiple of this
# (masked beyond each row's length). On CUDA, scaled_dot_product_attention's cuDNN kernel
# builds a plan per new shape: one per decode step cost ~1.5 ms of host time a layer
# (58% of a step, 256 rows of SmolLM2-135M on an H200, bench/gpu_engine.py).
WIDTH_STEP = 128


def attention_width(columns_in_use: int, cache_columns: int) -> int:
    """The columns a portable decode attends to: those in use rounded up to WIDTH_STEP,
    within the cache's."""
    return min(-(-columns_in_use // WIDTH_STEP) * WIDTH_STEP, cache_columns)


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
    """The fused-weight forward of `model` (already in the engine's dtype) with `kernels`
    "cpu" or "portable"; its weights in oneDNN's packed layout when `packed` (cpu
    kernels on a CPU only), else plain.

    `load(model)` updates the fused weights after the model's parameters change.
    """

    def __init__(
        self, model: PreTrainedModel, *, packed: bool = False, kernels: str = "cpu"
    ) -> None:
        reason = unsupported_reason(model.config)
        if reason:
            raise ValueError(f"the fused forward cannot run this model: {reason}")
        if kernels not in KERNELS:
            raise ValueError(f"engine kernels={kernels!r} must be one of {', '.join(KERNELS)}")
        if packed and kernels == "portable":
            raise ValueError(
                "engine.weight_layout=packed is the cpu kernels' oneDNN layout; the portable "
                "kernels run plain F.linear: set engine.weight_layout=plain (or auto)"
            )
        self.kernels = kernels
        self.keys_transposed = kernels == "cpu"  # the KV cache's K layout (kv_cache.py)
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
        self.layers: list[tuple] = []  # per layer: norms, fused weights, bias (`load`)
        self.lm_head: torch.Tensor | None = None
        self.load(model)

    @torch.inference_mode()  # so later loads may write into what the first one built
    def load(self, model: PreTrainedModel, adapter: LoraAdapter | None = None) -> None:
        """Set the fused weights from `model`'s current parameters, with `adapter` (if any)
        merged into them: each fused weight W becomes W + B A (one addmm, which
        accumulates in float32 and rounds once), `model` itself is left as it is. Plain
        weights are written into the tensors an earlier load built where shapes match;
        packed ones are packed anew. An adapter that does not fit raises before anything
        changes."""
        deltas = self._adapter_deltas(adapter)
        inner = model.model
        built = self.layers or [(None,) * 9] * self.num_layers

        def fused(
            old: torch.Tensor | None,
            parts: list[torch.Tensor],
            factors: tuple[torch.Tensor, torch.Tensor] | None = None,
        ) -> torch.Tensor:
            if self.packed:
                weight = torch.cat(parts) if len(parts) > 1 else parts[0]
                return _pack(torch.addmm(weight, *factors) if factors else weight)
            return _stack_into(old, parts, factors)

        self.embed = inner.embed_tokens.weight
        self.final_norm = inner.norm.weight
        self.lm_head = fused(self.lm_head, [model.get_output_embeddings().weight])
        layers = []
        for i, (layer, old) in enumerate(zip(inner.layers, built, strict=True)):
            attn, mlp = layer.self_attn, layer.mlp
            projections = (attn.q_proj, attn.k_proj, attn.v_proj)
            bias = None
            if attn.q_proj.bias is not None:
                bias = _stack_into(old[2], [p.bias for p in projections])
            q_norm = getattr(attn, "q_norm", None)
            k_norm = getattr(attn, "k_norm", None)
            d = deltas[i]
            layers.append(
                (
                    layer.input_layernorm.weight,
                    fused(old[1], [p.weight for p in projections], d.get("qkv")),
                    bias,
                    None if q_norm is None else q_norm.weight,
                    None if k_norm is None else k_norm.weight,
                    fused(old[5], [attn.o_proj.weight], d.get("o")),
                    layer.post_attention_layernorm.weight,
                    fused(old[7], [mlp.gate_proj.weight, mlp.up_proj.weight], d.get("gu")),
                    fused(old[8], [mlp.down_proj.weight], d.get("d")),
                )
            )
        self.layers = layers

    def weights(self) -> list[torch.Tensor]:
        """Every tensor the forward reads its weights from (some are the model's own)."""
        fixed = [self.embed, self.final_norm, self.lm_head]
        return fixed + [w for layer in self.layers for w in layer if w is not None]

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
                cache.keys[i, written_slots, :, written_columns] = k.transpose(1, 2)[rows, columns]
                cache.v[i, written_slots, :, written_columns] = v.transpose(1, 2)[rows, columns]
                keys, values = cache.keys[i, slots, :, :width], cache.v[i, slots, :, :width]
                out = F.scaled_dot_product_attention(
                    q, keys, values, attn_mask=visible, scale=1.0, enable_gqa=kv != h
                )
            else:
                cache.keys[i, slots, :, :p] = k
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
        top = int(slots.max()) + 1
        width = int(positions.max()) + 1
        if self.kernels == "portable":  # a few widths, not one per step: see WIDTH_STEP
            width = attention_width(width, cache.shape[1])
        # Every slot below `top` attends; row r of the batch is slot slots[r]. When the
        # rows are exactly slots 0..b-1 (the usual case) no scatter/gather is needed.
        in_order = top == b and bool((slots == torch.arange(b, device=slots.device)).all())
        return self._decode(cache, ids, positions, slots, top, width, in_order)

    @torch.inference_mode()
    def decode_static(
        self, cache: SlotCache, ids: torch.Tensor, positions: torch.Tensor, width: int
    ) -> torch.Tensor:
        """`decode` with row r in slot r for every slot below len(ids), attending to
        `width` columns: shapes from ints alone and no host sync, so a CUDA graph can
        record it (graphs.py). Rows of free slots are fed anything (token 0 at position
        0): their K/V land in a slot no row holds, and their logits are dropped."""
        top = ids.shape[0]
        slots = torch.arange(top, device=ids.device)
        return self._decode(cache, ids, positions, slots, top, width, in_order=True)

    def _decode(
        self,
        cache: SlotCache,
        ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        top: int,
        width: int,
        in_order: bool,
    ) -> torch.Tensor:
        b = ids.shape[0]
        h, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        columns = torch.arange(width, device=ids.device)
        limit = torch.zeros(top, dtype=torch.long, device=ids.device)
        limit[slots] = positions
        hidden = (columns[None, :] > limit[:, None])[:, None, None, :]  # (top, 1, 1, width)
        visible = hidden.logical_not()  # SDPA's boolean mask: True where a row attends
        group = h // kv  # query heads per KV head
        if not in_order:  # free slots below `top` get a zero query, their output dropped
            query = torch.zeros(top, kv, group, d, dtype=self.dtype, device=ids.device)
        cos, sin = self._rotary(positions, heads_dim=1)  # (b, h+kv, d)
        x = F.embedding(ids, self.embed)  # (B, hidden)
        for i, layer in enumerate(self.layers):
            norm1, wqkv, bqkv, _, _, wo, norm2, wgu, wd = layer
            qkv = _linear(self._norm(x, norm1), wqkv, bqkv).view(b, h + 2 * kv, d)
            q, k = self._rope(self._qk(qkv, layer, 1), cos, sin).split((h, kv), dim=1)
            cache.keys[i, slots, :, positions] = k
            cache.v[i, slots, :, positions] = qkv[:, h + kv :]
            if in_order:
                query = q.reshape(b, kv, group, d)
            else:
                query[slots] = q.reshape(b, kv, group, d)
            values = cache.v[i, :top, :, :width]
            if self.kernels == "cpu":  # K^T stored as such, so no copy of the cache
                scores = torch.matmul(query, cache.k[i, :top, :, :, :width])
                # softmax of bf16 accumulates in float32 inside the kernel.
                probs = scores.masked_fill_(hidden, -torch.inf).softmax(dim=-1)
                out = torch.matmul(probs, values)  # (top, kv, group, d)
            else:  # portable: a KV head's `group` query heads are its SDPA query rows
                out = F.scaled_dot_product_attention(
                    query, cache.keys[i, :top, :, :width], values, attn_mask=visible, scale=1.0
                )
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


def _stack_into(
    old: torch.Tensor | None,
    parts: list[torch.Tensor],
    factors: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """`parts` stacked by rows, plus B A where `factors` (B, A) are given. Written into
    `old` (slice copies, then addmm_) where it has that shape and is not one of `parts`
    (a tensor of the model, shared while no adapter changed it), else a new tensor; one
    part and no factors is that part itself."""
    if factors is None and len(parts) == 1:
        return parts[0]
    shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
    if old is None or old.shape != shape or _storage(old) in {_storage(p) for p in parts}:
        stacked = torch.cat(parts) if len(parts) > 1 else parts[0]
        return stacked if factors is None else torch.addmm(stacked, *factors)
    row = 0
    for part in parts:
        old[row : row + part.shape[0]].copy_(part)
        row += part.shape[0]
    return old if factors is None else old.addmm_(*factors)


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
