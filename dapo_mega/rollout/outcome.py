"""What one generation round produced (`RoundOutcome`), and the error of a round that cannot
complete (`RolloutError`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List

from dapo_mega.rollout.partial import PartialGroup
from dapo_mega.rollout.samples import Group, PromptItem

__all__ = ["RolloutError", "RoundOutcome"]


class RolloutError(RuntimeError):
    """Generation cannot complete (every engine dead, retries exhausted)."""


@dataclass
class RoundOutcome:
    """What one generation round produced."""

    groups: Dict[int, Group] = field(default_factory=dict)
    """prompt index -> its finished group."""
    failures: List[str] = field(default_factory=list)
    stopped: bool = False
    """The reader stopped the round before every chunk settled."""
    unsent_chunks: List[int] = field(default_factory=list)
    unsent: List[PromptItem] = field(default_factory=list)
    """Prompts of the round never completed (never sent, or aborted in flight), in order."""
    aborted_requests: int = 0
    aborted_samples: int = 0
    """Samples of the aborted requests (never completed: no ledger rows)."""
    aborted_tokens: int = 0
    """Tokens those samples had generated when aborted (and thrown away: not kept as partials)."""
    partials: Dict[int, PartialGroup] = field(default_factory=dict)
    """prompt index -> its samples so far, of requests aborted in flight (partial rollouts)."""
    requests_by_engine: Dict[str, int] = field(default_factory=dict)
    samples_by_engine: Dict[str, int] = field(default_factory=dict)
    """url -> requests (samples) completed there in this round."""

    def missing(self, num_prompts: int) -> str:
        """Why fewer than `num_prompts` groups came back ("" when none is missing)."""
        if len(self.groups) == num_prompts:
            return ""
        return (f"{num_prompts - len(self.groups)} of {num_prompts} prompts not generated; "
                f"failures: {self.failures[-5:]}")
