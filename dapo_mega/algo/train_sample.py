"""The record the driver hands the learner: one sampled response, its advantage and masks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

__all__ = ["TrainSample"]


@dataclass
class TrainSample:
    """One sampled response to a prompt, as the trainer hands it to the learner."""

    prompt_ids: List[int]
    response_ids: List[int]
    advantage: float = 0.0
    old_log_probs: Optional[List[float]] = None
    """Learner log-probs of the response tokens under the old policy (filled by train_step)."""
    engine_log_probs: Optional[List[float]] = None
    """Log-probs the rollout engine reported while sampling (for TIS / use_engine_logprobs)."""
    loss_mask: Optional[List[int]] = None
    """Per response token, 1 = carries loss (default all 1; overlong filtering zeroes it)."""
    routed_experts: Optional[str] = None
    """A mixture of experts: the experts the engine routed each token to, as SGLang reports them
    (base64 of int32 [prompt + response - 1, num_hidden_layers, top_k]; None when not reported);
    `backends.megatron.routing` reads it."""
    age: int = 0
    """Policy versions between the oldest weights that sampled it and the learner that trains
    on it (`ScoredSample.age`): the age bucket of its log-prob mismatch (algo/mismatch.py)."""

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    def response_loss_mask(self) -> List[int]:
        return list(self.loss_mask) if self.loss_mask is not None else [1] * len(self.response_ids)
