"""The parallel layout of the Megatron learner: one object, validated, passed explicitly.

    world = TP · PP · CP · DP
    TP · CP · DP = EP · expert DP      (the experts of a mixture: expert TP 1)

`ParallelLayout.from_config` computes DP from the world size; `validate()` checks every
rule against the model *before* any process group exists and raises `ConfigError` naming
the field; `initialize()` starts torch.distributed (gloo on the CPU, NCCL on the GPU its
caller chose) when needed and megatron's `parallel_state`. Rank properties read the
initialised groups, so code that holds a layout never has to reach for module globals itself.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from dapo_mega.config import ConfigError, MegatronConfig
from dapo_mega.models.shape import HfConfigSource, ModelShape

EXPERT_TP = 1
"""Expert tensor parallelism: each expert whole on one rank (the peers' layouts for
Qwen3-30B-A3B; the plan's memory counts the same)."""


def check_expert_layout(shape: ModelShape, ep: int, ranks_of_a_stage: int) -> None:
    """ConfigError, naming megatron.expert_model_parallel_size, where EP does not fit the model
    and the learner ranks: a dense model has no experts to split; EP must divide the routed
    experts (each rank holds num_experts / EP whole experts) and the TP x CP x DP ranks of a
    pipeline stage (megatron-core lays the expert ranks out as EP x expert-DP over the same
    GPUs, expert TP 1)."""
    if ep == 1:
        return
    field = "megatron.expert_model_parallel_size"
    if not shape.is_moe:
        raise ConfigError(f"{field}: {ep} for a dense model ({shape.model_type}): it has no experts to split. "
                          "Fix: set it to 1")
    if shape.num_experts % ep:
        raise ConfigError(f"{field}: {ep} does not divide the model's {shape.num_experts} experts. Fix: use a divisor "
                          f"of {shape.num_experts}")
    if ranks_of_a_stage % ep:
        raise ConfigError(f"{field}: {ep} does not divide TP x CP x DP = {ranks_of_a_stage} learner ranks of a stage. "
                          f"Fix: use a divisor of {ranks_of_a_stage}")


@dataclass
class ParallelLayout:
    """Sizes of every parallel dimension of the learner (ranks come after `initialize`)."""

    world_size: int
    tp: int = 1
    pp: int = 1
    vpp: Optional[int] = None
    """Virtual pipeline stages (model chunks) per PP rank; None = not interleaved."""
    cp: int = 1
    dp: int = 1
    ep: int = 1
    sequence_parallel: bool = False
    hf_config: Optional[HfConfigSource] = None
    """The HF config (object, dict or path) used for divisibility checks; may be None."""

    @classmethod
    def from_config(cls, mcfg: MegatronConfig, world_size: int, hf_config: Optional[HfConfigSource] = None
                    ) -> "ParallelLayout":
        """Layout from the Megatron config and the number of learner processes.

        DP = world_size / (TP·PP·CP); the division is checked in `validate()`.
        """
        tp, pp, cp = mcfg.tensor_model_parallel_size, mcfg.pipeline_model_parallel_size, mcfg.context_parallel_size
        model_parallel = max(tp * pp * cp, 1)
        return cls(world_size=world_size, tp=tp, pp=pp, vpp=mcfg.virtual_pipeline_model_parallel_size, cp=cp,
                   dp=max(world_size // model_parallel, 1), ep=mcfg.expert_model_parallel_size,
                   sequence_parallel=mcfg.sequence_parallel, hf_config=hf_config)

    # ------------------------------------------------------------------ validation
    def validate(self) -> "ParallelLayout":
        """Every rule that must hold before process groups start; ConfigError names the field.

        The size rules (each >= 1, SP needs TP > 1, VPP needs PP > 1, TP·PP·CP divides the
        world) are MegatronConfig's, written once in config.py; the layout adds what needs
        the model (heads and layers divisible) and its own DP."""
        sizes = MegatronConfig(tensor_model_parallel_size=self.tp, pipeline_model_parallel_size=self.pp,
                               virtual_pipeline_model_parallel_size=self.vpp, context_parallel_size=self.cp,
                               expert_model_parallel_size=self.ep, sequence_parallel=self.sequence_parallel)
        sizes.validate()
        if sizes.check_world_size(self.world_size) != self.dp:
            raise ConfigError(
                f"megatron.tensor_model_parallel_size: tp*pp*cp*dp = {self.tp}*{self.pp}*{self.cp}*{self.dp} "
                f"!= world size {self.world_size}. Fix: build the layout with ParallelLayout.from_config")
        if self.hf_config is not None:
            arch = ModelShape.from_hf_config(self.hf_config)
            check_expert_layout(arch, self.ep, self.tp * self.cp * self.dp)
            if arch.is_moe and self.tp > 1 and not self.sequence_parallel:
                raise ConfigError(f"megatron.sequence_parallel: false with TP {self.tp} for a mixture of experts; "
                                  "megatron-core's MoE layer refuses to train so (its first forward raises). Fix: "
                                  "megatron.sequence_parallel=true")
            if arch.num_attention_heads % self.tp:
                raise ConfigError(
                    f"megatron.tensor_model_parallel_size: {self.tp} does not divide the model's "
                    f"num_attention_heads {arch.num_attention_heads}. Fix: pick a TP that divides it")
            if arch.num_key_value_heads % self.tp:
                raise ConfigError(
                    f"megatron.tensor_model_parallel_size: {self.tp} does not divide the model's "
                    f"num_key_value_heads (query groups) {arch.num_key_value_heads}. Fix: pick a TP that divides it")
            chunks = self.pp * (self.vpp or 1)
            field = ("virtual_pipeline_model_parallel_size" if self.vpp
                     else "pipeline_model_parallel_size")
            if arch.num_layers % chunks:
                raise ConfigError(
                    f"megatron.{field}: the model's {arch.num_layers} layers do not split into "
                    f"pp*vpp = {self.pp}*{self.vpp or 1} = {chunks} equal pipeline chunks. Fix: pick sizes that divide "
                    "num_hidden_layers")
        return self

    # ------------------------------------------------------------------ start-up
    def initialize(self, backend: Optional[str] = None, init_method: Optional[str] = None,
                   rank: Optional[int] = None, timeout_s: int = 1800,
                   cuda_device: Optional[int] = None) -> "ParallelLayout":
        """Validate, start torch.distributed if needed, then megatron's parallel_state.

        cuda_device: the GPU this rank runs on, the caller's explicit choice from the device
        rule (`backends.placement`: the trainer's `learner_cuda_index`, conversion's
        `conversion_cuda_index`); the rank selects it and the backend defaults to NCCL.
        None (the default): the CPU with gloo, and then no GPU may be visible (a process the
        rule puts on the CPU hides them: `placement.CPU_RANK_ENV`), since megatron-core would
        place the model on one anyway; refused with ConfigError before anything starts.
        init_method/rank default to env:// (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE), as
        torchrun and srun set them. On the CPU the megatron CUDA substitutions
        (`cpu_support`) are installed first.
        """
        self.validate()
        from megatron.core import parallel_state

        from dapo_mega.backends.megatron.cpu_support import enable_cpu_support

        enable_cpu_support()
        if not torch.distributed.is_initialized():
            if cuda_device is None and torch.cuda.is_available():
                raise ConfigError(f"ParallelLayout.initialize: {torch.cuda.device_count()} GPU(s) visible but no "
                                  "cuda_device chosen for this rank. Fix: pass the rank's GPU from the device rule "
                                  "(dapo_mega.backends.placement), or hide the GPUs from a CPU rank "
                                  "(CUDA_VISIBLE_DEVICES='', placement.CPU_RANK_ENV)")
            backend = backend or ("gloo" if cuda_device is None else "nccl")
            if cuda_device is not None:
                torch.cuda.set_device(cuda_device)
            torch.distributed.init_process_group(
                backend=backend, init_method=init_method or "env://", world_size=self.world_size,
                rank=rank if rank is not None else int(os.environ.get("RANK", "0")),
                timeout=datetime.timedelta(seconds=timeout_s))
        actual = torch.distributed.get_world_size()
        if actual != self.world_size:
            raise ConfigError(f"cluster.num_learner_processes: layout expects {self.world_size} learner processes, "
                              f"torch.distributed has {actual}")
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=self.tp, pipeline_model_parallel_size=self.pp,
            virtual_pipeline_model_parallel_size=self.vpp, context_parallel_size=self.cp,
            expert_model_parallel_size=self.ep, expert_tensor_parallel_size=EXPERT_TP,
            distributed_timeout_minutes=max(timeout_s // 60, 1))
        return self

    # ------------------------------------------------------------------ ranks
    @property
    def rank(self) -> int:
        return torch.distributed.get_rank()

    @property
    def tp_rank(self) -> int:
        from megatron.core import parallel_state

        return parallel_state.get_tensor_model_parallel_rank()

    @property
    def pp_rank(self) -> int:
        from megatron.core import parallel_state

        return parallel_state.get_pipeline_model_parallel_rank()

    @property
    def cp_rank(self) -> int:
        from megatron.core import parallel_state

        return parallel_state.get_context_parallel_rank()

    @property
    def dp_rank(self) -> int:
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_rank()

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def drains_weights(self) -> bool:
        """True on the ranks that stream the weights out (`weights.stream.iter_megatron_to_hf`):
        the TP ranks of DP 0 / CP 0, and with expert parallelism every rank (the expert
        gathers run over EP groups that span the DP ranks)."""
        return self.ep > 1 or (self.dp_rank == 0 and self.cp_rank == 0)

    @property
    def is_weight_source(self) -> bool:
        """True on the rank of each pipeline stage that sends its weights (tp0, dp0, cp0)."""
        return self.tp_rank == 0 and self.dp_rank == 0 and self.cp_rank == 0

    # ------------------------------------------------------------------ rank order (no process groups)
    def coordinates_of(self, rank: int) -> Tuple[int, int, int, int]:
        """(tp_rank, cp_rank, dp_rank, pp_rank) of global `rank` in megatron-core's default
        order `tp-cp-ep-dp-pp` (TP fastest, PP slowest; EP = 1 for the dense layers), the
        order `parallel_state.initialize_model_parallel` builds its groups in."""
        tp, cp, dp = self.tp, self.cp, self.dp
        return rank % tp, (rank // tp) % cp, (rank // (tp * cp)) % dp, rank // (tp * cp * dp)

    def stage_source_rank(self, stage: int) -> int:
        """Global rank of pipeline stage `stage`'s weight source (tp0, cp0, dp0)."""
        return stage * self.tp * self.cp * self.dp

    def destroy(self) -> None:
        """Tear down megatron's groups (torch.distributed stays up; the caller owns it)."""
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
