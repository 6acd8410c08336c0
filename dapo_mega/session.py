"""Wiring: the components of one run on one learner rank, built once.

`Session.start(cfg)` on every learner rank: process groups and the parallel layout, the
run directory, the Megatron learner with its initial weights (latest checkpoint of the run
via `RunState.resume`, else `model.megatron_path`, else the HF weights), the rank's role
(`driver.roles`: on global rank 0 the `DriverRole` with the data, the verifier, the engines
and their rollout manager inside a `RolloutSource`, the ledger and the records; a
`LearnerRankRole` elsewhere), and on the ranks that are the weight source of a pipeline
stage a `WeightSyncer`. The verbs that involve the learner and the engines together (warm
start, weight sync, colocated memory hand-over, checkpoint save) are here; the loop
(`trainer.py`) calls them and the role's.

Policy versions: the learner's version is the number of optimizer steps it has synced;
engines report the version of every token they produce.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from dapo_mega.config import DapoConfig, save_config, validate_config
from dapo_mega.distributed import free_port
from dapo_mega.driver.console import route_known_warnings
from dapo_mega.driver.roles import DRIVER_RANK, DriverRole, LearnerRankRole, broadcast_from_driver
from dapo_mega.driver.run_state import RunState, prune_records_after


def maybe_spawn_learners(cfg: DapoConfig) -> Optional[int]:
    """Start `cluster.num_learner_processes` ranks with torchrun when not already a rank.

    Returns their exit code, or None when this process should train itself (one learner,
    or already launched by torchrun / srun).
    """
    n = cfg.cluster.num_learner_processes
    if n <= 1 or "RANK" in os.environ:
        return None
    validate_config(cfg, world_size=n)
    run_dir = cfg.run_dir
    config_path = save_config(cfg, run_dir)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
            "-m", "dapo_mega.trainer", "--config", str(config_path)]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return subprocess.call(argv, env=env)


def _init_world_env() -> int:
    """Single process started by hand: make env:// work. Returns the world size."""
    if "RANK" not in os.environ:
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
    return int(os.environ["WORLD_SIZE"])


def _init_world_env() -> int:
    """Single process started by hand: make env:// work. Returns the world size."""
    if "RANK" not in os.environ:
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
    return int(os.environ["WORLD_SIZE"])


class Session:
    """Components of one run on one learner rank; see the module docstring."""

    def __init__(self, cfg: DapoConfig):
        self.cfg = cfg
        self.run_dir = cfg.run_dir
        self.run = RunState(cfg.run_dir, cfg.trainer)
        self.role: LearnerRankRole = LearnerRankRole()
        self.model_dir = self._model_dir()
        self.layout: Any = None
        self.learner: Any = None
        self.fleet: Any = None
        self.engines: List[Any] = []
        self.engine_urls: List[str] = []
        self.syncer: Any = None
        self.handover: Any = None
        """Colocated on GPUs: this rank's part in the hand-over (weights.handover.HandoverPlan)."""
        self.posters: Dict[int, Any] = {}
        """Colocated on GPUs: engine index -> WeightSyncer on the rank that posts its payloads."""

    @property
    def state(self):
        """The run's TrainerState (counters, cursor, carry-over)."""
        return self.run.state

    # ================================================================== start-up
    @classmethod
    def start(cls, cfg: DapoConfig) -> "Session":
        route_known_warnings(cfg.run_dir)  # before megatron-core is imported
        s = cls(cfg)
        try:
            s._start()
        except BaseException:
            s.close()
            raise
        return s

    def _start(self) -> None:
        from dapo_mega.backends.megatron.layout import ParallelLayout
        from dapo_mega.backends.megatron.train_step import MegatronLearner

        cfg = self.cfg
        world_size = _init_world_env()
        validate_config(cfg, world_size=world_size)
        is_driver = int(os.environ["RANK"]) == DRIVER_RANK  # the one place the rank decides a role
        if is_driver:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            save_config(cfg, self.run_dir)
        if not (self.model_dir / "config.json").exists():
            self._build_tiny_model()
        self.layout = ParallelLayout.from_config(cfg.megatron, world_size, hf_config=str(self.model_dir))
        self.layout.initialize(timeout_s=cfg.cluster.dist_timeout_s)
        torch.manual_seed(cfg.trainer.seed)
        self.learner = MegatronLearner(cfg, str(self.model_dir), self.layout)
        if not self.run.resume(self.learner):
            self._load_initial_weights()
        if is_driver:
            self.role = self._start_driver()
        self._start_syncer()

    def _model_dir(self) -> Path:
        if self.cfg.model.hf_path:
            path = Path(self.cfg.model.hf_path)
            if not (path / "config.json").exists():
                raise FileNotFoundError(f"model.hf_path={path}: no config.json there. Fix: point model.hf_path at "
                                        "a Hugging Face checkpoint directory")
            return path
        return self.run_dir / "base_model"

    def _build_tiny_model(self) -> None:
        """Every rank may get here before process groups exist: each builds the same
        deterministic files into its own tmp dir and the first rename wins."""
        import shutil

        from dapo_mega.models.tiny import build_tiny_model_dir

        tmp = self.model_dir.with_name(self.model_dir.name + f".tmp{os.getpid()}")
        build_tiny_model_dir(tmp, self.cfg.model, seed=self.cfg.megatron.seed)
        try:
            os.rename(tmp, self.model_dir)
        except OSError:  # another rank (or the Slurm prepare step) was first
            shutil.rmtree(tmp, ignore_errors=True)

    def _load_initial_weights(self) -> None:
        """A fresh run: `model.megatron_path`, else the HF weights of the model directory."""
        if self.cfg.model.megatron_path:
            from dapo_mega.backends.megatron.checkpoint import load_model_from_dist_checkpoint

            load_model_from_dist_checkpoint(self.learner.model_chunks, self.cfg.model.megatron_path)
            self._refresh_main_params()
            return
        from dapo_mega.weights.hf_io import HFCheckpointReader
        from dapo_mega.weights.stream import load_hf_into_megatron

        reader = HFCheckpointReader(self.model_dir)
        try:
            load_hf_into_megatron(self.learner.model_chunks, self.learner.info, self.layout, reader)
        finally:
            reader.close()
        self._refresh_main_params()

    def _refresh_main_params(self) -> None:
        """Weights were copied into the model: the optimizer's fp32 main copies (bf16 params
        on GPU) must follow, or the first step would write the old values back."""
        reload = getattr(self.learner.optimizer, "reload_model_params", None)
        if reload is not None:
            reload()

    def _start_driver(self) -> DriverRole:
        """Data, prompt encoder, verifier, engines, rollout manager and records (global rank 0)."""
        from dapo_mega.backends.sglang.client import build_sampling_params
        from dapo_mega.data import Problem, PromptEncoder, PromptIterator, build_datasets
        from dapo_mega.driver.rollouts import RolloutSource
        from dapo_mega.records import RunRecorder
        from dapo_mega.reward import build_verifier
        from dapo_mega.rollout.manager import RolloutManager

        cfg, state = self.cfg, self.run.state
        encoder = PromptEncoder.from_pretrained(self.model_dir, cfg.data)
        data_report: Dict[str, Any] = {}
        train_problems, eval_problems, revision = build_datasets(cfg.data, report=data_report)
        skipped = {split: f"{r.num_skipped} {dict(r.skip_reasons)}" for split, r in data_report.items()
                   if getattr(r, "num_skipped", 0)}
        print(f"[data] {len(train_problems)} train / {len(eval_problems)} held-out problems, revision "
              f"{revision}; bad rows skipped (data.on_bad_row=skip): {skipped or 'none'}", flush=True)
        if cfg.eval.max_problems:
            eval_problems = eval_problems[:cfg.eval.max_problems]
        prompts = PromptIterator(train_problems, seed=cfg.data.seed, shuffle=cfg.data.shuffle, revision=revision)
        self.engine_urls = self._start_engines()
        sampling = build_sampling_params(temperature=cfg.algo.temperature, top_p=cfg.algo.top_p,
                                         top_k=cfg.algo.top_k, max_new_tokens=cfg.algo.max_response_length)
        manager = RolloutManager(self.fleet.endpoints, cfg.algo.n_samples_per_prompt, sampling,
                                 max_retries=cfg.rollout.max_retries, run_id=cfg.trainer.run_name,
                                 prompt_to_input=encoder.encode, seed=cfg.trainer.seed)
        rollouts = RolloutSource(cfg, prompts, encoder, build_verifier(cfg.algo.verifier), manager)
        if self.run.resumed:  # steps after the checkpoint are redone: their records go (metrics: RunRecorder)
            print(f"[trainer] resumed from {self.run.checkpoint} at step {state.step}, policy version "
                  f"{state.policy_version}", flush=True)
            rollouts.load_state_dict(state.data_cursor, state.rollout_carry, lambda d: Problem(**_problem_fields(d)))
            prune_records_after(self.run_dir, state.step)
        recorder = RunRecorder(self.run_dir, cfg.trainer.run_name, _config_dict(cfg), state.step,
                               wandb_mode=cfg.trainer.wandb_mode, wandb_project=cfg.trainer.wandb_project,
                               wandb_run_id=state.wandb_run_id, plot=cfg.trainer.plot)
        state.wandb_run_id = recorder.wandb_run_id
        sft_prompts = PromptIterator(train_problems, seed=cfg.data.seed + 1)
        return DriverRole(cfg, self.run, rollouts, sft_prompts, eval_problems, recorder)

    def _start_engines(self) -> List[str]:
        """Engines given by URL, announced in a registry directory, or started here (the fleet)."""
        from dapo_mega.rollout.fleet import open_fleet

        self.fleet = open_fleet(self.cfg, self.cfg.rollout.model_path or str(self.model_dir), self.run_dir / "logs",
                                weight_version=str(self.state.policy_version), learner_ranks=self.layout.world_size)
        self.engines = self.fleet.engines
        return [e.url for e in self.fleet.endpoints]

    def _start_syncer(self) -> None:
        """Weight sources of each PP stage join a weight-update group with the engines."""
        from dapo_mega.rollout.fleet import endpoint_of
        from dapo_mega.weights.sync import WeightSyncer

        from dapo_mega.backends.placement import CUDA_IPC, SHARED_MEMORY, trainer_placement

        urls = broadcast_from_driver(self.engine_urls)
        self.engine_urls = urls
        # how weights reach the engines: the placement's rule (colocated on GPUs: hand-over on
        # each GPU, never a NCCL group holding two ranks of one device)
        transport = trainer_placement(self.cfg, self.layout.world_size, torch.cuda.is_available(), os.environ)
        if transport.transport == CUDA_IPC:
            self._start_handover(urls, transport)
            return
        needs_syncer = (self.layout.dp_rank == 0 and self.layout.is_weight_source) or self.role.is_driver
        if not needs_syncer:
            return
        local = all(u.startswith(("http://127.0.0.1", "http://localhost")) for u in urls)
        colocated = transport.transport == SHARED_MEMORY and local
        self.syncer = WeightSyncer([endpoint_of(u, self.cfg.rollout) for u in urls],
                                   bucket_mb=self.cfg.rollout.weight_sync_bucket_mb,
                                   mode="colocated" if colocated else "distributed",
                                   backend="nccl" if torch.cuda.is_available() else "gloo",
                                   # DAPO_MEGA_SYNC_ADDR: this node's Slurm NodeAddr (dapo_mega.launch);
                                   # the hostname can resolve to a loopback alias
                                   master_address="127.0.0.1" if local else (os.environ.get("DAPO_MEGA_SYNC_ADDR")
                                                                             or socket.gethostbyname(socket.gethostname())),
                                   engine_tp_size=self.cfg.rollout.engine_tp_size)
        if not colocated and self.layout.is_weight_source:
            self.syncer.init_group(free_port(), stage=self.layout.pp_rank)

    def _start_handover(self, urls: List[str], placement) -> None:
        """Colocated on GPUs (weights.handover): every rank takes part; the learner rank on
        each engine's first GPU posts its requests; the driver pauses and resumes engines."""
        from dapo_mega.rollout.fleet import endpoint_of
        from dapo_mega.weights.handover import HandoverPlan
        from dapo_mega.weights.sync import WeightSyncer

        problems = placement.problems()
        if problems:
            raise RuntimeError("colocated placement: " + "; ".join(problems))
        self.handover = HandoverPlan.for_rank(self.layout.rank, {e.index: e.ipc_ranks for e in placement.engines})
        self.posters = {e: WeightSyncer([endpoint_of(urls[e], self.cfg.rollout)], mode="colocated")
                        for e in self.handover.posts}
        if self.role.is_driver:
            self.syncer = WeightSyncer([endpoint_of(u, self.cfg.rollout) for u in urls], mode="colocated",
                                       engine_tp_size=self.cfg.rollout.engine_tp_size)

    # ================================================================== the loop's verbs
    def warm_start(self) -> None:
        """Supervised steps on reference answers so that the tiny model's rewards are informative."""
        cfg = self.cfg.trainer
        start = time.perf_counter()
        for k in range(cfg.sft_warmup_steps):
            metrics = self.learner.sft_step(self.role.sft_samples(cfg.sft_batch_size), lr=cfg.sft_lr)
            if (k + 1) % max(1, cfg.sft_warmup_steps // 10) == 0:
                self.role.say(f"[warm start] {k + 1}/{cfg.sft_warmup_steps} loss {metrics['sft/loss']:.4f} "
                              f"({time.perf_counter() - start:.0f} s)")
        self.run.state.warm_started = True

    def drop_dead_engines(self) -> None:
        """Engines the rollout manager found dead (no reply within rollout.request_timeout_s,
        connection refused) leave the weight sync too, so a lost engine costs the run its share
        of generation and nothing else. Collective: every learner rank calls it."""
        dead = self.role.dead_engines()
        if self.syncer is None or not dead:
            return
        for url in self.syncer.drop_engines(sorted(dead)):
            self.role.say(f"[trainer] engine {url} dropped from rollouts and weight sync: {dead[url]}", error=True)

    def engines_release_memory(self) -> None:
        """Colocated: engines free their GPU memory for the learner's step (driver's request)."""
        self.drop_dead_engines()
        self.role.release_engine_memory(self.syncer)

    def engines_resume_memory(self) -> None:
        self.role.resume_engine_memory(self.syncer)

    def sync_weights(self) -> Dict[str, float]:
        """Push the learner's weights into every engine as version `state.policy_version`."""
        from dapo_mega.weights.sync import sync_learner_weights

        self.drop_dead_engines()
        version = self.run.state.policy_version
        if self.handover is not None:
            from dapo_mega.weights.handover import sync_colocated_learner_weights

            stats = sync_colocated_learner_weights(
                self.syncer, self.posters, self.learner.model_chunks, self.learner.info, self.layout, str(version),
                self.handover, self.cfg.rollout.weight_sync_bucket_mb << 20,
                torch.device("cuda", torch.cuda.current_device()))
        else:
            stats = sync_learner_weights(self.syncer, self.learner.model_chunks, self.learner.info, self.layout,
                                         str(version))
        self.role.engines_serve(version)
        metrics = stats.as_metrics() if stats is not None else {}
        if self.syncer is not None:
            metrics["sync/engines"] = len(self.syncer.clients)
        return metrics

    def save_checkpoint(self, step: int) -> None:
        """Weights, optimizer, RNG and trainer state of `step` (collective)."""
        self.run.save(self.learner, step, self.role.checkpoint_state())

    # ================================================================== shutdown
    def close(self) -> None:
        self.role.close()
        for syncer in [self.syncer, *self.posters.values()]:
            if syncer is None:
                continue
            try:
                syncer.close()
            except Exception as exc:  # an engine already gone must not hide the real error
                print(f"[trainer] closing the weight syncer: {exc}", file=sys.stderr)
        if self.fleet is not None:
            self.fleet.close()
        try:
            from dapo_mega.reward.scoring import close_verifier_pools

            close_verifier_pools()
        except ImportError:
            pass
        if torch.distributed.is_initialized():
            if self.layout is not None:
                self.layout.destroy()
            else:
                torch.distributed.destroy_process_group()


def _problem_fields(d: Dict[str, Any]) -> Dict[str, Any]:
    d = dict(d)
    if isinstance(d.get("messages"), list):
        d["messages"] = tuple(d["messages"])
    return d


def _config_dict(cfg: DapoConfig) -> Dict[str, Any]:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)  # type: ignore[return-value]

