"""Held-out split: deterministic, disjoint from the training order, exactly-once over the rest."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftlm.data.loader import GlobalOrder, Loader, PackedDataset
from ftlm.data.split import SampleComplement, heldout_indices, split_heldout
from ftlm.errors import DataError


class IndexDataset:
    """Sample i is the row [i, i]: a batch reveals which dataset samples it holds."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def samples(self, indices) -> np.ndarray:
        idx = np.asarray(indices, dtype=np.int64)
        if len(idx) and (idx.min() < 0 or idx.max() >= self.n):
            raise IndexError("out of range")
        return np.stack([idx, idx], axis=1)


def test_heldout_is_a_pure_function_of_size_count_and_seed() -> None:
    a = heldout_indices(1000, 50, seed=0)
    assert np.array_equal(a, heldout_indices(1000, 50, seed=0))  # every group computes the same
    assert a.dtype == np.int64 and len(a) == 50 and len(set(a.tolist())) == 50
    assert a.min() >= 0 and a.max() < 1000
    assert not np.array_equal(np.sort(a), np.sort(heldout_indices(1000, 50, seed=1)))
    assert not np.array_equal(a, np.sort(a)), "held-out order should be seeded, not sorted"
    assert np.array_equal(heldout_indices(1000, 0, seed=0), np.empty(0, dtype=np.int64))


def test_training_order_never_reaches_a_heldout_sample_and_covers_the_rest_once() -> None:
    ds = IndexDataset(500)
    split = split_heldout(ds, 40, seed=7)
    held = set(split.heldout.samples(np.arange(40))[:, 0].tolist())
    assert held == set(heldout_indices(500, 40, 7).tolist())
    assert len(split.train) == 460
    with Loader(split.train, seed=3, prefetch=2) as loader:
        # Two epochs of the training order in steps of 3 participants x 5 samples.
        seen = []
        for cursor in range(0, 2 * 460, 15):
            for i in range(3):
                seen += loader.batch(cursor, i, 3, 5)[:, 0].tolist()
    seen = seen[:2 * 460]
    assert not held & set(seen)
    for epoch in (seen[:460], seen[460:]):
        assert sorted(epoch) == sorted(set(range(500)) - held), "each epoch: every sample once"


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 300), data=st.data())
def test_complement_maps_training_indices_in_dataset_order(n: int, data) -> None:
    excluded = data.draw(st.lists(st.integers(0, n - 1), unique=True, max_size=n - 1))
    view = SampleComplement(IndexDataset(n), np.array(excluded, dtype=np.int64))
    expected = np.setdiff1d(np.arange(n), np.array(excluded, dtype=np.int64))
    assert len(view) == len(expected)
    np.testing.assert_array_equal(view.dataset_indices(np.arange(len(view))), expected)
    np.testing.assert_array_equal(view.samples(np.arange(len(view)))[:, 0], expected)
    with pytest.raises(IndexError):
        view.samples([len(view)])


def test_no_heldout_leaves_the_dataset_as_it_is() -> None:
    ds = IndexDataset(100)
    split = split_heldout(ds, 0, seed=0)
    assert len(split.train) == 100 and len(split.heldout) == 0
    np.testing.assert_array_equal(split.train.samples(np.arange(100))[:, 0], np.arange(100))


def test_holding_out_everything_names_the_field_and_the_fix() -> None:
    with pytest.raises(DataError, match=r"data\.eval_samples=100 leaves no training samples.*100"):
        split_heldout(IndexDataset(100), 100, seed=0)


def test_split_of_prepared_data_reads_the_right_rows(demo_data: Path) -> None:
    ds = PackedDataset(demo_data, 64)
    split = split_heldout(ds, 32, seed=0)
    held = heldout_indices(len(ds), 32, 0)
    np.testing.assert_array_equal(split.heldout.samples(np.arange(32)), ds.samples(held))
    order = GlobalOrder(len(split.train), seed=0)
    first = order.indices(0, 64)
    np.testing.assert_array_equal(split.train.samples(first),
                                  ds.samples(split.train.dataset_indices(first)))
    assert not set(split.train.dataset_indices(order.indices(0, len(split.train))).tolist()) \
        & set(held.tolist())
