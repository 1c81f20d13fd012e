"""plan_buckets: how a state dict is cut into one-dtype buckets, sizes computed by hand."""

from __future__ import annotations

import pytest
import torch

from looprl.scheduling.weight_broadcast import Bucket, plan_buckets

F32, BF16 = torch.float32, torch.bfloat16


def _names(buckets: list[Bucket]) -> list[list[str]]:
    return [[name for name, _ in bucket.tensors] for bucket in buckets]


def test_tensors_fill_a_bucket_up_to_exactly_its_size_in_order():
    specs = [
        ("a", (2, 3), F32),  # 24 bytes
        ("b", (4,), F32),  # 16: a + b = 40, exactly the bucket
        ("c", (1,), F32),  # 4: would make 44
        ("d", (2, 2), F32),  # 16: c + d = 20
    ]
    buckets = plan_buckets(specs, bucket_bytes=40)
    assert _names(buckets) == [["a", "b"], ["c", "d"]]
    assert [b.nbytes for b in buckets] == [40, 20]
    assert [b.numel for b in buckets] == [10, 5]
    assert buckets[0] == Bucket(F32, (("a", (2, 3)), ("b", (4,))))


def test_a_dtype_change_starts_a_bucket_and_order_is_kept():
    specs = [
        ("a", (3,), F32),  # 12 bytes
        ("b", (3,), BF16),  # 6
        ("c", (5,), BF16),  # 10: b + c = 16
        ("d", (1,), F32),  # 4: fits beside a by size, but comes after b and c
    ]
    buckets = plan_buckets(specs, bucket_bytes=100)
    assert _names(buckets) == [["a"], ["b", "c"], ["d"]]
    assert [b.dtype for b in buckets] == [F32, BF16, F32]
    assert [b.nbytes for b in buckets] == [12, 16, 4]


def test_a_tensor_bigger_than_a_bucket_gets_its_own():
    specs = [
        ("small", (2,), F32),  # 8 bytes
        ("big", (10, 10), F32),  # 400 > 32
        ("after", (3,), F32),  # 12
        ("last", (5,), F32),  # 20: after + last = 32
    ]
    buckets = plan_buckets(specs, bucket_bytes=32)
    assert _names(buckets) == [["small"], ["big"], ["after", "last"]]
    assert [b.nbytes for b in buckets] == [8, 400, 32]


def test_scalars_and_empty_specs():
    assert plan_buckets([], bucket_bytes=8) == []
    buckets = plan_buckets([("step", (), torch.int64), ("x", (1,), torch.int64)], 16)
    assert _names(buckets) == [["step", "x"]]
    assert buckets[0].nbytes == 16


def test_a_bucket_size_below_one_byte_is_refused():
    with pytest.raises(ValueError, match="bucket_bytes=0"):
        plan_buckets([("a", (1,), F32)], bucket_bytes=0)


def test_views_cut_a_flat_buffer_into_the_bucket_tensors():
    bucket = Bucket(F32, (("a", (2, 3)), ("b", ()), ("c", (2,))))
    buffer = torch.arange(12, dtype=F32)  # longer than the bucket's 9: a reused buffer
    views = bucket.views(buffer)
    assert list(views) == ["a", "b", "c"]
    assert views["a"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert views["b"].item() == 6
    assert views["c"].tolist() == [7, 8]
    views["c"].fill_(-1)  # views, not copies
    assert buffer[7:9].tolist() == [-1, -1]
