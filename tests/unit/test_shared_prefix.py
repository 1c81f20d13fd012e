"""The packed forward against the plain padded one, on each supported architecture.

Rows: group 0 shares 20 tokens over three rows (continuations of 5, 1 and 9 tokens);
group 1 two identical rows of 18 (the shared prefix stops one token short of the end);
group 2 a single row; group 3 two rows sharing 3 tokens only (too few: unshared).
"""

from __future__ import annotations

import pytest
import torch

from looprl.training import shared_prefix
from tests.support.architectures import MODELS

pytestmark = pytest.mark.kernels  # run again on a forced AVX2 CPU by make test


def rows() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids (9, 29) right-padded with 0, lengths (9,), group_index (9,)."""
    gen = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(1, 300, (n,), generator=gen).tolist()

    a, b, d = tokens(20), tokens(18), tokens(3)
    sequences = [
        (a + tokens(5), 0),
        (a + tokens(1), 0),
        (a + tokens(9), 0),
        (b, 1),
        (list(b), 1),
        (tokens(12), 2),
        (d + tokens(14), 3),
        (d + tokens(26), 3),
        (a + tokens(4), 0),
    ]
    width = max(len(s) for s, _ in sequences)
    ids = torch.zeros(len(sequences), width, dtype=torch.int64)
    for i, (s, _) in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(s)
    lengths = torch.tensor([len(s) for s, _ in sequences])
    return ids, lengths, torch.tensor([g for _, g in sequences])


def test_the_layout_shares_each_groups_prompt_once():
    ids, lengths, groups = rows()
    segments = shared_prefix.segments(ids, lengths.tolist(), groups)
    assert [(s.prefix, s.rows) for s in segments] == [
        (20, (0, 1, 2, 8)),
        (17, (3, 4)),  # 18 identical tokens, one left to each row
        (0, (5,)),
        (0, (6,)),  # 3 shared tokens < MIN_SHARED_TOKENS
        (0, (7,)),
    ]
    packing = shared_prefix.pack(ids, lengths, groups)
    # Packed rows: 20 + 5 + 1 + 9 + 4 = 39; 17 + 1 + 1 = 19; 12; 17; 29. Width 39.
    assert tuple(packing.input_ids.shape) == (5, 39)
    assert packing.real_tokens == 39 + 19 + 12 + 17 + 29
    # Row 2's continuation (9 tokens) sits at packed columns 26..34 of packed row 0, at
    # positions 20..28; it sees the prompt and itself, not rows 0 and 1's continuations.
    assert packing.source[2, 20:29].tolist() == list(range(26, 35))
    assert packing.position_ids[0, 26:35].tolist() == list(range(20, 29))
    sees = packing.mask[0, 0]
    assert sees[30, :20].all() and sees[30, 26:31].all()
    assert not sees[30, 20:26].any() and not sees[30, 31:].any()
    # Padding (packed row 2 holds 12 tokens) sees only itself; no query is left empty.
    assert sees.any(dim=1).all() and packing.mask[2, 0, 20].tolist() == [c == 20 for c in range(39)]


def test_nothing_to_share_means_no_packing():
    ids, lengths, groups = rows()
    assert shared_prefix.pack(ids[5:8], lengths[5:8], groups[5:8]) is None


@pytest.mark.parametrize("arch", MODELS)
def test_hidden_states_and_gradients_match_the_padded_forward(arch):
    torch.manual_seed(0)
    model = MODELS[arch]().double()
    assert shared_prefix.supports(model)
    ids, lengths, groups = rows()
    real = torch.arange(ids.shape[1])[None, :] < lengths[:, None]
    weights = torch.randn(*ids.shape, model.config.hidden_size, dtype=torch.float64)
    decoder = model.get_decoder()

    def gradients(hidden: torch.Tensor) -> dict[str, torch.Tensor]:
        model.zero_grad()
        (hidden * weights)[real].sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = decoder(input_ids=ids, attention_mask=real.long(), use_cache=False).last_hidden_state
    packing = shared_prefix.pack(ids, lengths, groups)
    packed = shared_prefix.hidden_states(decoder, packing, model.config.hidden_size)
    torch.testing.assert_close(packed[real], plain[real], atol=1e-6, rtol=0)
    want, got = gradients(plain), gradients(packed)
    assert want.keys() == got.keys()
    # Llama's RMSNorm computes in float32 whatever the weights: ~1e-7 of the largest.
    for name in want:
        scale = float(want[name].abs().max())
        torch.testing.assert_close(got[name], want[name], atol=1e-5 * scale, rtol=0)


def test_only_sdpa_llama_family_models_are_packed():
    model = MODELS["llama"]()
    assert shared_prefix.supports(model)
    model.config._attn_implementation = "eager"
    assert not shared_prefix.supports(model)


def test_micro_batches_pack_whole_groups_under_the_budget():
    ids, lengths, groups = rows()
    # Packed sizes, longest first: group 0 39, row 7 29, group 1 19, row 6 17, row 5 12.
    # Budget 60 (packed rows x the longest): 39 alone (2 x 39 > 60); 29 and 19 together
    # (2 x 29 = 58); 17 opens a third (3 x 29 > 60), which 12 joins (2 x 17 = 34).
    parts = shared_prefix.micro_batches(ids, lengths, groups, 60)
    assert [p.tolist() for p in parts] == [[0, 1, 2, 8], [3, 4, 7], [5, 6]]
    # A group bigger than the budget is split, each part with its prompt: 20 + 5 + 1 = 26
    # <= 30, then 20 + 9 = 29 and 20 + 4 = 24, each alone.
    group = [0, 1, 2, 8]
    split = shared_prefix.micro_batches(ids[group], lengths[group], torch.zeros(4), 30)
    assert sorted(p.tolist() for p in split) == [[0, 1], [2], [3]]


def test_packed_attention_stays_under_what_padding_would_need():
    # A FrozenLake-like group: 40 one-call samples of 110 tokens sharing 90. Padded, a
    # micro-batch of 4096 tokens keeps at most 4096 x 110 = 450,560 attention weights per
    # head and layer. Packed whole (90 + 40 x 20 = 890 tokens, under the token budget)
    # it would keep 890^2 = 792,100; so the group splits where a packed row would pass
    # sqrt(450,560) = 671 tokens: 90 + 29 x 20 = 670, then 90 + 11 x 20 = 310, and the two
    # do not share a micro-batch (2 x 670^2 > 450,560).
    prompt = list(range(1, 91))
    ids = torch.tensor([prompt + [100 + i] * 20 for i in range(40)])
    lengths = torch.full((40,), 110)
    parts = shared_prefix.micro_batches(ids, lengths, torch.zeros(40, dtype=torch.int64), 4096)
    assert [p.tolist() for p in parts] == [list(range(29)), list(range(29, 40))]
    packed = [shared_prefix.pack(ids[p], lengths[p], torch.zeros(len(p))) for p in parts]
    assert [tuple(k.input_ids.shape) for k in packed] == [(1, 670), (1, 310)]
