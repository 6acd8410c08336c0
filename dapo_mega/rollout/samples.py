"""Typed records of generated samples: from the engine's reply to the ledger and the learner.

A `ScoredSample` is made once, from one sample of a `/generate` reply, and keeps the
names of the reply (`token_ids`, `logprobs`, `weight_versions`) and of the ledger
(`seed`, `engine_id`, `queue_delay_s`, `generation_latency_s`, `truncated`,
`response_text`, `reward`, `correct`, `reject_reason`, ...). Scoring adds its typed
`SampleReward`; dynamic sampling sets `reject_reason`; the consumer stamps `step` and
`learner_version`. The ledger row (`records.ledger.ledger_record`) and the learner's
`TrainSample` (`driver.advantages`) are read off it field by field.

A `Group` is the G samples of one prompt, with the prompt item and the input ids the
engine was given (the learner trains on the same ids).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Protocol, Sequence, Tuple

from dapo_mega.reward.types import UNSCORED, SampleReward

if TYPE_CHECKING:  # annotations only: the client brings aiohttp, which a ledger reader does not need
    from dapo_mega.engines.sglang.client import PromptInput, SampleResult, WeightVersionSpan


class PromptItem(Protocol):
    """A prompt the rollout generates for: an id (the ledger's `prompt_id`) and its text.
    `data.Problem` is one; a `PromptEncoding` turns it into what the engine is given."""

    @property
    def id(self) -> str: ...

    @property
    def prompt(self) -> str: ...


class PromptEncoding(Protocol):
    """What turns a prompt item into the engine's input (`data.PromptEncoder`: token ids)."""

    def encode(self, prompt: PromptItem) -> "PromptInput": ...


class PromptDecoding(Protocol):
    """What makes a prompt item again from the plain data a checkpoint stored of it (`plain_prompt`)."""

    def decode(self, plain: Dict[str, Any]) -> PromptItem: ...


class TextPrompts:
    """Prompt items sent as their text (no tokenizer at hand)."""

    @staticmethod
    def encode(prompt: PromptItem) -> "PromptInput":
        return prompt.prompt


def parse_version(version: object) -> int:
    """Engine weight versions are strings; ours are integers ("default" = 0)."""
    try:
        return int(str(version))
    except ValueError:
        return 0


TRAINED_REASONS = ("kept", "verifier_error")
"""Reject reasons of samples the learner trains on (a verifier error scores -1 inside a kept group)."""

@dataclass
class ScoredSample:
    """One generated response, its provenance, its reward and its fate."""

    prompt_id: str
    sample_index: int
    """Index of the sample within its prompt's group (the engine's `index` % n)."""
    token_ids: List[int]
    """Every generated token, a matched stop token included: what the learner trains on."""
    logprobs: Optional[List[float]]
    """[len(token_ids)] log p(token) under the engine's sampling distribution, or None."""
    weight_versions: List[WeightVersionSpan]
    """The engine's `{"version", "start", "end"}` spans over token_ids."""
    response_text: str
    truncated: bool
    """Stopped by the length limit (finish_reason "length")."""
    seed: Optional[int]
    """`sampling_seed` of the request that produced it (the embedded engine seeds sample j
    with seed + j); None when the run sets no seed."""
    engine_id: str
    queue_delay_s: float
    """Seconds from the start of the generation round to the request's start."""
    generation_latency_s: float
    routed_experts: Optional[str] = None
    """A mixture of experts: the engine's `meta_info.routed_experts` ([positions,
    num_hidden_layers, top_k] over the prompt and response but the last token), when asked for,
    compacted (`compact_routed_experts`)."""
    gen_round: int = 0
    """Dynamic-sampling round of its step that generated it."""
    dataset_revision: str = ""
    prompt_text: str = ""
    score: SampleReward = UNSCORED
    reject_reason: str = "kept"
    """kept, or why the learner does not train on it (records.ledger.REJECT_REASONS)."""
    step: int = 0
    """Step that consumed or rejected it."""
    learner_version: int = 0
    """Policy version of the learner that consumed or rejected it."""
    turns: int = 1
    """The model's turns (rollout/turns.py), each counted from its request on (a partial rollout
    cut before or within a turn resumes that turn): 1 without an environment."""
    env_spans: List[List[int]] = field(default_factory=list)
    """[start, end) of each environment answer in token_ids: in the context, masked from the
    loss, log-prob 0.0."""
    tool_calls: int = 0
    tool_errors: Dict[str, int] = field(default_factory=dict)
    """The environment's errors by kind (the sandbox's statuses: timeout, memory, ...)."""
    tool_time_s: float = 0.0
    tool_log: List[Dict[str, Any]] = field(default_factory=list)
    """Every call of the episode, in order: the environment's record of it (`StepResult.calls`)
    and the model's turn that made it (`turn`, from 1)."""
    turn_rewards: List[float] = field(default_factory=list)
    """One per environment answer: the sum of its reward parts (0.0 where it gave none; not for an
    answer that only ends the episode, with no call and no reward: a final answer). Folded
    into one reward by rollout.turn_reward (`rollout.turns.fold_turn_rewards`) and added to the
    verifier's when the sample is scored."""
    turn_text_at: int = 0
    """Where in response_text the model's latest turn begins (what the environment reads)."""
    tool_pending: bool = False
    """Its latest turn ended at the environment's stop string with turns and budget left: the
    environment's answer is still to come (rollout/turns.py). A partial rollout cut there stays
    open and the environment answers first when it resumes; a sample closed with it set lost its
    tool call (`rollout/closed_with_pending_tool`, 0 when the rollout is right)."""

    @property
    def response_length(self) -> int:
        return len(self.token_ids)

    @property
    def env_tokens(self) -> int:
        return sum(end - start for start, end in self.env_spans)

    def env_mask(self) -> Optional[List[int]]:
        """Per response token 1, or 0 where the environment wrote it; None without environment tokens."""
        if not self.env_spans:
            return None
        mask = [1] * len(self.token_ids)
        for start, end in self.env_spans:
            mask[start:end] = [0] * (end - start)
        return mask

    @property
    def reward(self) -> float:
        return self.score.reward

    @property
    def correct(self) -> Optional[bool]:
        """The verdict; None when the reward gave none."""
        return self.score.correct

    @property
    def policy_version_min(self) -> int:
        """Oldest weight version that produced a token of it (0 when the engine gave none)."""
        return min(self._versions())

    @property
    def policy_version_max(self) -> int:
        return max(self._versions())

    @property
    def age(self) -> int:
        """Versions between the oldest token and the learner that consumed it."""
        return self.learner_version - self.policy_version_min

    def _versions(self) -> List[int]:
        return [parse_version(span["version"]) for span in self.weight_versions] or [0]

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "ScoredSample":
        return cls(**{**d, "score": SampleReward(**d["score"])})


@dataclass
class Group:
    """The G samples of one prompt, with where and when they were generated."""

    prompt: PromptItem
    """The prompt item (an object with `.id` and `.prompt`, e.g. data.Problem)."""
    prompt_input: PromptInput
    """What the engine was given for it (token ids, or text): the learner's prompt ids."""
    samples: List[ScoredSample]
    engine_id: str
    queue_delay_s: float
    latency_s: float
    gen_round: int = 0

    @property
    def prompt_id(self) -> str:
        return str(getattr(self.prompt, "id", ""))

    @property
    def reasons(self) -> List[str]:
        return [s.reject_reason for s in self.samples]

    def set_reasons(self, reasons: Sequence[str]) -> None:
        for s, reason in zip(self.samples, reasons):
            s.reject_reason = reason

    def stamp(self, step: int, learner_version: int) -> List[ScoredSample]:
        """Its samples, marked as consumed (or rejected) at `step` by `learner_version`."""
        for s in self.samples:
            s.step, s.learner_version = step, learner_version
        return list(self.samples)

    def version_range(self) -> Tuple[int, int]:
        versions = [parse_version(span["version"]) for s in self.samples for span in s.weight_versions]
        return (min(versions), max(versions)) if versions else (0, 0)

    def to_dict(self) -> Dict[str, object]:
        """Plain data (checkpoints carry the groups dynamic sampling kept for later)."""
        prompt = asdict(self.prompt) if hasattr(self.prompt, "__dataclass_fields__") else self.prompt
        return {"prompt": prompt, "prompt_input": self.prompt_input, "engine_id": self.engine_id,
                "queue_delay_s": self.queue_delay_s, "latency_s": self.latency_s, "gen_round": self.gen_round,
                "samples": [asdict(s) for s in self.samples]}

    @classmethod
    def from_dict(cls, d: Dict[str, Any], prompts: PromptDecoding,
                  encoding: Optional[PromptEncoding] = None) -> "Group":
        """The group `to_dict` wrote; also reads the carry-over of checkpoints written before
        samples were typed (engine replies and reward dicts side by side), re-encoding the
        prompt with `encoding`."""
        prompt = prompts.decode(d["prompt"])
        if "prompt_input" not in d:
            return _legacy_group(d, prompt, (encoding or TextPrompts).encode(prompt))
        return cls(prompt=prompt, prompt_input=d["prompt_input"],
                   samples=[ScoredSample.from_dict(s) for s in d["samples"]], engine_id=d["engine_id"],
                   queue_delay_s=d["queue_delay_s"], latency_s=d["latency_s"], gen_round=d["gen_round"])


def _legacy_group(d: Dict[str, Any], prompt: PromptItem, prompt_input: PromptInput) -> Group:
    """A carried group as checkpoints stored it before `ScoredSample` (see Group.from_dict)."""
    rewards = d.get("rewards") or []
    text = getattr(prompt, "prompt", None)
    samples = []
    for k, reply in enumerate(d["samples"]):
        r = rewards[k] if k < len(rewards) else {"reward": 0.0, "correct": False}
        parts = r.get("components") or {}
        score = SampleReward(reward=float(r["reward"]), correct=bool(r.get("correct", False)),
                             correctness=float(parts.get("correctness", 0.0)),
                             overlong_penalty=float(parts.get("overlong_penalty", 0.0)),
                             verifier=str(r.get("verifier", "")), verifier_version=str(r.get("verifier_version", "")),
                             verifier_error=r.get("error"))
        samples.append(ScoredSample(
            prompt_id=str(getattr(prompt, "id", "")), sample_index=reply["sample_index"],
            token_ids=list(reply["token_ids"]), logprobs=reply.get("logprobs"),
            weight_versions=list(reply.get("weight_versions") or []), response_text=reply.get("text", ""),
            truncated=(reply.get("finish_reason") or {}).get("type") == "length", seed=None,
            engine_id=d["engine_id"], queue_delay_s=d["queue_delay_s"],
            generation_latency_s=float((reply.get("meta_info") or {}).get("e2e_latency", d["latency_s"])),
            gen_round=d["gen_round"], dataset_revision=str(getattr(prompt, "dataset_revision", "") or ""),
            prompt_text=text if isinstance(text, str) else "", score=score))
    return Group(prompt=prompt, prompt_input=prompt_input, samples=samples, engine_id=d["engine_id"],
                 queue_delay_s=d["queue_delay_s"], latency_s=d["latency_s"], gen_round=d["gen_round"])


def drop_stale_groups(groups: Sequence[Group], learner_version: int, max_staleness: int
                      ) -> Tuple[List[Group], List[Group]]:
    """(fresh, stale): a group is stale when its oldest token's version < learner_version - k."""
    fresh, stale = [], []
    for g in groups:
        (stale if g.version_range()[0] < learner_version - max_staleness else fresh).append(g)
    for g in stale:
        g.set_reasons(["stale"] * len(g.samples))
    return fresh, stale


def compact_routed_experts(report: Optional[str]) -> Optional[str]:
    """An engine's `meta_info.routed_experts` (base64 of int32 [positions, num_hidden_layers,
    top_k], SGLang 0.5.23's format) kept in a quarter of the bytes: "u8:" + base64 of uint8 (or
    "u16:" + uint16 for more than 256 experts). A 20k-token answer of a 48-layer top-8 model is
    7.7 MB so, 41 MB as SGLang sends it. None stays None; `backends.megatron.routing.decode_routed_experts` reads
    both forms."""
    if not report:
        return None
    import base64

    import numpy as np

    raw = np.frombuffer(base64.b64decode(report), dtype=np.int32)
    kind, dtype = ("u8", np.uint8) if raw.size == 0 or int(raw.max()) < 256 else ("u16", np.uint16)
    return f"{kind}:" + base64.b64encode(raw.astype(dtype).tobytes()).decode()


def scored_sample(reply: "SampleResult", prompt: PromptItem, seed: Optional[int], engine_id: str, queue_delay_s: float,
                  latency_s: float, gen_round: int, dataset_revision: str = "") -> ScoredSample:
    """A ScoredSample (not scored yet) from one sample of an engine's reply."""
    text = getattr(prompt, "prompt", None)
    return ScoredSample(
        prompt_id=str(getattr(prompt, "id", "")), sample_index=reply.sample_index, token_ids=list(reply.token_ids),
        logprobs=reply.logprobs, weight_versions=list(reply.weight_versions), response_text=reply.text,
        truncated=reply.truncated, seed=seed, engine_id=engine_id, queue_delay_s=queue_delay_s,
        generation_latency_s=float(reply.meta_info.get("e2e_latency", latency_s)), gen_round=gen_round,
        dataset_revision=str(getattr(prompt, "dataset_revision", "") or dataset_revision),
        prompt_text=text if isinstance(text, str) else "",
        routed_experts=compact_routed_experts(reply.meta_info.get("routed_experts")))
