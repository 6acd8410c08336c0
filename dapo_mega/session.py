"""Wiring: the components of one run on one learner rank, built once.

`Session.start(cfg)` on every learner rank: process groups and the parallel layout, the
run directory (its run id, and a resume's config changes checked: `run_files.identity`), the
Megatron learner with its initial weights (latest checkpoint of the run via
`RunState.resume`, else `model.megatron_path`, else the HF weights), the rank's role
(`driver.roles`: on global rank 0 the `DriverRole` with the data, the verifier, the engines
and their rollout manager inside a `RolloutSource`, the ledger and the records; a
`LearnerRankRole` elsewhere), and the rank's part in pushing weights to the engines
(`driver.policy_sync`). The verbs that involve the learner and the engines together (warm
start, weight sync, colocated memory hand-over, checkpoint save, HF export) are here; the loop
(`trainer.py`) calls them and the role's.

Policy versions: the learner's version is the number of optimizer steps it has synced;
engines report the version of every token they produce.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List, Optional

import torch

from dapo_mega import distributed as D
from dapo_mega import log
from dapo_mega.config import ConfigError, DapoConfig, routed_experts_every, validate_config
from dapo_mega.driver.expert_handover import ExpertHandOver
from dapo_mega.driver.gate import DriverGate
from dapo_mega.driver.known_warnings import route_known_warnings
from dapo_mega.driver.learner_ranks import init_world_env
from dapo_mega.driver.policy_sync import PolicySync
from dapo_mega.driver.roles import DRIVER_RANK, DriverRole, LearnerRankRole
from dapo_mega.driver.run_state import RunState, prune_records_after
from dapo_mega.driver.weight_probe import WeightProbe
from dapo_mega.engines.book import EngineBook
from dapo_mega.run_files.checkpoints import set_aside_after
from dapo_mega.run_files.identity import RUN_ID_ENV, add_to_run_file, config_dict, settle_run_dir

if TYPE_CHECKING:
    from dapo_mega.backends.megatron.layout import ParallelLayout
    from dapo_mega.backends.megatron.learner import MegatronLearner
    from dapo_mega.engines.fleet import EngineFleet
    from dapo_mega.engines.process import EngineProcess

logger = log.get(__name__)


class Session:
    """Components of one run on one learner rank; see the module docstring."""

    def __init__(self, cfg: DapoConfig):
        self.cfg = cfg
        self.run_dir = cfg.run_dir
        self.run = RunState(cfg.run_dir, cfg.trainer)
        self.role: LearnerRankRole = LearnerRankRole()
        self.model_dir = self._model_dir()
        self.layout: Optional[ParallelLayout] = None
        self.learner: Optional[MegatronLearner] = None
        self.fleet: Optional[EngineFleet] = None
        self.engines: List[EngineProcess] = []
        self.engine_urls: List[str] = []
        self.book = EngineBook()
        """Which engines serve, are dead or rejoin (engines/book.py): the driver's, once they start."""
        self.policy_sync: Optional[PolicySync] = None
        self.probe: Optional[WeightProbe] = None

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

    def _cuda_device(self, world_size: int) -> Optional[int]:
        """This learner rank's GPU from the run's placement (None on a CPU), the one the weight
        sync and the colocated hand-over assume it is on."""
        if not torch.cuda.is_available():
            return None
        from dapo_mega.backends.placement import learner_cuda_index, trainer_placement

        placement = trainer_placement(self.cfg, world_size, True, os.environ)
        return learner_cuda_index(placement.learner(int(os.environ["RANK"])), os.environ)

    def _start(self) -> None:
        from dapo_mega.backends.megatron.layout import ParallelLayout
        from dapo_mega.backends.megatron.learner import MegatronLearner

        cfg = self.cfg
        world_size = init_world_env()
        validate_config(cfg, world_size=world_size)
        is_driver = int(os.environ["RANK"]) == DRIVER_RANK  # the one place the rank decides a role
        # the run's id, and a resume's config changes checked (refused: ConfigError) before anything is built
        self.run.identity = settle_run_dir(cfg, write=is_driver, inherited_run_id=os.environ.get(RUN_ID_ENV))
        if not (self.model_dir / "config.json").exists():
            self._build_tiny_model()
        self.layout = ParallelLayout.from_config(cfg.megatron, world_size, hf_config=str(self.model_dir))
        self.layout.initialize(timeout_s=cfg.cluster.dist_timeout_s, cuda_device=self._cuda_device(world_size))
        # the driver's progress counter is published from here on (driver/gate.py)
        gate = DriverGate(cfg.cluster.driver_stall_timeout_s, is_driver=is_driver,
                          progress=self.book.finished_requests)
        gate.start()
        torch.manual_seed(cfg.trainer.seed)
        # every weight is loaded next (the checkpoint, model.megatron_path or the HF weights)
        self.learner = MegatronLearner(cfg, str(self.model_dir), self.layout, initialize=False)
        # what the driver hands over travels on the host, a mixture's experts each DP rank its share
        self.role = LearnerRankRole(gate, D.host_group(), ExpertHandOver.build(cfg, self.layout, self.learner.info.shape,
                                                                              DRIVER_RANK))
        if not self.run.resume(self.learner):
            self._load_initial_weights()
        if is_driver:
            self.role = self._start_driver()
        self.policy_sync = PolicySync.start(cfg, self.layout, self.role, self.engine_urls,
                                            incarnations=self._engine_incarnations if is_driver else None)
        self.probe = WeightProbe(cfg, self.role, self.learner, str(self.model_dir))

    def _engine_incarnations(self) -> Dict[str, str]:
        """Each engine's process (`weights/engine_memory.py`): as the engines role announced it
        in the registry, and for the engines this trainer started, their pids."""
        from dapo_mega.engines.process import engine_incarnations

        started = {e.url: f"pid {e.pid}" for e in self.fleet.engines} if self.fleet is not None else {}
        return {**engine_incarnations(self.cfg.rollout), **started}

    def _model_dir(self) -> Path:
        return model_dir_of(self.cfg)

    def _build_tiny_model(self) -> None:
        build_tiny_model(self.cfg, self.model_dir)

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
        from dapo_mega.data import PromptEncoder, PromptIterator, build_run_datasets
        from dapo_mega.environments.base import environment_report
        from dapo_mega.models.shape import ModelShape
        from dapo_mega.records.recorder import RunRecorder
        from dapo_mega.reward import build_verifier
        from dapo_mega.rollout.manager import RolloutManager
        from dapo_mega.rollout.source import RolloutSource

        cfg, state = self.cfg, self.run.state
        logger.info(self.run.identity.start_line(self.run_dir))
        encoder = PromptEncoder.from_pretrained(self.model_dir, cfg.data)
        data_report: Dict[str, object] = {}
        train_problems, eval_sets, revision = build_run_datasets(cfg.data, cfg.eval, report=data_report)
        skipped = {split: f"{r.num_skipped} {dict(r.skip_reasons)}" for split, r in data_report.items()
                   if getattr(r, "num_skipped", 0)}
        held_out = ", ".join(f"{s.name + ' ' if s.name else ''}{len(s.problems)}" for s in eval_sets) or "0"
        logger.info(f"[data] {len(train_problems)} train / {held_out} held-out problems, revision "
                    f"{revision}; bad rows skipped (data.on_bad_row=skip): {skipped or 'none'}")
        prompts = PromptIterator(train_problems, seed=cfg.data.seed, shuffle=cfg.data.shuffle, revision=revision)
        self.engine_urls = self._start_engines()
        self.book.add(self.fleet.endpoints)
        # a mixture: replay needs every request's experts, the agreement metric a share
        manager = RolloutManager.from_config(cfg, self.book, "train", encoder, run_id=self.run.run_id,
                                             dataset_revision=revision, routed_experts_every=engine_experts_every(
                                                 cfg, self.fleet, ModelShape.from_hf_config(str(self.model_dir)).is_moe))
        rollouts = RolloutSource(cfg, prompts, encoder, build_verifier(cfg.algo.verifier, cfg.algo.reward_kwargs), manager)
        environment = environment_report(manager.settings.environment)
        if environment:  # what this host gives the environment (the sandbox's isolation), kept with the run
            add_to_run_file(self.run_dir, environment=environment)
        if self.run.resumed:  # steps after the checkpoint are redone: their records go (metrics: RunRecorder)
            logger.info(f"[trainer] resumed from {self.run.checkpoint} at step {state.step}, policy version "
                        f"{state.policy_version}")
            rollouts.load_state_dict(state.data_cursor, state.rollout_carry)
            if cfg.trainer.resume_step:  # a restart from an earlier step: later steps' files are kept aside
                label = f"after_step_{state.step}_{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
                kept = set_aside_after(self.run_dir, state.step, label)
                if kept is not None:
                    logger.info(f"[trainer] trainer.resume_step={state.step}: the later checkpoints, ledger shards "
                                f"and eval files moved to {kept}")
            prune_records_after(self.run_dir, state.step)
        recorder = RunRecorder(self.run_dir, cfg.trainer.run_name, {**config_dict(cfg), "run_id": self.run.run_id},
                               state.step, wandb_mode=cfg.trainer.wandb_mode, wandb_project=cfg.trainer.wandb_project,
                               wandb_run_id=state.wandb_run_id, plot=cfg.trainer.plot,
                               plot_interval_s=cfg.trainer.plot_interval_s, run_id=self.run.run_id,
                               restore_row=state.metrics_row if self.run.resumed else None)
        state.wandb_run_id = recorder.wandb_run_id
        sft_prompts = PromptIterator(train_problems, seed=cfg.data.seed + 1)
        return DriverRole(cfg, self.run, rollouts, sft_prompts, eval_sets, recorder, self.role.gate,
                          self.role.host_group, self.role.experts)

    def _start_engines(self) -> List[str]:
        """Engines given by URL, announced in a registry directory, or started here (the fleet)."""
        from dapo_mega.engines.fleet import open_fleet
        from dapo_mega.plan.clock import resolve_health_timeout_s

        self.fleet = open_fleet(self.cfg, self.cfg.rollout.model_path or str(self.model_dir), self.run_dir / "logs",
                                weight_version=str(self.state.policy_version), learner_ranks=self.layout.world_size,
                                start_timeout_s=resolve_health_timeout_s(self.cfg))
        self.engines = self.fleet.engines
        return [e.url for e in self.fleet.endpoints]

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

    def sync_weights(self, step: Optional[int] = None, row: Optional[Dict[str, float]] = None) -> Dict[str, float]:
        """Push the learner's weights into every engine as version `state.policy_version`, then
        check that they hold it (`driver.weight_probe`: stops the run when one does not). A
        check that stops the run writes step `step`'s metrics `row` first (with
        `check/weights_failed` 1): the step that went wrong is in metrics.jsonl."""
        from dapo_mega.driver.weight_probe import WeightCheckError

        version = self.run.state.policy_version
        metrics = self.policy_sync.push(self.learner, version)
        try:
            metrics.update(self.probe.after_sync(self.learner, self.policy_sync.synced_engine_urls(),
                                                 self.engine_urls, version, self.policy_sync.sent_checksums))
        except WeightCheckError:
            if step is not None:
                self.role.log_step(step, {**(row or {}), **metrics, "check/weights_failed": 1.0}, {})
            raise
        return metrics

    def save_checkpoint(self, step: int, row: Optional[Dict[str, float]] = None) -> None:
        """Weights, optimizer, RNG and trainer state of `step` (collective); `row`, the step's
        metrics row as it stands, goes in too (the driver's): a resume writes it if the run
        ended before it did (killed right after the save, or an evaluation beside the next step)."""
        state = self.role.checkpoint_state()
        if row is not None and self.role.is_driver:
            state = {**state, "metrics_row": {"policy_version": self.run.state.policy_version, **row}}
        self.run.save(self.learner, step, state)

    def export_hf(self, step: int) -> Dict[str, float]:
        """The learner's weights as the HF checkpoint `<run_dir>/hf/step_<N>/` (collective), with
        the config and tokenizer files of the model directory the run started from (the ones
        its engines and prompt encoder load); its cost as metrics on the driver."""
        from dapo_mega.weights.convert import read_hf_config_dict

        return self.run.export_hf(self.learner, step, read_hf_config_dict(self.model_dir), self.model_dir)

    # ================================================================== shutdown
    def close(self) -> None:
        self.role.close()
        if self.policy_sync is not None:
            self.policy_sync.close()
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


def engine_experts_every(cfg: DapoConfig, fleet: "EngineFleet", moe: bool) -> int:
    """One request in this many asks the engines for each token's routed experts
    (`config.routed_experts_every`); 0 for a dense model or engines that do not report them
    (`EngineFleet.returns_routed_experts`: started here on a mixture, or attached ones started
    with --enable-return-routed-experts as the registry or their /server_info says). Routing
    replay with such engines is refused here, before any step: it would replay nothing."""
    if not moe:
        return 0
    if fleet.returns_routed_experts:
        return routed_experts_every(cfg)
    r = cfg.rollout
    where = (f"rollout.engine_urls={list(r.engine_urls)} answer /server_info without enable_return_routed_experts"
             if r.engine_urls else
             f"the engines announced in rollout.engine_registry={r.engine_registry} were started without it"
             if r.engine_registry else
             f"the trainer's engines serve {fleet.model_path}, whose config.json is no mixture of experts")
    if cfg.algo.routing_replay:
        raise ConfigError(f"algo.routing_replay=true, but the engines report no routed experts: {where}. Fix: start "
                          "them with --enable-return-routed-experts (rollout.extra_server_args; the Slurm engines "
                          "role and the trainer's own engines pass it for a mixture of experts), or set "
                          "algo.routing_replay=false")
    logger.warning(f"[trainer] moe/router_agreement stays NaN: the engines report no routed experts ({where}; "
                   "--enable-return-routed-experts)")
    return 0


def model_dir_of(cfg: DapoConfig) -> Path:
    """The HF directory the run's model comes from: `model.hf_path`, else `<run_dir>/base_model`
    (the tiny model, built there by `build_tiny_model` when missing)."""
    if cfg.model.hf_path:
        path = Path(cfg.model.hf_path)
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"model.hf_path={path}: no config.json there. Fix: point model.hf_path at "
                                    "a Hugging Face checkpoint directory")
        return path
    return cfg.run_dir / "base_model"


def build_tiny_model(cfg: DapoConfig, model_dir: Path) -> None:
    """The tiny model's HF files in `model_dir` (deterministic in `megatron.seed`)."""
    from dapo_mega.models.tiny import build_tiny_model_in_place

    build_tiny_model_in_place(model_dir, cfg.model, cfg.megatron.seed)
