"""The decoder forward of a micro-batch with each group's shared prefix computed once and
no padding between rows: a group's prompt, then every one of its rows' continuations,
packed into one sequence under a block attention mask.

Why. The samples of a GRPO group all start with the same prompt (chat template, system
prompt, question): 38 of ~75 tokens per sample in the default job. And right-padding
rows of 20-60 sampled tokens to the longest one wastes a third of the rest. In the
trainer's forward and backward every token costs the same six multiply-adds per
parameter, so these are the trainer's time. Packed, a group of rows runs as

    [prompt | continuation 1 | continuation 2 | ... ]   (one packed row per group)

where continuation i attends to the prompt and, causally, to itself only, and takes the
positions its own row would (prompt length + offset). Each token's hidden state is
then exactly what the row's own forward computes (up to float rounding), and gradients
reach the prompt from every continuation that reads it.

`pack` lays out a micro-batch: per group (`TrainBatch.group_index`) of two or more rows,
the longest prefix they all share, at most each row's length - 1, if at least
`MIN_SHARED_TOKENS`; a row that shares none is a packed row of its own (no group
sharing anything: None, the plain forward). `hidden_states`
runs the packed rows (right-padded to the longest, padding seeing only itself) and
returns the (B, T, H) hidden states of the original rows.

What it covers: decoders that take `position_ids` and a 4-D boolean attention mask
through SDPA, checked for Llama, Mistral without sliding window, Qwen2 and Qwen3
(`supports`); any other model, or another attention implementation, runs the plain
forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

MIN_SHARED_TOKENS = 16
SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")


def supports(model: nn.Module) -> bool:
    """Whether `model`'s decoder can run the packed forward."""
    cfg = model.config
    return (
        cfg.model_type in SUPPORTED
        and cfg._attn_implementation == "sdpa"
        and not getattr(cfg, "sliding_window", None)
    )


@dataclass(frozen=True)
class Packing:
    """A micro-batch of B rows laid out as R packed rows of W tokens.

    `input_ids`, `position_ids` (R, W); `mask` (R, 1, W, W) bool, True where a query
    (row 2) may attend to a key (row 3); `source` (B, T) int64: where each position of
    each original row sits in the packed rows, flattened (R * W); only real positions
    are meaningful. `computed_tokens` = R * W, `real_tokens` the tokens the packed rows
    hold (each prefix once)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    mask: torch.Tensor
    source: torch.Tensor
    real_tokens: int

    @property
    def computed_tokens(self) -> int:
        return self.input_ids.numel()


@dataclass(frozen=True)
class Segment:
    """One packed row: `prefix` tokens of row `first`, then the rest of each of `rows`."""

    first: int
    prefix: int
    rows: tuple[int, ...]


def segments(
    input_ids: torch.Tensor, lengths: list[int], group_index: torch.Tensor
) -> list[Segment]:
    """Per group of two or more rows, the longest prefix they all share (at most each
    row's length - 1) if at least MIN_SHARED_TOKENS; otherwise one segment per row."""
    out: list[Segment] = []
    for group in group_index.unique().tolist():
        members = (group_index == group).nonzero()[:, 0].tolist()
        shared = 0
        if len(members) > 1:
            same = (input_ids[members] == input_ids[members[0]]).all(dim=0).int()
            shared = min(int(same.cumprod(dim=0).sum()), min(lengths[r] for r in members) - 1)
        if shared >= MIN_SHARED_TOKENS:
            out.append(Segment(members[0], shared, tuple(members)))
        else:
            out.extend(Segment(r, 0, (r,)) for r in members)
    return out


def micro_batches(
    input_ids: torch.Tensor,
    lengths: torch.Tensor,
    group_index: torch.Tensor,
    max_tokens_per_mb: int,
) -> list[torch.Tensor]:
    """Rows (n_i,) of each micro-batch, so that each packs into at most
    `max_tokens_per_mb` tokens (packed rows x the longest): first-fit-decreasing over
    packed rows, a group whose packed row would pass the budget split into several.

    Attention memory is counted too. The block-masked attention of a packed row of W
    tokens keeps R x W x W weights per head and layer for the backward (SDPA's math
    path), where padded rows of length L in the same budget keep at most
    max_tokens_per_mb x L. So packed rows x the longest squared stays under
    max_tokens_per_mb x the batch's longest row: packing never needs more attention
    memory than padding the same rows would. (Without it, the ~40 one-call samples of a
    FrozenLake group packed into 4096-token rows needed 19 GB.)"""
    ids, sizes_of = input_ids.cpu(), lengths.cpu().tolist()
    squares = max_tokens_per_mb * max(sizes_of, default=0)  # packed rows x W^2 at most

    def fits(rows: int, width: int) -> bool:
        return rows * width <= max_tokens_per_mb and rows * width * width <= squares

    units: list[tuple[int, list[int]]] = []  # (packed size, rows)
    for seg in segments(ids, sizes_of, group_index.cpu()):
        size, rows = seg.prefix, []
        for r in seg.rows:
            rest = sizes_of[r] - seg.prefix
            if rows and not fits(1, size + rest):
                units.append((size, rows))
                size, rows = seg.prefix, []
            size, rows = size + rest, [*rows, r]
        units.append((size, rows))
    units.sort(key=lambda unit: -unit[0])
    bins: list[tuple[int, list[int]]] = []  # (longest packed row, rows), per micro-batch
    counts: list[int] = []  # packed rows per micro-batch
    for size, rows in units:
        for k, (longest, taken) in enumerate(bins):
            if fits(counts[k] + 1, longest):  # units come longest first
                taken.extend(rows)
                counts[k] += 1
                break
        else:
            bins.append((size, list(rows)))
            counts.append(1)
    return [torch.tensor(sorted(rows), dtype=torch.int64) for _, rows in bins]


def pack(
    input_ids: torch.Tensor, lengths: torch.Tensor, group_index: torch.Tensor
) -> Packing | None:
    """Lay out right-padded `input_ids` (B, T) with row `lengths` (B,) and groups
    `group_index` (B,): each group's shared prefix once, followed by its rows' rests.
    None when no group shares a prefix (the plain forward is then the same work)."""
    ids, lengths = input_ids.cpu(), lengths.cpu().tolist()
    layouts = [
        (seg.first, seg.prefix, seg.rows) for seg in segments(ids, lengths, group_index.cpu())
    ]
    if all(p == 0 for _, p, _ in layouts):
        return None
    sizes = [p + sum(lengths[r] - p for r in rows) for _, p, rows in layouts]
    count, width = len(layouts), max(sizes)
    packed = torch.zeros(count, width, dtype=torch.int64)
    positions = torch.zeros(count, width, dtype=torch.int64)
    segment = torch.full((count, width), -1, dtype=torch.int64)  # -1: prefix or padding
    source = torch.zeros(ids.shape, dtype=torch.int64)
    for k, (first, p, rows) in enumerate(layouts):
        packed[k, :p] = ids[first, :p]
        positions[k, :p] = torch.arange(p)
        at = p
        for r in rows:
            n = lengths[r] - p
            packed[k, at : at + n] = ids[r, p : lengths[r]]
            positions[k, at : at + n] = torch.arange(p, lengths[r])
            segment[k, at : at + n] = r
            source[r, :p] = k * width + torch.arange(p)
            source[r, p : lengths[r]] = k * width + torch.arange(at, at + n)
            at += n
    column = torch.arange(width)
    in_prefix = column[None, :] < torch.tensor([p for _, p, _ in layouts])[:, None]  # (R, W)
    real = column[None, :] < torch.tensor(sizes)[:, None]  # (R, W)
    causal = column[None, :] <= column[:, None]  # (W, W): query row, key column
    same_segment = segment[:, :, None] == segment[:, None, :]  # (R, W, W)
    # A real query sees the prefix (causally, from inside it) and earlier tokens of its
    # own continuation; padding sees only itself (a query with no key would give NaN).
    sees = causal & (in_prefix[:, None, :] | (same_segment & real[:, None, :]))
    sees = torch.where(real[:, :, None], sees, torch.eye(width, dtype=torch.bool))
    device = input_ids.device
    return Packing(
        packed.to(device),
        positions.to(device),
        sees[:, None].to(device),
        source.to(device),
        sum(sizes),
    )


def hidden_states(decoder: nn.Module, packing: Packing, hidden_size: int) -> torch.Tensor:
    """The decoder's last hidden states (B, T, H) of the rows `packing` laid out, at their
    real positions (padding positions hold other rows' values)."""
    hidden = decoder(
        input_ids=packing.input_ids,
        attention_mask=packing.mask,
        position_ids=packing.position_ids,
        use_cache=False,
    ).last_hidden_state  # (R, W, H)
    return hidden.reshape(-1, hidden_size)[packing.source]
