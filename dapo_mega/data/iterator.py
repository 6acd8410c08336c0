"""Deterministic, resumable iteration over training prompts.

Epoch e visits every problem once, in the order `permutation(seed, e)` (or file order
when shuffle is off). The cursor (epoch, position) is the whole state: a run resumed from
`state_dict()` continues with exactly the prompts the uninterrupted run would have seen.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, TypedDict

import numpy as np

from dapo_mega.data.problem import DataError, Problem


class PromptCursor(TypedDict):
    """A `PromptIterator`'s saved state: the cursor (epoch, position) and what it must match
    on resume (dataset size and revision, seed, shuffle)."""

    epoch: int
    position: int
    seed: int
    shuffle: bool
    num_problems: int
    revision: Optional[str]


class PromptIterator:
    """Batches of problems, epoch after epoch, with a seed-based per-epoch shuffle.

    Args:
        problems: the training set (non-empty).
        seed: shuffle seed (data.seed).
        shuffle: reshuffle each epoch; False keeps the given order.
        revision: dataset revision; a saved state only loads into an iterator over the
            same revision (resuming on different data would silently change the run).
    """

    def __init__(self, problems: Sequence[Problem], seed: int = 0, shuffle: bool = True,
                 revision: Optional[str] = None):
        if not problems:
            raise DataError("PromptIterator: the dataset is empty")
        self.problems = list(problems)
        self.seed = int(seed)
        self.shuffle = shuffle
        self.revision = revision
        self.epoch = 0
        self.position = 0
        self._order: Optional[np.ndarray] = None
        self._order_epoch = -1

    def __len__(self) -> int:
        return len(self.problems)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if self._order_epoch != epoch:
            n = len(self.problems)
            # the generator is seeded by (seed, epoch): any epoch's order can be rebuilt alone
            self._order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
            self._order_epoch = epoch
        return self._order  # type: ignore[return-value]

    def next_batch(self, n: int) -> List[Problem]:
        """The next n problems; a batch that crosses the end of an epoch continues into the
        next epoch's order (so n may exceed the dataset size)."""
        if n < 0:
            raise ValueError(f"batch size must be >= 0, got {n}")
        batch: List[Problem] = []
        while len(batch) < n:
            order = self._epoch_order(self.epoch)
            take = min(n - len(batch), len(order) - self.position)
            batch.extend(self.problems[i] for i in order[self.position:self.position + take])
            self.position += take
            if self.position == len(order):
                self.epoch += 1
                self.position = 0
        return batch

    def state_dict(self) -> PromptCursor:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "shuffle": self.shuffle,
                "num_problems": len(self.problems), "revision": self.revision}

    def load_state_dict(self, state: PromptCursor) -> None:
        """Restore a cursor saved by `state_dict` (same data, seed and shuffle, or DataError)."""
        for key, mine in (("num_problems", len(self.problems)), ("seed", self.seed), ("shuffle", self.shuffle),
                          ("revision", self.revision)):
            if state.get(key) != mine:
                raise DataError(f"cannot resume the prompt iterator: saved {key}={state.get(key)!r} but this run "
                                f"has {mine!r}; resume with the same dataset and data.seed/shuffle")
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < len(self.problems):
            raise DataError(f"cannot resume the prompt iterator: cursor (epoch={epoch}, position={position}) "
                            f"is outside a dataset of {len(self.problems)}")
        self.epoch, self.position = epoch, position
