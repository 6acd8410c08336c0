"""Which colocated engines hold their memory: the driver's ledger of releases and resumes.

A colocated engine frees its weights and KV cache for the learner's step and takes them back
after. The libraries behind that forgive nothing:

* torch_memory_saver exits the engine's process on a second pause of a tag ("Cannot pause
  allocation that is not active", `exit(1)` in its `core.cpp`);
* SGLang 0.5.23's scheduler raises on a resume of a tag it did not release
  (`offload_tags.remove(tag)` in `weight_updater.py`), and the server dies of it;
* an update written while the weights are paused lands in unmapped pages.

So the driver keeps, per engine URL, whether it released the engine and which process it
released (its incarnation: the pid and start the engines role announced in the registry,
`engines.process.engine_incarnations`). A release goes only to engines holding their memory, a
resume only to engines it released, and an engine whose process changed since (restarted at
its address while the learner trained) is neither: its new process holds its memory already,
so it is named as restarted and rejoins the weight sync like any engine found dead and back.
An engine dropped as dead keeps its entry (a hung engine may have been released by the probe
of `weights/handover.py`); if it answers again as the same process it is resumed before any
weights are written into it.

Where no incarnation is known (engines attached by URL, started by someone else), a restart
cannot be told from the same process: the ledger takes them as the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple


@dataclass
class EngineMemory:
    """The ledger (see the module docstring). Pure: it decides, the syncer sends."""

    released: Dict[str, Optional[str]] = field(default_factory=dict)
    """Engine url -> its incarnation when it was released (None: unknown)."""
    lent: bool = False
    """Between the release for a learner's step and the resume after it."""

    def to_release(self, urls: Sequence[str]) -> List[str]:
        """Of `urls`, those holding their memory (a second pause would end them)."""
        return [u for u in urls if u not in self.released]

    def mark_released(self, urls: Sequence[str], incarnations: Mapping[str, str]) -> None:
        for url in urls:
            self.released[url] = incarnations.get(url)

    def restarted(self, urls: Sequence[str], incarnations: Mapping[str, str]) -> List[str]:
        """Of `urls`, those released whose process is not the one released (both known)."""
        return [u for u in urls if u in self.released and self.released[u] is not None
                and incarnations.get(u) is not None and incarnations[u] != self.released[u]]

    def to_resume(self, urls: Sequence[str], incarnations: Mapping[str, str]) -> Tuple[List[str], List[str]]:
        """(engines of `urls` to resume: released, the same process; engines restarted since
        their release: not resumed, their new process holds its memory)."""
        restarted = self.restarted(urls, incarnations)
        return [u for u in urls if u in self.released and u not in restarted], restarted

    def forget(self, urls: Sequence[str]) -> None:
        """These engines hold their memory (resumed, or a new process) or are gone with it."""
        for url in urls:
            self.released.pop(url, None)
