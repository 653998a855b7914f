"""One-process pieces of trainer/weight_sync.py's faster paths: the alternative column-sum
reduction gives the checksum's exact bits, and the gather mode's size split."""

from __future__ import annotations

import pytest
import torch

import trainer.weight_sync as ws
from trainer.weight_sync import (CHECKSUM_PERIOD, CHECKSUM_WIDE_FOLD, FLAT_GATHER_MAX_BYTES, WeightSyncer, column_sums,
                                 column_sums_wide, gather_full_tensors, takes_flat_path, tensor_words, weights_checksum)

P, K = CHECKSUM_PERIOD, CHECKSUM_WIDE_FOLD


@pytest.mark.parametrize("n", [0, 1, P - 1, P, P + 5, P * K - 1, P * K, P * K + 1, 3 * P * K + 2 * P + 17, 1_000_003])
def test_column_sums_wide_equals_column_sums_on_random_words(n):
    g = torch.Generator().manual_seed(n)
    words = torch.randint(-2 ** 31, 2 ** 31 - 1, (n,), dtype=torch.int32, generator=g)
    want, got = column_sums(words), column_sums_wide(words)
    assert got.dtype == want.dtype == torch.int32 and got.shape == (P,)
    assert torch.equal(got, want)


def test_column_sums_wide_wraps_like_column_sums():
    """Sums that overflow int32 wrap modulo 2^32 in both (every word the maximum)."""
    words = torch.full((2 * P * K + 3,), 2 ** 31 - 1, dtype=torch.int32)
    assert torch.equal(column_sums_wide(words), column_sums(words))
    assert int(column_sums(words)[0]) == ((2 * K + 1) * (2 ** 31 - 1) + 2 ** 31) % 2 ** 32 - 2 ** 31


def test_checksum_with_the_wide_reduction_is_the_same_digest():
    g = torch.Generator().manual_seed(0)
    named = [("a", torch.randn(P * K + 999, generator=g)), ("b", torch.randn(300, 700, generator=g).bfloat16()),
             ("c", torch.randn(3, generator=g).half()), ("d", torch.randn(2 * P * K, generator=g))]
    assert weights_checksum(named, column_sums_wide) == weights_checksum(named)
    changed = [(n, t.clone()) for n, t in named]
    changed[0][1][P * K + 5] += 1.0  # an element in the remainder past the wide rows
    assert weights_checksum(changed, column_sums_wide) != weights_checksum(named)
    assert tensor_words(named[1][1]).numel() == 300 * 700 // 2


def test_flat_path_split_both_sides():
    below, at = FLAT_GATHER_MAX_BYTES - 1, FLAT_GATHER_MAX_BYTES
    assert takes_flat_path(below, "auto") and not takes_flat_path(at, "auto")
    assert takes_flat_path(at, "flat") and takes_flat_path(10 * at, "flat")
    assert not takes_flat_path(1, "per_tensor")
    # at Qwen-Image shape: a 3072 x 3072 bf16 weight gathers on its own, a rank-64 LoRA A (fp32 master
    # cast to bf16) and a bias go flat
    assert not takes_flat_path(3072 * 3072 * 2, "auto")
    assert takes_flat_path(64 * 3072 * 2, "auto") and takes_flat_path(3072 * 2, "auto")
    with pytest.raises(ValueError, match="gather mode"):
        takes_flat_path(1, "bucketed")


def test_gather_mode_is_checked_and_plain_tensors_pass_through():
    t = torch.randn(4, 3)
    for mode in ws.GATHER_MODES:
        assert gather_full_tensors([t], [None], mode)[0].data_ptr() == t.data_ptr()  # no copy
        assert torch.equal(gather_full_tensors([t], [torch.bfloat16], mode)[0], t.bfloat16())
    with pytest.raises(ValueError, match="gather mode"):
        gather_full_tensors([t], [None], "bucketed")
    with pytest.raises(ValueError, match="gather_mode"):
        WeightSyncer("full", gather_mode="bucketed")
    assert WeightSyncer("full", gather_mode="per_tensor").gather_mode == "per_tensor"
    assert ws.DEFAULT_GATHER_MODE == "auto"
