"""SlotCache and PrefixStore with K in either layout: transposed (the cpu kernels) or as
V is (the portable kernels). Everything but the cpu decode writes K through the logical
`keys` view, so every check reads back what a write left in the storage itself."""

from __future__ import annotations

import pytest
import torch

from looprl.engines.local.fused import FusedDecoder
from looprl.engines.local.kv_cache import PrefixStore, SlotCache
from tests.support.architectures import MODELS

BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # K+V, layers, kv heads, head_dim, float32


@pytest.fixture(params=["cpu", "portable"])
def decoder(request) -> FusedDecoder:
    torch.manual_seed(0)
    return FusedDecoder(MODELS["llama"]().eval(), kernels=request.param)


def test_keys_is_the_logical_view_of_the_storage(decoder):
    cache = SlotCache(decoder, budget_tokens=1000)
    cache.reserve(2, 30)
    assert cache.keys.shape == cache.v.shape == (2, 8, 2, 64, 16)
    if decoder.kernels == "cpu":
        assert cache.k.shape == (2, 8, 2, 16, 64) and cache.k.is_contiguous()
        assert torch.equal(cache.keys, cache.k.transpose(-1, -2))
    else:
        assert cache.k is cache.keys and cache.keys.is_contiguous()
    cache.keys[1, torch.tensor([3]), :, torch.tensor([5])] = 2.0  # as decode writes
    assert int((cache.k == 2.0).sum()) == 2 * 16 and (cache.keys[1, 3, :, 5] == 2.0).all()


def test_slot_cache_grows_within_budget_and_keeps_contents(decoder):
    roomy = SlotCache(decoder, budget_tokens=1000)
    roomy.reserve(2, 30)
    assert roomy.shape == (8, 64)  # rounded up: 512 tokens fit the budget
    tight = SlotCache(decoder, budget_tokens=130)
    tight.reserve(2, 30)
    assert tight.shape == (2, 64)  # columns rounded up; 8 slots would pass 130 tokens
    tight.keys[:, 1, :, 29] = 7.0
    tight.v[:, 1, :, 29] = 8.0
    tight.reserve(3, 30)
    assert tight.shape == (3, 30)  # a third row: the 2 rounding columns no longer fit
    assert (tight.keys[:, 1, :, 29] == 7.0).all() and (tight.v[:, 1, :, 29] == 8.0).all()
    assert int((tight.k == 7.0).sum()) == 2 * 2 * 16  # and nowhere else
    assert (tight.keys[:, 2] == 0).all() and (tight.v[:, 2] == 0).all()
    tight.copy_slots(torch.tensor([1]), torch.tensor([2]), 30)
    assert (tight.keys[:, 2] == tight.keys[:, 1]).all() and (tight.v[:, 2] == tight.v[:, 1]).all()
    assert int((tight.k == 7.0).sum()) == 2 * 2 * 2 * 16
    assert tight.nbytes == 3 * 30 * BYTES_PER_TOKEN
    assert tight.fits(3, 43) and not tight.fits(4, 33)

    # With no rows left the memory is kept and viewed in the next batch's shape.
    storage = tight.v.data_ptr()
    tight.clear()
    assert tight.shape == (0, 0) and tight.nbytes == 3 * 30 * BYTES_PER_TOKEN
    tight.reserve(4, 20)
    assert tight.shape == (4, 20) and tight.v.data_ptr() == storage
    assert tight.k.is_contiguous() and tight.v.is_contiguous()
    assert torch.isfinite(tight.v).all()  # masked leftovers, never NaN (0 x NaN = NaN)
    tight.release()
    assert tight.shape == (0, 0) and tight.nbytes == 0


def test_clear_releases_only_what_a_lowered_budget_no_longer_allows(decoder):
    cache = SlotCache(decoder, budget_tokens=1000)
    cache.reserve(4, 100)
    assert cache.shape == (8, 100) and cache.nbytes == 800 * BYTES_PER_TOKEN
    cache.budget_tokens = 900
    cache.clear()
    assert cache.nbytes == 800 * BYTES_PER_TOKEN  # still within the budget: kept
    cache.budget_tokens = 500
    cache.clear()
    assert cache.shape == (0, 0) and cache.nbytes == 0
    cache.reserve(5, 100)
    assert cache.shape == (5, 100) and cache.nbytes == 500 * BYTES_PER_TOKEN


def test_prefix_store_restores_what_it_saved(decoder):
    cache = SlotCache(decoder, budget_tokens=1000)
    cache.reserve(2, 40)
    cache.keys[:, 0] = torch.randn(cache.keys[:, 0].shape)
    cache.v[:, 0] = torch.randn(cache.v[:, 0].shape)
    saved_keys, saved_values = cache.keys[:, 0, :, :20].clone(), cache.v[:, 0, :, :20].clone()
    store = PrefixStore(capacity_tokens=100)
    prefix = tuple(range(20))
    store.save(prefix, cache, slot=0)
    cache.keys[:, 0] = 0.0  # the store holds a copy, not a view of the slot
    assert store.restore((*prefix, 7, 8), cache, slot=1) == 20
    assert torch.equal(cache.keys[:, 1, :, :20], saved_keys)
    assert torch.equal(cache.v[:, 1, :, :20], saved_values)
    assert (cache.keys[:, 1, :, 20:] == 0).all()
