"""The Megatron learner: old log-probs, DAPO updates over mini-batches, SFT warm start.

    learner = MegatronLearner(cfg, hf_config, layout)     # layout.initialize() already ran
    metrics = learner.train_step(samples)                 # one rollout batch
    log_probs = learner.compute_log_probs(samples)        # per-sample [R] tensors, every rank

`train_step` on a rollout batch (samples ordered group by group, G per prompt):

0. the groups are shuffled (`algo.shuffle_mini_batches`, seeded by the step) and cut
   into mini-batches of `algo.mini_batch_size` prompts × G samples;
1. each DP rank takes its share of every mini-batch (split by token count,
   `megatron.balance_data_parallel`) and packs it into micro-batches of at most
   `megatron.micro_batch_tokens` (`megatron.sequence_packing`; THD rows on the
   Transformer Engine spec, rows with a per-sample causal mask on the local spec, padded
   to the FP8 alignment when FP8 is on; see batch.py / packing.py), once; short ranks
   append empty micro-batches so that every DP rank runs the same count per mini-batch,
   one that megatron's interleaved schedule accepts (`_schedule_passes`; FP8 delayed
   scaling all-reduces amaxes over the DP ranks at every micro-batch);
2. old log-probs π_old of every response token, before the first update: a forward-only
   pass over those same micro-batches writes them in place (or the engine's log-probs
   when `algo.use_engine_logprobs`);
3. for each mini-batch:
   N = loss tokens of the whole mini-batch over all DP ranks (before any forward);
   megatron's `get_forward_backward_func`
   (no-pipelining, 1F1B or interleaved) runs over its micro-batches with loss
   `compute_policy_loss(..., global_num_tokens=N)` per micro-batch; gradients add up over
   micro-batches and DP ranks to the exact whole-mini-batch token mean (optimizer.py);
   a NaN/Inf loss or gradient skips the update (or raises NonFiniteError);
   clip, AdamW step, LR schedule.

Every rank receives the same full sample list and returns the same metrics. A mixture's
routed-expert reports come apart from it (`experts`): each rank holds its DP rank's share only
(`expert_shards.RoutedExperts`, on the host; `driver/expert_handover.py`).
"""

from __future__ import annotations

import dataclasses
import time
from functools import partial
from typing import Callable, Dict, List, Optional, Sequence

import torch

from dapo_mega import distributed as D
from dapo_mega.algo import (
    TIS_METRICS,
    TrainSample,
    compute_correction_stats,
    compute_mismatch_stats,
    compute_off_policy_weights,
    compute_policy_loss,
    empty_correction_stats,
    empty_mismatch_stats,
    merge_mismatch_stats,
    summarize_correction,
    summarize_mismatch,
    summarize_tis_weights,
)
from dapo_mega.algo.mismatch import age_bucket_label
from dapo_mega.backends.megatron.batch import (
    ATTENTION_MASK,
    ATTENTION_THD,
    MicroBatch,
    build_padding_micro_batch,
    collate_micro_batch,
    collate_packed_micro_batch,
    count_loss_tokens,
    gather_responses,
    plan_micro_batches,
    plan_packed,
    response_values,
    shard_of,
    step_mini_batches,
)
from dapo_mega.backends.megatron.expert_shards import RoutedExperts
from dapo_mega.backends.megatron.layout import ParallelLayout
from dapo_mega.backends.megatron.logprobs import compute_token_log_probs
from dapo_mega.backends.megatron.model import TE_SPEC, build_model
from dapo_mega.backends.megatron.optimizer import WarmupConstantLR, build_optimizer, wrap_with_ddp
from dapo_mega.backends.megatron.packing import equalized_micro_batch_count, token_multiple
from dapo_mega.backends.megatron.routing import RouterWatch, take_load_balancing_loss
from dapo_mega.config import ConfigError, DapoConfig
from dapo_mega.models.shape import HfConfigSource

_POLICY_METRICS = ("loss/clip_frac_low", "loss/clip_frac_high", "loss/dual_clip_frac", "loss/approx_kl",
                   "loss/ratio_mean")


class NonFiniteError(RuntimeError):
    """A NaN/Inf loss or gradient with `algo.on_nonfinite=stop`."""


def check_learner_supports(layout: ParallelLayout) -> None:
    """What this learner does not do yet, as a ConfigError (also checked by `preflight`)."""
    if layout.cp != 1:
        raise ConfigError("megatron.context_parallel_size: the learner does not split sequences over CP yet. "
                          "Fix: use 1")


def all_finite(tensors: Sequence[torch.Tensor]) -> bool:
    """True when no element of `tensors` is NaN or ±inf. One fused reduction (each tensor's
    inf-norm, NaN or inf exactly where the tensor holds one; a max, so no finite value can
    overflow it) and one host read, not one per tensor: a 32B model has hundreds."""
    tensors = [t for t in tensors if t.numel()]  # the inf-norm of an empty tensor is undefined
    if not tensors:
        return True
    return bool(torch.isfinite(torch.stack(torch._foreach_norm(tensors, float("inf")))).all())


class MegatronLearner:
    """Megatron-core policy model, optimizer and the DAPO train step on one rank."""

    def __init__(self, cfg: DapoConfig, hf_config: HfConfigSource, layout: ParallelLayout, initialize: bool = True):
        """`initialize=False`: the caller loads every weight next (no random initialisation)."""
        check_learner_supports(layout)
        self.cfg = cfg
        self.layout = layout
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.model_chunks, self.info = build_model(hf_config, cfg.megatron, layout, initialize=initialize,
                                                   routing_replay=cfg.algo.routing_replay)
        # a mixture of experts: the engines' experts per token (agreement, replay: routing.py)
        self._routing = RouterWatch(self.model_chunks, self.info.shape, cfg.algo.routing_replay,
                                    layout.sequence_parallel, layout.tp_rank, layout.tp,
                                    cfg.checks.mismatch_age_buckets) if self.info.shape.is_moe else None
        self._routing_samples: Optional[Sequence[TrainSample]] = None
        """The samples the micro-batches now run index (train_step's), else None."""
        self._routing_reports: Optional[RoutedExperts] = None
        """This rank's routed-expert reports of those samples (train_step's)."""
        self._unreported = 0
        """This rank's samples of the step without a report at hand (what it routes by itself)."""
        self._router_loss_coeff = float(getattr(self.model_chunks[0].config, "moe_aux_loss_coeff", 0.0) or 0.0)
        """The load-balancing loss's weight per token (HF router_aux_loss_coef; `_scale_router_loss`)."""
        self.config = self.model_chunks[0].config
        self.ddp_chunks = wrap_with_ddp(self.model_chunks, cfg.megatron)
        self.optimizer = build_optimizer(self.ddp_chunks, cfg.algo, cfg.megatron, bf16=self.info.params_dtype == "bfloat16")
        self.scheduler = WarmupConstantLR.from_algo(cfg.algo)  # warm-up counted in rollout steps
        self.skipped_updates = 0
        # Sequence parallel splits the sequence over TP ranks (columns divide by TP); FP8
        # GEMMs need each rank's token count aligned (packing.py).
        fp8 = cfg.megatron.fp8
        self._seq_multiple = token_multiple(layout.tp, layout.sequence_parallel, fp8.enabled, fp8.recipe)
        self._thd = self.info.layer_spec == TE_SPEC
        # with the engine's log-probs as π_old the ratio is 1: nothing to correct (config.py refuses it)
        self._correction = "none" if cfg.algo.use_engine_logprobs else cfg.algo.correction_mode()
        self._metric_keys = _POLICY_METRICS + (TIS_METRICS if self._correction in ("tis", "geo_mask_tis") else ())
        self._age_buckets = cfg.checks.mismatch_age_buckets

    # ------------------------------------------------------------------ plumbing
    def _is_loss_rank(self) -> bool:
        """Last pipeline stage, TP rank 0: counts each micro-batch's metrics exactly once."""
        return self.layout.is_last_stage and self.layout.tp_rank == 0

    def _shard(self, samples: Sequence[TrainSample], indices: Sequence[int]) -> List[int]:
        """This DP rank's share of `indices` (balanced by tokens, or a contiguous block)."""
        return shard_of(samples, indices, self.layout.dp_rank, self.layout.dp, self.cfg.megatron.balance_data_parallel)

    def _micro_batches(self, samples: Sequence[TrainSample], indices: Sequence[int]) -> List[MicroBatch]:
        uniform = self.layout.pp > 1
        if self.cfg.megatron.sequence_packing:
            groups, width = plan_packed(samples, indices, self.cfg.megatron.micro_batch_tokens, thd=self._thd,
                                        uniform=uniform, seq_multiple=self._seq_multiple)
            attention = ATTENTION_THD if self._thd else ATTENTION_MASK
            return [collate_packed_micro_batch(samples, rows, seq_len=width or None, seq_multiple=self._seq_multiple,
                                               attention=attention) for rows in groups]
        groups = plan_micro_batches(samples, indices, self.cfg.megatron.micro_batch_tokens, uniform=uniform,
                                    seq_multiple=self._seq_multiple)
        seq_len = None
        if uniform:
            longest = max((samples[i].length for g in groups for i in g if i >= 0), default=2)
            seq_len = -(-max(longest, 2) // self._seq_multiple) * self._seq_multiple
        return [collate_micro_batch(samples, g, seq_len=seq_len, seq_multiple=self._seq_multiple) for g in groups]

    def _schedule_passes(self, samples: Sequence[TrainSample], shards: Sequence[Sequence[int]]) -> List[List[MicroBatch]]:
        """This rank's micro-batches of each shard (one schedule pass each), padded to the
        count every DP rank runs.

        FP8 delayed scaling all-reduces amaxes over every TP x DP rank of a stage at each
        grad-enabled forward and in backward, so a DP rank with fewer micro-batches than
        the others would leave them waiting forever; the interleaved schedule accepts only
        some counts. One all-reduce (MAX) over the DP group takes every shard's count at
        once; `equalized_micro_batch_count` rounds it for the pipeline, and short ranks
        append empty micro-batches (no sample: zero loss and gradient, the same
        collectives; loss denominators are computed from the samples, so unchanged).
        """
        passes = [self._micro_batches(samples, shard) for shard in shards]
        uniform = self.layout.pp > 1
        for micro_batches, most in zip(passes, self._max_over_data_parallel([len(p) for p in passes])):
            target = equalized_micro_batch_count([most], self.layout.pp, self.layout.vpp,
                                                 self.config.microbatch_group_size_per_vp_stage)
            micro_batches.extend(build_padding_micro_batch(micro_batches[0], uniform, self._seq_multiple)
                                 for _ in range(target - len(micro_batches)))
        return passes

    def _max_over_data_parallel(self, values: List[int]) -> List[int]:
        """Element-wise maximum over this rank's data-parallel group (one all-reduce)."""
        if self.layout.dp == 1 or not values:
            return list(values)
        from megatron.core import parallel_state

        group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        tensor = torch.tensor(values, dtype=torch.int64, device=D.collective_device(group))
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX, group=group)
        return [int(v) for v in tensor.tolist()]

    def _to_device(self, mb: MicroBatch) -> MicroBatch:
        if self.device.type == "cpu":
            return mb
        values = {f.name: getattr(mb, f.name) for f in dataclasses.fields(mb)}
        return MicroBatch(**{k: (v.to(self.device, non_blocking=True) if isinstance(v, torch.Tensor) else v)
                             for k, v in values.items()})

    @staticmethod
    def _packed_seq_params(mb: MicroBatch):
        """megatron-core's PackedSeqParams for a THD micro-batch (None otherwise)."""
        if mb.cu_seqlens is None:
            return None
        from megatron.core.packed_seq_params import PackedSeqParams

        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=mb.cu_seqlens, cu_seqlens_kv=mb.cu_seqlens,
                               max_seqlen_q=mb.max_seqlen, max_seqlen_kv=mb.max_seqlen)

    def _run_schedule(self, micro_batches: List[MicroBatch], loss_func: Callable, forward_only: bool) -> List[Dict]:
        """One pass of megatron's forward(-backward) schedule; returns the loss_func outputs (last stage)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator, model):
            mb = self._to_device(next(data_iterator))
            if self._routing is not None:
                self._routing.begin(mb, self._routing_samples, self._routing_reports)
            output = model(mb.tokens, mb.position_ids, mb.attention_mask,
                           packed_seq_params=self._packed_seq_params(mb))
            return output, partial(loss_func, mb)

        num_chunks = len(self.ddp_chunks)
        iterators = [iter(micro_batches) for _ in range(num_chunks)]
        first = micro_batches[0]
        forward_backward = get_forward_backward_func()
        return forward_backward(
            forward_step_func=forward_step,
            data_iterator=iterators if num_chunks > 1 else iterators[0],
            model=self.ddp_chunks if num_chunks > 1 else self.ddp_chunks[0],
            num_microbatches=len(micro_batches),
            seq_length=first.tokens.shape[1],
            micro_batch_size=first.tokens.shape[0],
            forward_only=forward_only,
        )

    def _all_reduce_sum(self, values: List[float]) -> List[float]:
        return D.all_reduce_sum(values)

    # ------------------------------------------------------------------ log-probs
    def _forward_log_probs(self, micro_batches: List[MicroBatch], temperature: Optional[float] = None
                           ) -> List[torch.Tensor]:
        """Forward only; [B, S] log-probs (float32, CPU) of each micro-batch's labels under
        softmax(z / temperature) (default algo.temperature), in order, on the last pipeline
        stage ([] elsewhere)."""
        vocab = self.info.shape.vocab_size
        temperature = self.cfg.algo.temperature if temperature is None else temperature

        def loss_func(mb: MicroBatch, logits: torch.Tensor):
            log_probs, _ = compute_token_log_probs(logits, mb.labels, temperature, vocab, with_entropy=False)
            return logits.new_zeros(()), torch.tensor(0, dtype=torch.int), {"log_probs": log_probs.detach()}

        for chunk in self.ddp_chunks:
            chunk.eval()
        with torch.no_grad():
            outputs = self._run_schedule(micro_batches, loss_func, forward_only=True)
        for chunk in self.ddp_chunks:
            chunk.train()
        if not self.layout.is_last_stage:
            return []
        return [out["log_probs"].float().cpu() for out in outputs]

    def _local_log_probs(self, samples: Sequence[TrainSample], indices: Sequence[int],
                         temperature: Optional[float] = None) -> Dict[int, torch.Tensor]:
        """Forward only over `indices`; {sample index: [R] log-probs} on loss ranks, {} elsewhere."""
        micro_batches = self._schedule_passes(samples, [indices])[0]
        result: Dict[int, torch.Tensor] = {}
        for mb, log_probs in zip(micro_batches, self._forward_log_probs(micro_batches, temperature)):
            result.update({i: values.clone() for i, values in response_values(log_probs, mb).items()})
        return result

    def _write_old_log_probs(self, micro_batches: List[MicroBatch]) -> None:
        """π_old into each micro-batch's `old_log_probs` at its response columns (on the last
        pipeline stage, the only one whose loss reads them)."""
        for mb, log_probs in zip(micro_batches, self._forward_log_probs(micro_batches)):
            index, valid = mb.response_index()
            columns = index[valid]
            old = torch.zeros(mb.labels.shape, dtype=torch.float32)
            old.view(-1)[columns] = log_probs.reshape(-1)[columns]
            mb.old_log_probs = old

    def compute_log_probs(self, samples: Sequence[TrainSample], temperature: Optional[float] = None
                          ) -> List[torch.Tensor]:
        """Per-sample [R] log-probs (float32, CPU) of the response tokens, on every rank, under
        softmax(z / temperature) (default algo.temperature; 1.0 is what an engine reports for
        prompt tokens)."""
        indices = self._shard(samples, range(len(samples)))
        local = self._local_log_probs(samples, indices, temperature)
        local = local if self._is_loss_rank() else {}
        gathered: List[Optional[Dict[int, torch.Tensor]]] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, local)
        merged: Dict[int, torch.Tensor] = {}
        for part in gathered:
            merged.update(part or {})
        return [merged[i] for i in range(len(samples))]

    # ------------------------------------------------------------------ updates
    def _grads_finite(self) -> bool:
        """Every rank's gradients finite (collective): one fused check and one host read per
        rank (`all_finite`), then one all-reduce."""
        grads = [param.main_grad for chunk in self.ddp_chunks for param in chunk.parameters()
                 if getattr(param, "main_grad", None) is not None]
        local_bad = 0.0 if all_finite(grads) else 1.0
        return self._all_reduce_sum([local_bad])[0] == 0.0

    def _leave_masked_tokens_out(self, tokens: float, kept: float) -> float:
        """algo.masked_tokens_in_denominator=false: the accumulated gradient of Σ w ℓ / N (every
        loss token of the mini-batch, all DP ranks) becomes that of Σ w ℓ / K (the tokens the
        correction kept) by one scale, N / K, on every rank's reduced gradient before clipping:
        exactly verl's loss with the rejected tokens out of its response mask, without another
        forward pass. Returns the scale (the loss is reported with it too)."""
        scale = tokens / kept
        for chunk in self.ddp_chunks:
            for param in chunk.parameters():
                if getattr(param, "main_grad", None) is not None:
                    param.main_grad.mul_(scale)
        return scale

    def _zero_grads(self) -> None:
        for chunk in self.ddp_chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()

    def _update(self, micro_batches: List[MicroBatch], loss_func: Callable, lr: Optional[float]) -> Dict[str, float]:
        """Forward/backward over the micro-batches, non-finite check, clip + step. Returns step info."""
        self._zero_grads()
        outputs = self._run_schedule(micro_batches, loss_func, forward_only=False)
        keys = self._metric_keys
        local = [0.0] * (4 + len(keys))  # loss, tokens, entropy·n, kept tokens, metric·n...
        if self._is_loss_rank():
            for out in outputs:
                n = float(out["num_tokens"])
                local[0] += float(out["loss"])
                local[1] += n
                local[2] += float(out["entropy_sum"])
                local[3] += float(out.get("kept_tokens", n))
                for k, key in enumerate(keys):
                    local[4 + k] += float(out.get(key, 0.0)) * n
        totals = self._all_reduce_sum(local)
        if not self.cfg.algo.masked_tokens_in_denominator and 0 < totals[3] < totals[1]:
            totals[0] *= self._leave_masked_tokens_out(totals[1], totals[3])
        mismatch = empty_mismatch_stats(self._age_buckets)
        correction = empty_correction_stats(self._age_buckets)
        for out in outputs if self._is_loss_rank() else ():
            if "mismatch" in out:
                mismatch = merge_mismatch_stats(mismatch, out["mismatch"])
            if "off_policy" in out:
                correction = correction + out["off_policy"]
        loss, tokens = totals[0], totals[1]
        finite = bool(torch.isfinite(torch.tensor(loss))) and self._grads_finite()
        info: Dict[str, float] = {"loss": loss, "tokens": tokens, "entropy": totals[2] / max(tokens, 1.0),
                                "finite": finite, "mismatch": mismatch,  # this rank's, reduced per step
                                "off_policy": correction}
        for k, key in enumerate(keys):
            info[key] = totals[4 + k] / max(tokens, 1.0)
        if not finite:
            self._zero_grads()
            self.skipped_updates += 1
            if self.cfg.algo.on_nonfinite == "stop":
                raise NonFiniteError(f"non-finite loss ({loss}) or gradient at update {self.scheduler.num_updates}; "
                                     "algo.on_nonfinite=stop")
            info.update(grad_norm=float("nan"), lr=self.scheduler.current_lr)
            return info
        info["lr"] = self.scheduler.apply(self.optimizer, lr)
        _, grad_norm, _ = self.optimizer.step()
        if grad_norm is None:
            grad_norm = self.optimizer.get_grad_norm()
        info["grad_norm"] = float(grad_norm)
        if lr is None:
            self.scheduler.advance()
        return info

    def _off_policy_weights(self, old: torch.Tensor, mb: MicroBatch, mask: torch.Tensor,
                            ages: Optional[Sequence[int]]) -> tuple:
        """The correction's [samples, tokens] weights of this micro-batch (None: none applies)
        and its metrics: `off_policy` statistics by age (algo/off_policy.py), plus tis/* for
        tis. Samples without engine log-probs (age -1) keep weight 1 and are not counted."""
        if self._correction == "none" or mb.engine_log_probs is None:
            return None, {}
        algo = self.cfg.algo
        row_ages = torch.tensor([0 if ages is None else ages[i] for i in mb.sample_indices], dtype=torch.long)
        engine_mask = mask * (row_ages >= 0)[:, None].to(mask.device)
        engine = gather_responses(mb.engine_log_probs, mb)
        mode = self._correction
        bounds = {"tis": None, "geo_mask_tis": "geo_mask"}.get(mode, mode)  # geo_mask_tis: geo_mask's bounds
        low, high = (getattr(algo, f"{bounds}_low"), getattr(algo, f"{bounds}_high")) if bounds else (None, None)
        weights = compute_off_policy_weights(mode, old, engine, engine_mask, tis_cap=algo.tis_cap, low=low, high=high)
        metrics = {"off_policy": compute_correction_stats(weights, engine_mask, row_ages.clamp(min=0),
                                                          self._age_buckets)}
        if mode in ("tis", "geo_mask_tis"):
            metrics.update(summarize_tis_weights(old, engine, algo.tis_cap, engine_mask))
        return weights, metrics

    def _policy_loss_func(self, global_tokens: float, global_seqs: float, mb: MicroBatch, logits: torch.Tensor,
                          ages: Optional[Sequence[int]] = None, measure_mismatch: bool = True):
        """`ages`: per sample index, its age, or -1 when it has no engine log-probs (None: all
        0); `measure_mismatch` false: this mini-batch's mismatch is not measured (the learner's
        own π_old is unknown after the first update when the engine's log-probs are π_old)."""
        algo = self.cfg.algo
        log_probs, entropy = compute_token_log_probs(logits, mb.labels, algo.temperature, self.info.shape.vocab_size)
        entropy_sum = (entropy * mb.response_mask).sum()
        # The loss reads [samples, response tokens] (gather_responses), whatever the packing:
        # the seq-mean modes aggregate per sample, and a packed row holds several.
        mask = gather_responses(mb.response_mask, mb)
        old = gather_responses(log_probs.detach() if mb.old_log_probs is None else mb.old_log_probs, mb)
        weights, correction_metrics = self._off_policy_weights(old, mb, mask, ages)
        loss, metrics = compute_policy_loss(
            gather_responses(log_probs, mb), old, gather_responses(mb.advantages, mb), mask,
            clip_ratio_low=algo.clip_ratio_low, clip_ratio_high=algo.clip_ratio_high, clip_ratio_c=algo.clip_ratio_c,
            loss_agg_mode=algo.loss_agg_mode, global_num_tokens=global_tokens, global_num_seqs=global_seqs,
            tis_weights=weights)
        num_tokens = mask.sum().to(torch.int)
        reduced = {key: metrics[key] for key in _POLICY_METRICS}
        reduced.update(correction_metrics)
        # loss tokens the correction did not mask (algo.masked_tokens_in_denominator)
        reduced["kept_tokens"] = num_tokens.detach() if weights is None else \
            (mask.bool() & (weights > 0)).sum().to(torch.int)
        if measure_mismatch and ages is not None and mb.engine_log_probs is not None:
            # the learner's π_old: `old`, or (engine log-probs as π_old) this first update's own
            learner_old = gather_responses(log_probs.detach(), mb) if algo.use_engine_logprobs else old
            row_ages = torch.tensor([ages[i] for i in mb.sample_indices], dtype=torch.long)
            has_engine = (row_ages >= 0)[:, None].to(mask.device)
            reduced["mismatch"] = compute_mismatch_stats(learner_old, gather_responses(mb.engine_log_probs, mb),
                                                         mask * has_engine, row_ages.clamp(min=0), self._age_buckets)
        reduced.update(loss=loss.detach(), num_tokens=num_tokens.detach(), entropy_sum=entropy_sum)
        return loss, num_tokens, reduced

    def train_step(self, samples: Sequence[TrainSample], step: Optional[int] = None,
                   experts: Optional[RoutedExperts] = None) -> Dict[str, float]:
        """DAPO updates on one rollout batch (ordered group by group); returns slash-keyed metrics.

        step: the rollout step, seeding the mini-batch shuffle; None = the number of
        optimizer updates so far (checkpointed with the LR schedule, so a resumed run
        shuffles as the straight one does).
        experts: a mixture's routed-expert reports of this DP rank's samples, as the driver
        hands them over (`driver/expert_handover.py`); None: read from the samples.
        """
        algo = self.cfg.algo
        start = time.perf_counter()
        samples = list(samples)
        mini_batches = step_mini_batches(len(samples), algo, self.cfg.megatron.seed,
                                         self.scheduler.num_updates if step is None else step)
        shards = [self._shard(samples, mb) for mb in mini_batches]

        # 1. this rank's micro-batches, collated once; 2. old log-probs, before the first update.
        if algo.use_engine_logprobs:
            missing = [i for i, s in enumerate(samples) if s.engine_log_probs is None]
            if missing:
                raise ValueError(f"algo.use_engine_logprobs=true but {len(missing)} samples have no engine_log_probs")
            samples = [dataclasses.replace(s, old_log_probs=list(s.engine_log_probs)) for s in samples]
        micro_per_update = self._schedule_passes(samples, shards)
        if self._routing is not None:  # what an SFT step or a probe left counts nothing
            self._routing_reports = RoutedExperts.of_samples(samples, self.info.shape) if experts is None else experts
            self._unreported = sum(not self._routing_reports.covers(i, samples[i]) for shard in shards
                                   for i in shard)
            self._check_routing_reports(samples)
            self._routing.take_counts()
            take_load_balancing_loss()
        self._routing_samples = samples
        try:
            return self._train_passes(samples, mini_batches, micro_per_update, start)
        finally:
            self._routing_samples = self._routing_reports = None
            self._count_routing(False)

    def _train_passes(self, samples: List[TrainSample], mini_batches: List[List[int]],
                      micro_per_update: List[List[MicroBatch]], start: float) -> Dict[str, float]:
        """train_step's passes: old log-probs, then one update per mini-batch; its metrics."""
        algo = self.cfg.algo
        if not algo.use_engine_logprobs:
            # π_old of the first update is the policy it starts from: its loss detaches its own
            # log-probs (dropout is off, so the training forward computes what a forward-only
            # pass would). The later updates need the weights before the first: one
            # forward-only pass over them; with pipeline stages one per mini-batch (one [B, S]
            # shape each).
            for mb in micro_per_update[0]:
                mb.old_log_probs = None
            later = micro_per_update[1:]
            passes = later if self.layout.pp > 1 else [[mb for mbs in later for mb in mbs]]
            self._count_routing(True)  # the later mini-batches at the weights that sampled them
            for micro_batches in passes:
                if micro_batches:
                    self._write_old_log_probs(micro_batches)

        # 3. one optimizer update per mini-batch.
        totals = {"loss/pg": 0.0, "actor/entropy": 0.0, "actor/grad_norm": 0.0, **{k: 0.0 for k in self._metric_keys}}
        applied, tokens_trained = 0, 0.0
        lr = self.scheduler.current_lr
        useful, computed = 0, 0  # this rank's real and computed (rows x columns) tokens
        # the engine/learner log-prob mismatch of every sampled token (algo/mismatch.py); with
        # the engine's log-probs as π_old, the learner's own are known before the first update only
        ages = [s.age if s.engine_log_probs is not None else -1 for s in samples]
        mismatch = empty_mismatch_stats(self._age_buckets)
        correction = empty_correction_stats(self._age_buckets)
        for k_update, (mini_batch, micro_batches) in enumerate(zip(mini_batches, micro_per_update)):
            # Denominators of the whole mini-batch (all micro-batches, all DP ranks):
            # tokens for token-mean, non-empty responses for the seq-mean ablation modes.
            global_tokens = float(count_loss_tokens(samples, mini_batch))
            global_seqs = float(sum(1 for i in mini_batch if any(samples[i].response_loss_mask())))
            useful += sum(mb.real_tokens for mb in micro_batches)
            computed += sum(mb.tokens.numel() for mb in micro_batches)
            measured = k_update == 0 or not algo.use_engine_logprobs
            self._count_routing(k_update == 0)
            self._scale_router_loss(sum(samples[i].length for i in mini_batch))
            info = self._update(micro_batches, partial(self._policy_loss_func, max(global_tokens, 1.0),
                                                       max(global_seqs, 1.0), ages=ages, measure_mismatch=measured),
                                lr=None)
            mismatch = merge_mismatch_stats(mismatch, info["mismatch"])
            correction = correction + info["off_policy"]
            tokens_trained += sum(samples[i].length for i in mini_batch)
            if not info["finite"]:
                continue
            applied += 1
            lr = info["lr"]
            totals["loss/pg"] += info["loss"]
            totals["actor/entropy"] += info["entropy"]
            totals["actor/grad_norm"] += info["grad_norm"]
            for key in self._metric_keys:
                totals[key] += info[key]
        elapsed = time.perf_counter() - start
        metrics = {key: (value / applied if applied else float("nan")) for key, value in totals.items()}
        metrics.update(self._layout_metrics(useful, computed))
        metrics.update(summarize_mismatch(self._reduce_stats(mismatch, max_column=2)))
        metrics.update(self._routing_metrics(samples))
        if self._correction != "none":
            metrics.update(summarize_correction(self._reduce_stats(correction)))
        metrics.update({
            "actor/lr": lr,
            "perf/train_tokens_per_s": tokens_trained / max(elapsed, 1e-9),
            "perf/train_seconds": elapsed,
            "train/num_updates": float(applied),
            "train/skipped_updates": float(len(mini_batches) - applied),
        })
        return metrics

    # ------------------------------------------------------------------ a mixture's routing
    def _count_routing(self, on: bool) -> None:
        """Whether the next forwards count towards `moe/router_agreement`: each sample once, at
        the weights that sampled it; on one rank of a TP group unless sequence parallelism
        splits the tokens over it."""
        if self._routing is not None:
            self._routing.counting = on and (self.layout.sequence_parallel or self.layout.tp_rank == 0)

    def _scale_router_loss(self, tokens: int) -> None:
        """The load-balancing loss of an update, per token of its mini-batch (`tokens`, every DP
        rank's), as the policy loss is: megatron-core's router multiplies each micro-batch's aux
        loss by its token count under `calculate_per_token_loss` and leaves the division to
        `finalize_model_grads`, which this learner does not ask for (its loss is already per
        token), so the weight itself is divided here (the router reads it at each forward)."""
        if self._router_loss_coeff:
            self.config.moe_aux_loss_coeff = self._router_loss_coeff / max(tokens, 1)

    def _check_routing_reports(self, samples: Sequence[TrainSample]) -> None:
        """Routing replay with no sample reporting its experts replays nothing: stop at the step."""
        if self.cfg.algo.routing_replay and samples and not self._routing_reports.reported:
            raise RuntimeError("algo.routing_replay=true, but the engines reported no routed experts for any of "
                               f"the step's {len(samples)} samples: the learner would route by itself. The engines "
                               "were asked (the trainer refuses at start engines not started with "
                               "--enable-return-routed-experts), so their reports were missing or of another shape: "
                               "a report counts only as [prompt + response - 1, num_hidden_layers, num_experts_per_tok]"
                               " of the learner's model. Fix: serve the learner's model on the engines "
                               "(rollout.model_path, the engines' --model-path), or set algo.routing_replay=false")

    def _routing_metrics(self, samples: Sequence[TrainSample]) -> Dict[str, float]:
        """moe/router_agreement (the share of the engines' token-expert choices the learner's own
        router makes too), the choices compared and the samples with no report; {} for a dense model."""
        if self._routing is None:
            return {}
        matches, compared, calls = self._routing.take_counts()
        buckets = len(matches)
        totals = self._all_reduce_sum([float(v) for v in matches + compared]
                                      + [take_load_balancing_loss(), calls, self._unreported])
        matches, compared, (balance, calls, unreported) = (totals[:buckets], totals[buckets:2 * buckets],
                                                           totals[2 * buckets:])
        by_age = {f"moe/{age_bucket_label(k, buckets)}/router_agreement": (m / c if c else float("nan"))
                  for k, (m, c) in enumerate(zip(matches, compared))}
        balancing = {"moe/load_balancing_loss": balance / calls if calls else float("nan")} \
            if self._router_loss_coeff else {}  # megatron computes it only with a weight
        return {**balancing, "moe/router_agreement": sum(matches) / sum(compared) if sum(compared) else float("nan"),
                "moe/router_choices_compared": sum(compared), **by_age,
                # each DP rank's ranks (TP, CP, PP) count its samples once each
                "moe/unreported_samples": unreported / (self.layout.world_size // self.layout.dp),
                "moe/routing_replay": float(self.cfg.algo.routing_replay)}

    def _reduce_stats(self, local: torch.Tensor, max_column: Optional[int] = None) -> torch.Tensor:
        """Every loss rank's [K, C] statistics (mismatch, off-policy correction) merged: sums
        add, column `max_column` (the mismatch's max |Δ|) takes the max; the same tensor on
        every rank. One all-reduce over all ranks, two with a max column."""
        if not D.is_active():
            return local
        device = D.collective_device()
        summed = local.to(device)
        torch.distributed.all_reduce(summed)
        if max_column is not None:
            largest = local.to(device).clone()
            torch.distributed.all_reduce(largest, op=torch.distributed.ReduceOp.MAX)
            summed[:, max_column] = largest[:, max_column]
        return summed.cpu()

    def _layout_metrics(self, useful: int, computed: int) -> Dict[str, float]:
        """perf/padding_efficiency (real / computed tokens, all DP ranks) and perf/dp_imbalance
        (computed tokens of the busiest DP rank / the mean). One all-reduce."""
        dp, rank = self.layout.dp, self.layout.dp_rank
        slots = [0.0] * (2 * dp)
        if self._is_loss_rank():  # one rank per DP replica reports
            slots[2 * rank], slots[2 * rank + 1] = float(useful), float(computed)
        totals = self._all_reduce_sum(slots)
        per_rank = totals[1::2]
        mean = sum(per_rank) / dp
        return {"perf/padding_efficiency": sum(totals[0::2]) / max(sum(per_rank), 1.0),
                "perf/dp_imbalance": max(per_rank) / mean if mean else 1.0}

    def sft_step(self, samples: Sequence[TrainSample], lr: float) -> Dict[str, float]:
        """One supervised update: cross-entropy on response tokens, mean over all of them, at `lr`."""
        start = time.perf_counter()
        samples = list(samples)
        indices = list(range(len(samples)))
        global_tokens = max(float(count_loss_tokens(samples, indices)), 1.0)
        temperature_free = 1.0  # supervised targets: no sampling temperature

        def loss_func(mb: MicroBatch, logits: torch.Tensor):
            log_probs, entropy = compute_token_log_probs(logits, mb.labels, temperature_free, self.info.shape.vocab_size)
            mask = mb.response_mask
            loss = -(log_probs * mask).sum() / global_tokens
            num_tokens = mask.sum().to(torch.int)
            return loss, num_tokens, {"loss": loss.detach(), "num_tokens": num_tokens, "entropy_sum": (entropy * mask).sum()}

        shard = self._shard(samples, indices)
        self._scale_router_loss(sum(s.length for s in samples))
        info = self._update(self._schedule_passes(samples, [shard])[0], loss_func, lr=lr)
        elapsed = time.perf_counter() - start
        return {"sft/loss": info["loss"], "sft/grad_norm": info["grad_norm"], "sft/lr": lr,
                "sft/skipped": float(not info["finite"]),
                "perf/sft_tokens_per_s": sum(s.length for s in samples) / max(elapsed, 1e-9)}
