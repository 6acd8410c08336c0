"""What the driver hands the learner ranks each step, in bytes (issue #46 item 2): `dapo-mega
plan` counts it beside the learners' and the engines' memory (`plan.memory.compute_plan`).

With N = train_batch_size x G samples a step, prompts of P tokens and responses of mean R
(the plan's length assumption, `memory.LengthAssumption`), L layers, k experts a token, E
experts, b bytes an expert id (1 up to 256 experts, else 2), N_r the samples whose engines
report experts (N with routing replay, N / checks.router_agreement_every without, 0 dense):

    samples        N (5 (P + R) + 9 R [+ 2 R with a loss mask] + 300)    pickled, every rank, host:
                   token ids above 65535 take 5 bytes with their opcode, an engine log-prob 9
    reports        N_r (P + R - 1) L k b          the step's, packed: all the driver sends
    as base64      4/3 of that                     as the samples carry them: what the pickled
                                                   broadcast used to copy to every rank
    shard          reports / DP                   one DP rank's, host (shares balanced by tokens)
    shard, max     ceil(N / DP) (P_max + R_max - 1) L k b
    driver         reports as base64 + one shard   (the batch's samples keep theirs for the ledger)
    GPU            t (8k + 1 + 8 + 4E + 8k)        one sparse layer at a time: the engine's experts
                                                   [t, k] int64, known and age per token, the
                                                   router's fp32 logits and own top-k; t = a
                                                   micro-batch's tokens on the rank

The Qwen3-30B-A3B recipe with replay on (8192 samples of 150 + 4,014 mean tokens, 48 layers,
top-8 of 128): 13.1 GB of reports a step, 17.5 GB as base64, 1.64 GB per DP rank (DP 8).
"""

from __future__ import annotations

import math
from typing import List

from dapo_mega.backends.megatron.expert_shards import expert_id_dtype
from dapo_mega.config import DapoConfig, partial_rollout_enabled, routed_experts_every
from dapo_mega.models.shape import ModelShape
from dapo_mega.plan.types import HandOver

GB = 1e9

PICKLED_ID_BYTES = 5
"""A token id in a pickled list (BININT: opcode + 4 bytes; ids below 65536 take 3, this counts the large vocabularies')."""
PICKLED_FLOAT_BYTES = 9
"""An engine log-prob in a pickled list (BINFLOAT: opcode + 8 bytes)."""
PICKLED_MASK_BYTES = 2
"""A loss-mask entry (BININT1)."""
PICKLED_SAMPLE_OVERHEAD = 300
"""A TrainSample's own fields and list headers, pickled (measured: 200-330 bytes)."""


def sample_pickle_bytes(prompt_tokens: float, response_tokens: float, loss_mask: bool) -> float:
    """One TrainSample as the driver's broadcast pickles it (module docstring)."""
    return (PICKLED_ID_BYTES * (prompt_tokens + response_tokens) + PICKLED_FLOAT_BYTES * response_tokens
            + (PICKLED_MASK_BYTES * response_tokens if loss_mask else 0) + PICKLED_SAMPLE_OVERHEAD)


def hand_over_bytes(cfg: DapoConfig, shape: ModelShape, dp: int, prompt_tokens: float,
                    mean_response: float) -> HandOver:
    """What the driver hands the learners each step (module docstring), at prompts of
    `prompt_tokens` and responses of `mean_response` tokens on average."""
    a, m = cfg.algo, cfg.megatron
    samples = a.train_batch_size * a.n_samples_per_prompt
    loss_mask = bool(cfg.rollout.environment) or (partial_rollout_enabled(cfg)
                                                  and cfg.rollout.mask_offpolicy_in_partial_rollout)
    every = routed_experts_every(cfg) if shape.is_moe else 0
    reporting = samples / every if every else 0.0
    id_bytes = expert_id_dtype(shape.num_experts).itemsize if shape.is_moe else 1
    per_position = shape.num_layers * shape.num_experts_per_tok * id_bytes if shape.is_moe else 0
    mean_positions = prompt_tokens + mean_response - 1
    max_positions = a.max_prompt_length + a.max_response_length - 1
    reports = reporting * mean_positions * per_position
    base64 = reports * 4 / 3  # samples keep their u8 / u16 ids as base64 (`compact_routed_experts`)
    shard = reports / dp
    shard_max = math.ceil(min(reporting, samples) / dp) * max_positions * per_position
    tokens = m.micro_batch_tokens / (m.tensor_model_parallel_size if m.sequence_parallel else 1)
    k = shape.num_experts_per_tok
    device = tokens * (8 * k + 1 + 8 + 4 * shape.num_experts + 8 * k) if shape.is_moe and every else 0.0
    return HandOver(samples_per_step=samples, mean_positions=mean_positions, max_positions=max_positions,
                    sample_pickle_bytes=samples * sample_pickle_bytes(prompt_tokens, mean_response, loss_mask),
                    reporting_samples=reporting, expert_id_bytes=id_bytes, report_bytes_per_position=per_position,
                    reports_bytes=reports, reports_base64_bytes=base64, shard_bytes=shard, shard_max_bytes=shard_max,
                    driver_bytes=base64 + shard, device_bytes_per_router=device)


def hand_over_lines(h: HandOver, dp: int) -> List[str]:
    """The plan's lines for `h`."""
    lines = [f"hand-over per step (host, gloo): {h.samples_per_step} samples pickled {h.sample_pickle_bytes / GB:.2f} GB "
             "on every learner rank"]
    if h.reporting_samples:
        lines.append(f"  routed experts of {h.reporting_samples:,.0f} samples x {h.mean_positions:,.0f} positions x "
                     f"{h.report_bytes_per_position} bytes: {h.reports_bytes / GB:.2f} GB packed ({h.reports_base64_bytes / GB:.2f} GB "
                     f"as the samples carry them, on the driver), {h.shard_bytes / GB:.2f} GB per DP rank of {dp} "
                     f"(<= {h.shard_max_bytes / GB:.2f} GB at full length) on each of its ranks' host; GPU: "
                     f"{h.device_bytes_per_router / 2**20:.1f} MiB a sparse layer at a time")
    return lines
