"""Small typed records for the driver's unit tests (no engine needed)."""

from dataclasses import dataclass
from typing import List, Optional

from dapo_mega.reward import SampleReward
from dapo_mega.rollout.samples import Group, ScoredSample


@dataclass
class Prompt:
    id: str
    prompt: str
    ground_truth: str = "46"
    dataset_revision: str = "rev"


def sample(pid: str, k: int, tokens: List[int], reward: float = 0.0, version: int = 0, truncated: bool = False,
           logprobs: Optional[List[float]] = None, reason: str = "kept", seed: Optional[int] = 7) -> ScoredSample:
    return ScoredSample(prompt_id=pid, sample_index=k, token_ids=list(tokens),
                        logprobs=logprobs if logprobs is not None else [-0.5] * len(tokens),
                        weight_versions=[{"version": str(version), "start": 0, "end": len(tokens)}],
                        response_text=" 46\n", truncated=truncated, seed=seed, engine_id="http://127.0.0.1:1",
                        queue_delay_s=0.1, generation_latency_s=0.2, score=SampleReward(reward, reward > 0),
                        reject_reason=reason)


def group(pid: str, rewards: List[float], version: int = 0, prompt_input: Optional[List[int]] = None,
          truncated: Optional[List[bool]] = None) -> Group:
    truncated = truncated or [False] * len(rewards)
    return Group(prompt=Prompt(pid, f"prompt {pid}"), prompt_input=prompt_input or [1, 2, 3],
                 samples=[sample(pid, k, [10 + k, 11], r, version, truncated[k]) for k, r in enumerate(rewards)],
                 engine_id="http://127.0.0.1:1", queue_delay_s=0.1, latency_s=0.2)
