"""The held-out split: samples the trainer never sees, kept for the eval loss.

``heldout_indices(num_samples, count, seed)`` is a pure function: a seeded choice of ``count``
sample indices out of ``num_samples``, in a seeded order. Every group that opens the same dataset
with the same ``data.eval_samples`` and ``data.eval_seed`` computes the same held-out set, so no
group has to tell another which samples it holds out.

``split_heldout`` wraps a dataset in two views that satisfy the loader's ``SampleSource``:

* ``train``: the other samples, renumbered ``0 .. N - count - 1`` in dataset order. The loader's
  global order (``GlobalOrder``) and therefore the cursor and exactly-once accounting
  (docs/design.md, 'Data exactly once') range over these indices only, so a held-out sample is never
  trained.
* ``heldout``: the held-out samples, ``0 .. count - 1`` in the seeded order, so that the first
  ``k`` of them are a random subset (the evaluator reads a prefix).

The mapping from a training index to a dataset index costs ``O(count)`` memory, not ``O(N)``.
This module does not read files (``loader.PackedDataset``) or compute losses
(``ftlm.train.evaluate``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ftlm.errors import DataError

if TYPE_CHECKING:  # the loader imports torch; this module needs only numpy
    from ftlm.data.loader import SampleSource

_SALT = 0x65766C  # keeps the held-out draw apart from GlobalOrder's streams of the same seed


def heldout_indices(num_samples: int, count: int, seed: int) -> np.ndarray:
    """Dataset indices of the ``count`` held-out samples (distinct, in a seeded order)."""
    if count < 0 or seed < 0:
        raise ValueError(f"count={count} and seed={seed} must be non-negative")
    if count >= num_samples:
        raise DataError(f"data.eval_samples={count} leaves no training samples: the dataset has "
                        f"{num_samples}; lower data.eval_samples below {num_samples}")
    rng = np.random.default_rng([seed, _SALT])
    return rng.choice(num_samples, size=count, replace=False).astype(np.int64)


class SampleSubset:
    """The samples of ``source`` at ``indices``, numbered ``0 .. len(indices) - 1``."""

    def __init__(self, source: SampleSource, indices: np.ndarray) -> None:
        self.source = source
        self.indices = np.asarray(indices, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.indices)

    def samples(self, indices) -> np.ndarray:
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if len(idx) and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"sample indices must lie in [0, {len(self)})")
        return self.source.samples(self.indices[idx])


class SampleComplement:
    """The samples of ``source`` *not* at ``excluded``, numbered in dataset order.

    Training index ``j`` is the ``j``-th dataset index that is not excluded. With the excluded
    indices sorted as ``h_0 < h_1 < ...``, exactly those ``h_i`` with ``h_i - i <= j`` lie below
    it, so it is ``j + #{i : h_i - i <= j}``: one binary search over ``h_i - i``.
    """

    def __init__(self, source: SampleSource, excluded: np.ndarray) -> None:
        self.source = source
        held = np.sort(np.asarray(excluded, dtype=np.int64))
        self._shifted = held - np.arange(len(held), dtype=np.int64)  # non-decreasing
        self._len = len(source) - len(held)

    def __len__(self) -> int:
        return self._len

    def dataset_indices(self, indices) -> np.ndarray:
        """Dataset indices of training indices ``indices``."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if len(idx) and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"sample indices must lie in [0, {len(self)})")
        return idx + np.searchsorted(self._shifted, idx, side="right")

    def samples(self, indices) -> np.ndarray:
        return self.source.samples(self.dataset_indices(indices))


@dataclass(frozen=True)
class HeldOutSplit:
    """A dataset cut into the samples the trainer may see and those it must not."""

    train: SampleComplement
    """What the loader reads: every sample except the held-out ones."""
    heldout: SampleSubset
    """What the evaluator reads: the held-out samples in their seeded order."""


def split_heldout(dataset: SampleSource, count: int, seed: int) -> HeldOutSplit:
    """Hold ``count`` samples of ``dataset`` out of training (see the module docstring)."""
    held = heldout_indices(len(dataset), count, seed)
    return HeldOutSplit(train=SampleComplement(dataset, held), heldout=SampleSubset(dataset, held))
