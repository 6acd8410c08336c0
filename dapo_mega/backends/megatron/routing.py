"""A mixture of experts on the learner: router agreement with the engines, and routing replay.

The engines report the experts each token was routed to (SGLang's `return_routed_experts`:
base64 of int32 [positions, num_hidden_layers, top_k] over the prompt and response but the
last token, which was sampled and never fed; zeros in the dense layers). A sample carries them
(`TrainSample.routed_experts`) to the driver, which hands each learner rank its DP rank's share
(`expert_shards.RoutedExperts`, on the host). `RouterWatch` holds every router of this rank's
model chunks and a forward pre-hook on each; before each micro-batch's forward the learner hands it the
micro-batch (`begin`), and at each router's call the hook:

* computes the learner's own top-k (the router's logits in fp32; top-k of the logits is top-k of
  their softmax, so pre- and post-softmax routing choose alike), and counts, over the tokens
  whose engine choice is known, how many of the engine's k experts the learner's own choice
  holds: `moe/router_agreement` = matches / (tokens x k), over every sparse layer and token of
  the samples it counts (`counting`: each sample once, at the weights that sampled it, as the
  log-prob mismatch is);
* with `algo.routing_replay`, hands megatron-core's `RouterReplay` of that router (built by
  `moe_enable_routing_replay`) the target experts: the engine's where known, the learner's own
  elsewhere (padding, the last token, samples without a report), so a forward without reports
  routes exactly as without replay.

Token order: megatron-core's router sees a micro-batch's [B, S] tokens as [S, B] flattened
(`index = s * B + b`), with sequence parallelism this TP rank's S / TP rows of it. A pipeline
stage's routers are its own layers; with full activation recompute the recomputed forward
calls the hook again with the micro-batch of the moment, which is the one recomputed only
without pipeline parallelism (preflight refuses replay with full recompute under PP > 1); a
router counts once per micro-batch, so a recomputed forward adds nothing to the agreement.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

from dapo_mega.algo.train_sample import TrainSample
from dapo_mega.backends.megatron.batch import MicroBatch
from dapo_mega.backends.megatron.expert_shards import RoutedExperts, decode_routed_experts
from dapo_mega.backends.megatron.model import unwrap_chunk
from dapo_mega.models.shape import ModelShape

__all__ = ["RouterWatch", "decode_routed_experts", "routing_targets"]


def routing_targets(mb: MicroBatch, samples: Sequence[TrainSample], shape: ModelShape,
                    layers: Sequence[int], experts: Optional[RoutedExperts] = None
                    ) -> Tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """(experts [B, S, len(layers), k] int64, known [B, S] bool, samples without a report, ages
    [B, S] int64) of a micro-batch: each sample's reported experts of `layers` (global layer
    indices) at its columns, -1 where nothing is known; each column's sample's policy-version age.
    `experts`: this rank's reports (`expert_shards.RoutedExperts`; default: read from the samples)."""
    reports = RoutedExperts.of_samples(samples, shape) if experts is None else experts
    rows, width = mb.tokens.shape
    k = shape.num_experts_per_tok
    experts = torch.full((rows, width, len(layers), k), -1, dtype=torch.long)
    known = torch.zeros(rows, width, dtype=torch.bool)
    ages = torch.zeros(rows, width, dtype=torch.long)
    missing = 0
    for p in mb.placements:
        n = p.prompt_length + p.response_length - 1
        ages[p.row, p.start:p.start + n] = samples[p.sample_index].age
        report = reports.get(p.sample_index)
        if report is None or report.shape[0] != n:
            missing += 1
            continue
        experts[p.row, p.start:p.start + n] = torch.from_numpy(report[:, list(layers), :].astype(np.int64))
        known[p.row, p.start:p.start + n] = True
    return experts, known, missing, ages


class RouterWatch:
    """The routers of this rank's model chunks, their agreement with the engines' choices, and
    routing replay (module docstring)."""

    def __init__(self, chunks: Sequence[torch.nn.Module], shape: ModelShape, replay: bool,
                 sequence_parallel: bool = False, tp_rank: int = 0, tp: int = 1, age_buckets: int = 1):
        self.shape, self.replay = shape, replay
        self.split = (tp_rank, tp) if sequence_parallel and tp > 1 else None
        self.routers: List[Tuple[int, torch.nn.Module]] = []
        for chunk in chunks:
            for layer in unwrap_chunk(chunk).decoder.layers:
                router = getattr(layer.mlp, "router", None)
                if router is not None:
                    self.routers.append((layer.layer_number - 1, router))
        self.layers = [layer for layer, _ in self.routers]
        self.counting = False
        """Whether the forwards now running count towards the agreement."""
        self.age_buckets = max(1, age_buckets)
        self.matches = [0] * self.age_buckets
        self.compared = [0] * self.age_buckets
        """Token-expert choices compared (tokens x k) since `take_counts`, by policy-version age
        (the last bucket holds every older age, as the mismatch's)."""
        self.balance_calls = 0
        """Router calls that added to megatron's load-balancing tracker since `take_counts`
        (training forwards, recomputed ones too), counted on TP rank 0 (`split`: with sequence
        parallelism each TP rank adds its tokens' share of one call)."""
        self._counts_calls = tp_rank == 0
        self._counted: set = set()
        """Routers that counted the micro-batch now running (a recomputed forward counts nothing)."""
        self._experts: Optional[torch.Tensor] = None  # [tokens, layers, k] in the routers' order
        self._known: Optional[torch.Tensor] = None  # [tokens]
        self._ages: Optional[torch.Tensor] = None  # [tokens], bucketed
        self._hooks = [router.register_forward_pre_hook(self._hook(i)) for i, (_, router) in enumerate(self.routers)]

    def begin(self, mb: MicroBatch, samples: Optional[Sequence[TrainSample]],
              reports: Optional[RoutedExperts] = None) -> None:
        """The micro-batch whose forward runs next, its samples and this rank's reports of them
        (None samples: no reports, own routing)."""
        self._counted = set()
        if samples is None or not self.routers:
            self._experts = self._known = self._ages = None
            return
        experts, known, _, ages = routing_targets(mb, samples, self.shape, self.layers, reports)
        if not known.any():  # nothing reported: nothing to compare, and replay routes as the learner does
            self._experts = self._known = self._ages = None
            return
        rows, width = known.shape
        experts = experts.transpose(0, 1).reshape(width * rows, len(self.layers), -1)  # megatron's [S, B] order
        known = known.transpose(0, 1).reshape(width * rows)
        ages = ages.clamp(max=self.age_buckets - 1).transpose(0, 1).reshape(width * rows)
        if self.split is not None:
            rank, size = self.split
            part = slice(rank * width * rows // size, (rank + 1) * width * rows // size)
            experts, known, ages = experts[part], known[part], ages[part]
        self._experts, self._known, self._ages = experts, known, ages

    def _hook(self, index: int):
        def before_router(router: torch.nn.Module, args) -> None:
            if self._counts_calls and router.training and torch.is_grad_enabled():
                self.balance_calls += 1
            if self._experts is None and not self.replay:  # no report to compare with: no extra work
                return
            hidden = args[0]
            with torch.no_grad():
                logits = hidden.reshape(-1, hidden.shape[-1]).float() @ router.weight.float().t()
                own = logits.topk(self.shape.num_experts_per_tok, dim=-1).indices
            experts = self._experts
            if experts is None or experts.shape[0] != own.shape[0]:
                known = None
            else:
                engine = experts[:, index].to(own.device)
                known = self._known.to(own.device)
                if self.counting and index not in self._counted:
                    self._counted.add(index)
                    same = (own.unsqueeze(-1) == engine.unsqueeze(-2)).any(-1)  # [tokens, k]: own holds engine's
                    ages = self._ages.to(own.device)
                    for bucket in range(self.age_buckets):
                        where = known & (ages == bucket)
                        self.matches[bucket] += int(same[where].sum())
                        self.compared[bucket] += int(where.sum()) * own.shape[1]
            if self.replay:
                target = own if known is None else torch.where(known.unsqueeze(-1), engine, own)
                from megatron.core.transformer.moe.router_replay import RouterReplayAction

                router.router_replay.clear_indices()
                router.router_replay.set_target_indices(target)
                router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        return before_router

    def take_counts(self) -> Tuple[List[int], List[int], int]:
        """(matches, compared) by age bucket and `balance_calls` since the last call; reset."""
        counts = (self.matches, self.compared, self.balance_calls)
        self.matches, self.compared = [0] * self.age_buckets, [0] * self.age_buckets
        self.balance_calls = 0
        return counts

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()


LOAD_BALANCING_LOSS = "load_balancing_loss"
"""megatron-core's name, in its layer-wise tracker, of the `aux_loss` router's balancing loss."""


def take_load_balancing_loss() -> float:
    """This rank's load-balancing loss since the last take, summed over its sparse layers and
    forwards (`RouterWatch.balance_calls` counts them), and reset. megatron-core's router adds
    each training forward's loss of each layer, before its coefficient (Switch Transformer's
    E * sum_i f_i * P_i: 1.0 when the experts share the tokens evenly; transformers'
    `load_balancing_loss_func` over one layer is top-k times it), to its layer-wise tracker;
    its own reduce walks the tracker's names, which a pipeline stage without sparse layers
    lacks, so the learner sums this over all ranks with its other metrics. With sequence
    parallelism each TP rank holds its tokens' share (MoE at TP > 1 needs it: `layout.py`)."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    entry = get_moe_layer_wise_logging_tracker().get(LOAD_BALANCING_LOSS)
    if entry is None:
        return 0.0
    total = float(entry["values"].sum())
    entry["values"].zero_()
    return total
