"""Per-step rollout metrics from the step's samples (DESIGN.md "Records").

Computed from the same `ScoredSample`s whose rows go into the ledger (or from the ledger's
`LedgerRecord`s: the fields read here have the same names in both), so a metric and the
ledger can never disagree. Rewards, accuracy and lengths are over every sample generated in the step
(kept or not); the `rollout/kept_*` variants are over the samples the learner trains on.
`rollout/entropy_mc` estimates the rollout policy's entropy from the engine's log-probs
(`rollout_entropy_estimate`).
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence

import numpy as np

from dapo_mega.rollout.samples import TRAINED_REASONS

AGE_BUCKETS = (0, 1, 2, 3)
"""Lower edges of the age buckets of asynchronous training (versions behind the learner);
the last one is open (3+). The step metrics and the ledger report share them."""


def age_label(age: int) -> str:
    """The bucket of an age: `0`, `1`, `2` or `3+` (a negative age counts as 0)."""
    last = AGE_BUCKETS[-1]
    return f"{last}+" if age >= last else str(max(age, 0))


def compute_rollout_metrics(records: Sequence, seconds: float, multi_turn: bool = False) -> Dict[str, float]:
    """Reward, accuracy, length distribution, truncation, reject reasons, tokens/s; with
    `multi_turn` (an environment: rollout/turns.py) the turns and the tool (`turn_metrics`)."""
    if not records:
        return {"rollout/num_samples": 0.0}
    rewards = np.array([r.reward for r in records], dtype=np.float64)
    # accuracy counts verdicts only: a reward that gives a bare score has none (reward/returns.py)
    verdicts = [r.correct for r in records if r.correct is not None]
    lengths = np.array([r.response_length for r in records], dtype=np.float64)
    truncated = np.array([r.truncated for r in records], dtype=np.float64)
    kept = [r for r in records if r.reject_reason in TRAINED_REASONS]
    out = {
        "rollout/num_samples": float(len(records)),
        "rollout/reward_mean": float(rewards.mean()),
        "rollout/verdict_rate": float(len(verdicts) / len(records)),
        "rollout/response_length_mean": float(lengths.mean()),
        "rollout/response_length_p50": float(np.percentile(lengths, 50)),
        "rollout/response_length_p90": float(np.percentile(lengths, 90)),
        "rollout/response_length_max": float(lengths.max()),
        "rollout/clip_rate": float(truncated.mean()),
        "rollout/generated_tokens": float(lengths.sum()),
        "rollout/tokens_per_s": float(lengths.sum() / max(seconds, 1e-9)),
        "rollout/verifier_errors": float(sum(1 for r in records if r.reject_reason == "verifier_error")),
        "rollout/kept_samples": float(len(kept)),
        "rollout/samples_per_trained_sample": float(len(records) / max(len(kept), 1)),
    }
    if verdicts:
        out["rollout/accuracy"] = float(np.mean(verdicts))
    if multi_turn:
        out.update(turn_metrics(records))
    entropy = rollout_entropy_estimate(records)
    if entropy is not None:
        out["rollout/entropy_mc"] = entropy
    if kept:
        out["rollout/kept_reward_mean"] = float(np.mean([r.reward for r in kept]))
        kept_verdicts = [r.correct for r in kept if r.correct is not None]
        if kept_verdicts:
            out["rollout/kept_accuracy"] = float(np.mean(kept_verdicts))
    for reason in sorted({r.reject_reason for r in records}):
        out[f"rollout/reject/{reason}"] = float(sum(1 for r in records if r.reject_reason == reason))
    # Group-level rates of this step's generation (DESIGN.md), from the records themselves:
    # a group is (prompt, generation round); all-correct / all-wrong by the verifier's
    # verdict whether or not dynamic sampling filtered on it.
    groups: Dict[tuple, list] = {}
    for r in records:
        groups.setdefault((r.prompt_id, r.gen_round), []).append(r)
    n_groups = max(len(groups), 1)
    out["rollout/num_groups"] = float(len(groups))
    # by the verdicts: a group with a sample that has none is neither
    out["rollout/all_correct_rate"] = sum(all(r.correct is True for r in g) for g in groups.values()) / n_groups
    out["rollout/all_wrong_rate"] = sum(all(r.correct is False for r in g) for g in groups.values()) / n_groups
    out["rollout/kept_group_frac"] = sum(
        any(r.reject_reason in TRAINED_REASONS for r in g) for g in groups.values()) / n_groups
    return out


def rollout_entropy_estimate(records: Sequence) -> Optional[float]:
    """`rollout/entropy_mc`: −mean log p(y_t) over every generated token of the step, with
    log p the engine's log-prob of the token it sampled (`ScoredSample.logprobs`).

    A Monte-Carlo estimate of the rollout policy's per-token entropy E_t[H(π(·|s_t))] (the
    mean of −log π(y_t|s_t) over y_t ~ π is the entropy at s_t) that costs no forward pass:
    exact in expectation when sampling uses the full distribution (top-p = 1, no top-k, the
    DAPO training setting); with top-p/top-k it is the cross-entropy of the truncated sampling
    distribution under the full one (engines report log-probs before truncation). Tokens
    are weighted equally, so long responses weigh more (as in the token-level loss).
    None when the engine returned no log-probs. `actor/entropy` is the exact entropy of the
    learner's distribution on the trained tokens (computed from its logits)."""
    total, count = 0.0, 0
    for r in records:
        logprobs = getattr(r, "logprobs", None)
        if logprobs:
            values = np.asarray(logprobs, dtype=np.float64)
            mask = r.env_mask() if hasattr(r, "env_mask") else None
            if mask is not None:  # a multi-turn sample: the environment's tokens were not sampled
                values = values[np.asarray(mask[:len(values)], dtype=bool)]
            total += float(np.sum(values))
            count += len(values)
    return -total / count if count else None


def turn_metrics(records: Sequence) -> Dict[str, float]:
    """Multi-turn samples (rollout/turns.py): turns per sample, tool calls, tool errors (all and
    by kind), tool seconds and the environment's share of the response tokens, summed over the
    step's samples; `rollout/closed_with_pending_tool`: samples whose last turn asked for a tool
    that never answered (`ScoredSample.tool_pending`; 0 unless the rollout lost a call; a ledger
    row has no such field and counts none)."""
    tokens = sum(r.response_length for r in records)
    env = sum(r.env_tokens for r in records)
    out = {"rollout/turns_mean": float(np.mean([r.turns for r in records])),
           "rollout/turns_max": float(max(r.turns for r in records)),
           "rollout/tool_calls": float(sum(r.tool_calls for r in records)),
           "rollout/tool_errors": float(sum(sum(r.tool_errors.values()) for r in records)),
           "rollout/tool_time_s": float(sum(r.tool_time_s for r in records)),
           "rollout/env_tokens": float(env), "rollout/model_tokens": float(tokens - env),
           "rollout/env_token_share": float(env / max(tokens, 1)),
           "rollout/closed_with_pending_tool": float(sum(bool(getattr(r, "tool_pending", False)) for r in records))}
    for kind in sorted({k for r in records for k in r.tool_errors}):
        out[f"rollout/tool_errors/{kind}"] = float(sum(r.tool_errors.get(kind, 0) for r in records))
    return out


def compute_age_metrics(records: Sequence, num_stale_groups: int) -> Dict[str, float]:
    """Reward and accuracy by sample age (versions behind the consuming learner)."""
    out: Dict[str, float] = {"rollout/stale_groups": float(num_stale_groups)}
    # the samples trained on and those dropped for their age: the age tables show what staleness costs
    trained = [r for r in records if r.reject_reason in (*TRAINED_REASONS, "stale")]
    if trained:
        out["rollout/age_mean"] = float(np.mean([r.age for r in trained]))
        out["rollout/age_max"] = float(max(r.age for r in trained))
    for label in (age_label(lower) for lower in AGE_BUCKETS):
        rows = [r for r in trained if age_label(int(r.age)) == label]
        if not rows:
            continue
        out[f"age/{label}/num_samples"] = float(len(rows))
        out[f"age/{label}/reward_mean"] = float(np.mean([r.reward for r in rows]))
        verdicts = [r.correct for r in rows if r.correct is not None]
        if verdicts:
            out[f"age/{label}/accuracy"] = float(np.mean(verdicts))
    return out
