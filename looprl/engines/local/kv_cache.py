"""The fused forward's KV cache: `SlotCache`, preallocated K/V slots of the running
sequences, and `PrefixStore`, K/V of prefixes computed earlier, for reuse.

A sequence owns one slot from admission to finish, and its token at position p lives at
column p. Slots and columns grow on demand (rounded up, never past the budget the
engine checks with `fits`); the memory is kept for the next batch unless a lowered
budget no longer allows it. Decode attends from every slot up to the highest in use,
each row masked to its own length.

Two layouts of K, chosen by the decoder's kernels (`FusedDecoder.keys_transposed`):
the cpu kernels store K transposed, (layers, slots, kv_heads, head_dim, T), for their
batched-matmul decode; the portable kernels store it as V is, (layers, slots,
kv_heads, T, head_dim), the layout scaled_dot_product_attention reads. `keys` is the
logical (layers, slots, kv_heads, T, head_dim) view of K in both layouts (a transposed
view of the cpu storage): everything but the cpu decode reads and writes K through it,
so this module, the prefix store and prefill are the same code for both.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from looprl.engines.local.fused import FusedDecoder

_SLOT_ROUND, _COLUMN_ROUND = 8, 64


class SlotCache:
    """K and V of the running sequences, one tensor each for all layers.

    V is (layers, slots, kv_heads, T, head_dim); K is that too (`keys`), stored
    transposed for the cpu kernels (`k`: (layers, slots, kv_heads, head_dim, T)). Decode
    reads only the first `width` columns (at decode the cache read is as large as the
    weights', both memory-bound). In bf16, bmm copies such a column slice first (its
    batch stride is not width x head_dim), ~15% of a decode step at 64 rows; attending
    over every column instead, with the columns grown as sequences lengthen, saved that
    but lost it again to the copies each growth makes, so the columns are reserved up
    front. (With K as (T, head_dim) the cpu decode's sliced transpose cost more: ~1.7x
    slower, `bench/engine_choices.py`.)

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
        self.v = v.view(*outer, columns, d.head_dim)
        if d.keys_transposed:
            self.k = k.view(*outer, d.head_dim, columns)
            self.keys = self.k.transpose(-1, -2)
        else:
            self.k = self.keys = k.view(*outer, columns, d.head_dim)

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
        old_keys, old_v = self.keys, self.v
        d = self._decoder
        numel = d.num_layers * slots * d.num_kv_heads * d.head_dim * columns
        if old_v.numel() or numel > self._storage[0].numel():
            # zeros: V must be finite where no token was written (0 x NaN is NaN)
            self._storage = tuple(
                torch.zeros(numel, dtype=d.dtype, device=d.device) for _ in range(2)
            )
        self._view(slots, columns)
        kept_slots, kept_columns = min(slots, have_slots), min(columns, have_columns)
        self.keys[:, :kept_slots, :, :kept_columns] = old_keys[:, :kept_slots, :, :kept_columns]
        self.v[:, :kept_slots, :, :kept_columns] = old_v[:, :kept_slots, :, :kept_columns]

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor, columns: int) -> None:
        """Copy the first `columns` of slots `src` into slots `dst` (pairwise)."""
        self.keys[:, dst, :, :columns] = self.keys[:, src, :, :columns]
        self.v[:, dst, :, :columns] = self.v[:, src, :, :columns]

    def clear(self) -> None:
        """No rows hold K/V any more: shape (0, 0). The memory is kept for the next batch,
        unless it is more than the budget allows (lowered since it was allocated): then
        it is released."""
        d = self._decoder
        allowed = d.num_layers * d.num_kv_heads * d.head_dim * self.budget_tokens
        if self._storage[0].numel() > allowed:
            self.release()
        self._view(0, 0)

    def release(self) -> None:
        """Free the memory (no rows may hold K/V)."""
        self._storage = tuple(s[:0].clone() for s in self._storage)
        self._view(0, 0)


class PrefixStore:
    """K/V of token sequences computed earlier, for new sequences that start the same way.

    Entries are the shared prefix of a prefill batch (a system prompt, a few-shot
    preamble) and every finished sequence (a multi-turn session's next prompt extends
    its previous one). A new sequence takes the longest match among entries, as long
    as at least `min_tokens` match, and its prefill starts after it. Entries are
    evicted least recently used beyond `capacity_tokens`; an entry that is a prefix of
    a newer one is dropped, the newer one serving both. K/V computed under old weights
    are useless, so the runner clears the store on every weight update. Entries hold
    K as the cache's logical view, (layers, kv_heads, n, head_dim), whatever its layout.
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
        keys, values = self._entries[key]
        self._entries.move_to_end(key)
        cache.keys[:, slot, :, :length] = keys[:, :, :length]
        cache.v[:, slot, :, :length] = values[:, :, :length]
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
            cache.keys[:, slot, :, :n].clone(),
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
