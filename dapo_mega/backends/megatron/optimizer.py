"""Megatron DDP wrapping, the AdamW optimizer and the warm-up-then-constant LR schedule.

Gradient scaling contract (megatron-core 0.16.1, read from schedules.py,
distributed_data_parallel.py and finalize_model_grads.py):

* `TransformerConfig.calculate_per_token_loss=True`: the schedule does *not* divide a
  micro-batch's loss by its token count or by num_microbatches (it would otherwise).
* `DistributedDataParallelConfig(average_in_collective=False)` with per-token loss gives
  `gradient_scaling_factor = 1.0`: DP gradients are *summed*, not averaged.
* `finalize_model_grads(model, num_tokens)` would divide gradients by the all-reduced
  token count when given one; the learner passes None (`finalize_grads_without_token_scaling`).

So each micro-batch's loss is Σ_tokens ℓ / N_global (N_global = loss tokens of the whole
mini-batch on all DP ranks, computed before the forward), gradients add up over
micro-batches and DP ranks, and the result is exactly the gradient of the whole-mini-batch
token mean (DAPO Eq. 12).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, List

import torch

from dapo_mega.config import AlgoConfig, MegatronConfig

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer


def finalize_grads_without_token_scaling(model, num_tokens=None, pg_collection=None, force_all_reduce=False):
    """megatron's finalize_model_grads with num_tokens dropped (the loss is already normalised)."""
    from megatron.core.distributed import finalize_model_grads

    return finalize_model_grads(model, None, pg_collection=pg_collection, force_all_reduce=force_all_reduce)


def wrap_with_ddp(chunks: List[torch.nn.Module], mcfg: MegatronConfig) -> List[torch.nn.Module]:
    """Megatron DDP around each model chunk (fp32 grad buffers, distributed optimizer layout)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=mcfg.overlap_grad_reduce,
        use_distributed_optimizer=mcfg.use_distributed_optimizer,
        average_in_collective=False,
        check_for_nan_in_grad=False,  # the learner checks and skips/raises itself
    )
    wrapped = []
    for index, chunk in enumerate(chunks):
        wrapped.append(DistributedDataParallel(config=chunk.config, ddp_config=ddp_config, module=chunk,
                                               # megatron buckets only the first chunk's grads (as in training.py)
                                               disable_bucketing=index > 0))
    config = chunks[0].config
    config.finalize_model_grads_func = finalize_grads_without_token_scaling
    config.no_sync_func = [c.no_sync for c in wrapped] if len(wrapped) > 1 else wrapped[0].no_sync
    if mcfg.overlap_grad_reduce:
        config.grad_sync_func = [c.start_grad_sync for c in wrapped] if len(wrapped) > 1 else wrapped[0].start_grad_sync
    return wrapped


def build_optimizer(ddp_chunks: List[torch.nn.Module], algo: AlgoConfig, mcfg: MegatronConfig, bf16: bool):
    """AdamW through megatron's get_megatron_optimizer (fp32 main params + state under bf16)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    opt_config = OptimizerConfig(
        optimizer="adam", lr=algo.lr, min_lr=algo.lr, weight_decay=algo.weight_decay,
        adam_beta1=algo.adam_beta1, adam_beta2=algo.adam_beta2, adam_eps=1e-8, clip_grad=algo.grad_clip,
        bf16=bf16, fp16=False, params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=mcfg.use_distributed_optimizer)
    return get_megatron_optimizer(opt_config, ddp_chunks)


@dataclass
class WarmupConstantLR:
    """lr(k) = base_lr · min(1, (k+1)/warmup_steps) for update k = 0, 1, ...; constant after.

    `warmup_steps` counts optimizer updates; `from_algo` converts `algo.lr_warmup_steps`
    (rollout steps, as the DAPO paper counts them) into updates.
    `apply(optimizer)` writes lr(num_updates) into every param group before an update;
    `advance()` after a successful update. state_dict/load_state_dict for checkpoints.
    """

    base_lr: float
    warmup_steps: int
    num_updates: int = 0

    @classmethod
    def from_algo(cls, algo: AlgoConfig) -> "WarmupConstantLR":
        """The schedule of `algo`: warm-up over `lr_warmup_steps` rollout steps, each of
        train_batch_size / mini_batch_size optimizer updates (32B recipe: 20 x 16 = 320)."""
        updates_per_rollout_step = max(1, algo.train_batch_size // algo.mini_batch_size)
        return cls(algo.lr, algo.lr_warmup_steps * updates_per_rollout_step)

    def lr_at(self, update: int) -> float:
        if self.warmup_steps <= 0:
            return self.base_lr
        return self.base_lr * min(1.0, (update + 1) / self.warmup_steps)

    @property
    def current_lr(self) -> float:
        return self.lr_at(self.num_updates)

    def apply(self, optimizer: MegatronOptimizer, lr: float | None = None) -> float:
        value = self.current_lr if lr is None else lr
        for group in optimizer.param_groups:
            group["lr"] = value
        return value

    def advance(self) -> None:
        self.num_updates += 1

    def state_dict(self) -> Dict[str, float]:
        return {"base_lr": self.base_lr, "warmup_steps": self.warmup_steps, "num_updates": self.num_updates}

    def load_state_dict(self, state: Dict[str, float]) -> None:
        self.num_updates = int(state["num_updates"])
