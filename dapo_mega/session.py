"""Everything the driver loop (`trainer.py`) touches, built once per run.

`Session.start(cfg)` on every learner rank: process groups and the parallel layout, the
run directory, the Megatron learner with its initial weights (latest checkpoint of the run,
else `model.megatron_path`, else the HF weights), and on global rank 0 (the driver) the
data, the verifier, the rollout engines and their manager, the ledger and the records.
Ranks that are the weight source of a pipeline stage also get a `WeightSyncer`.

Only the driver talks to engines and writes records; `share_with_learners` hands each
step's samples to the other ranks. Policy versions: the learner's version is the number of
optimizer steps it has synced; engines report the version of every token they produce.
"""

from __future__ import annotations

import os
import queue
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from dapo_mega.config import DapoConfig, save_config, validate_config
from dapo_mega.rollout.processes import free_port

DRIVER_RANK = 0


@dataclass
class TrainerState:
    """What a checkpoint must carry besides weights and optimizer state."""

    step: int = 0
    policy_version: int = 0
    data_cursor: Optional[Dict[str, Any]] = None
    rollout_carry: Optional[Dict[str, Any]] = None
    wandb_run_id: Optional[str] = None
    warm_started: bool = False


@dataclass
class RolloutBatch:
    """One step's rollout on the driver (empty elsewhere)."""

    step: int = 0
    groups: List[Any] = field(default_factory=list)
    records: List[Any] = field(default_factory=list)
    metrics: Dict[str, float] = field(default_factory=dict)
    data_cursor: Optional[Dict[str, Any]] = None
    rollout_carry: Optional[Dict[str, Any]] = None


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


def _barrier() -> None:
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()


def _broadcast(obj: Any) -> Any:
    """Driver -> all learner ranks (inside the trusted learner group only)."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=DRIVER_RANK)
    return box[0]


class Session:
    """Components of one run on one learner rank; see the module docstring."""

    def __init__(self, cfg: DapoConfig):
        self.cfg = cfg
        self.run_dir = cfg.run_dir
        self.state = TrainerState()
        self.resumed = False
        self.engines: List[Any] = []
        self.engine_urls: List[str] = []
        self.manager = None
        self.syncer = None
        self.recorder = None
        self.producer: Optional[AsyncRollouts] = None
        self.prompts_too_long = 0

    # ================================================================== start-up
    @classmethod
    def start(cls, cfg: DapoConfig) -> "Session":
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
        self.is_driver = int(os.environ["RANK"]) == DRIVER_RANK
        if self.is_driver:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            save_config(cfg, self.run_dir)
        self.model_dir = self._model_dir()
        if not (self.model_dir / "config.json").exists():
            self._build_tiny_model()
        self.layout = ParallelLayout.from_config(cfg.megatron, world_size, hf_config=str(self.model_dir))
        self.layout.initialize(timeout_s=cfg.cluster.dist_timeout_s)
        torch.manual_seed(cfg.trainer.seed)
        self.learner = MegatronLearner(cfg, str(self.model_dir), self.layout)
        self._load_initial_weights()
        if self.is_driver:
            self._start_driver()
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
        from dapo_mega.backends.megatron.checkpoint import find_latest_checkpoint, load_checkpoint

        latest = find_latest_checkpoint(self.run_dir) if self.cfg.trainer.resume else None
        if latest is not None:
            raw = load_checkpoint(self.learner, latest)
            known = {k: raw[k] for k in asdict(TrainerState()) if k in raw}
            self.state = TrainerState(**known)
            self.resumed = True
            if self.is_driver:
                print(f"[trainer] resumed from {latest} at step {self.state.step}, policy version "
                      f"{self.state.policy_version}", flush=True)
            return
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

    def _start_driver(self) -> None:
        from transformers import AutoTokenizer

        from dapo_mega.data import PromptEncoder, PromptIterator, Problem, build_datasets
        from dapo_mega.records import RunRecorder
        from dapo_mega.reward import build_verifier
        from dapo_mega.backends.sglang.client import build_sampling_params
        from dapo_mega.rollout.manager import RolloutManager

        cfg = self.cfg
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.encoder = PromptEncoder.from_config(self.tokenizer, cfg.data)
        data_report: Dict[str, Any] = {}
        self.train_problems, self.eval_problems, self.revision = build_datasets(cfg.data, report=data_report)
        skipped = {split: f"{r.num_skipped} {dict(r.skip_reasons)}" for split, r in data_report.items()
                   if getattr(r, "num_skipped", 0)}
        print(f"[data] {len(self.train_problems)} train / {len(self.eval_problems)} held-out problems, revision "
              f"{self.revision}; bad rows skipped (data.on_bad_row=skip): {skipped or 'none'}", flush=True)
        if cfg.eval.max_problems:
            self.eval_problems = self.eval_problems[:cfg.eval.max_problems]
        self.prompts = PromptIterator(self.train_problems, seed=cfg.data.seed, shuffle=cfg.data.shuffle,
                                      revision=self.revision)
        self.verifier = build_verifier(cfg.algo.verifier)
        self.engine_urls = self._start_engines()
        sampling = build_sampling_params(temperature=cfg.algo.temperature, top_p=cfg.algo.top_p,
                                         top_k=cfg.algo.top_k, max_new_tokens=cfg.algo.max_response_length)
        self.manager = RolloutManager(self.engine_urls, cfg.algo.n_samples_per_prompt, sampling,
                                      api_key=cfg.rollout.api_key, request_timeout_s=cfg.rollout.request_timeout_s,
                                      max_retries=cfg.rollout.max_retries, run_id=cfg.trainer.run_name,
                                      prompt_to_input=self.prompt_input_ids, seed=cfg.trainer.seed)
        if self.resumed:
            if self.state.data_cursor:
                self.prompts.load_state_dict(self.state.data_cursor)
            if self.state.rollout_carry:
                self.manager.load_state_dict(self.state.rollout_carry, lambda d: Problem(**_problem_fields(d)))
            self._drop_records_after(self.state.step)
        self.recorder = RunRecorder(self.run_dir, cfg.trainer.run_name, _config_dict(cfg), self.state.step,
                                    wandb_mode=cfg.trainer.wandb_mode, wandb_project=cfg.trainer.wandb_project,
                                    wandb_run_id=self.state.wandb_run_id, plot=cfg.trainer.plot)
        self.state.wandb_run_id = self.recorder.wandb_run_id

    def _start_engines(self) -> List[str]:
        """Engines given by URL, announced in a registry directory, or started here."""
        cfg = self.cfg.rollout
        if cfg.engine_urls:
            return list(cfg.engine_urls)
        if cfg.engine_registry:
            return _wait_for_registry(Path(cfg.engine_registry), cfg.num_engines, cfg.health_timeout_s)
        from dapo_mega.rollout.processes import EngineProcess

        model_path = cfg.model_path or str(self.model_dir)
        logs = self.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        if cfg.backend == "sglang":
            return self._start_sglang_engines(model_path, logs)
        threads = max(1, (os.cpu_count() or 2) // max(1, cfg.num_engines))
        for i in range(cfg.num_engines):
            self.engines.append(EngineProcess(model_path, api_key=cfg.api_key, weight_version=str(self.state.policy_version),
                                              log_path=str(logs / f"engine-{i}.log"), num_threads=threads,
                                              health_timeout_s=cfg.health_timeout_s))
        for engine in self.engines:
            engine.wait_healthy()
        return [e.url for e in self.engines]

    def _start_sglang_engines(self, model_path: str, logs: Path) -> List[str]:
        from dapo_mega.backends.sglang.launch import build_engine_command, wait_for_health

        urls = []
        for i in range(self.cfg.rollout.num_engines):
            port = self.cfg.rollout.base_port + i if self.cfg.rollout.base_port else free_port()
            argv = build_engine_command(self.cfg.rollout, model_path, port, weight_version=str(self.state.policy_version))
            log = open(logs / f"engine-{i}.log", "wb")
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
            self.engines.append(_PopenEngine(proc, f"http://{self.cfg.rollout.host}:{port}"))
        for engine in self.engines:
            wait_for_health(engine.url, self.cfg.rollout.health_timeout_s, api_key=self.cfg.rollout.api_key,
                            process=engine.proc)
            urls.append(engine.url)
        return urls

    def _start_syncer(self) -> None:
        """Weight sources of each PP stage join a weight-update group with the engines."""
        from dapo_mega.weights.sync import WeightSyncer

        urls = _broadcast(self.engine_urls if self.is_driver else None)
        self.engine_urls = urls
        needs_syncer = (self.layout.dp_rank == 0 and self.layout.is_weight_source) or self.is_driver
        if not needs_syncer:
            return
        local = all(u.startswith(("http://127.0.0.1", "http://localhost")) for u in urls)
        colocated = self.cfg.cluster.mode == "colocated" and local
        self.syncer = WeightSyncer(urls, api_key=self.cfg.rollout.api_key, bucket_mb=self.cfg.rollout.weight_sync_bucket_mb,
                                   mode="colocated" if colocated else "distributed",
                                   backend="nccl" if torch.cuda.is_available() else "gloo",
                                   # DAPO_MEGA_SYNC_ADDR: this node's Slurm NodeAddr (dapo_mega.launch);
                                   # the hostname can resolve to a loopback alias
                                   master_address="127.0.0.1" if local else (os.environ.get("DAPO_MEGA_SYNC_ADDR")
                                                                             or socket.gethostbyname(socket.gethostname())),
                                   engine_tp_size=self.cfg.rollout.engine_tp_size,
                                   timeout_s=self.cfg.rollout.request_timeout_s)
        if not colocated and self.layout.is_weight_source:
            self.syncer.init_group(free_port(), stage=self.layout.pp_rank)

    # ================================================================== prompts and rewards
    def prompt_input_ids(self, problem) -> List[int]:
        """Token ids of a problem's prompt (`data.PromptEncoder`, the one `dapo-mega eval` uses):
        the engines and the learner see the same."""
        return self.encoder.encode(problem)

    def _next_prompts(self, n: int) -> List[Any]:
        """n problems whose prompts fit max_prompt_length (longer ones are skipped, counted)."""
        out: List[Any] = []
        for _ in range(100):
            for p in self.prompts.next_batch(n - len(out)):
                if len(self.prompt_input_ids(p)) <= self.cfg.algo.max_prompt_length:
                    out.append(p)
                else:
                    self.prompts_too_long += 1
            if len(out) == n:
                return out
        raise RuntimeError(f"could not find {n} prompts within algo.max_prompt_length="
                           f"{self.cfg.algo.max_prompt_length} tokens. Fix: raise algo.max_prompt_length")

    def score_groups(self, groups) -> List[List[Dict[str, Any]]]:
        """Verifier + overlong penalty for every sample of every group (reward_fn of the manager)."""
        from dapo_mega.data import verification_prefix
        from dapo_mega.reward import compute_rewards

        samples = [(g, s) for g in groups for s in g.samples]
        if not samples:
            return [[] for _ in groups]
        batch = compute_rewards(self.verifier, [s.text for _, s in samples],
                                [g.prompt.ground_truth for g, _ in samples],
                                [len(s.token_ids) for _, s in samples], self.cfg.algo,
                                answer_prefixes=[verification_prefix(g.prompt, self.cfg.data.prompt_template)
                                                 for g, _ in samples])
        prev = getattr(self, "_verifier_stats", None)
        self._verifier_stats = batch.stats if prev is None else _sum_verify_stats(prev, batch.stats)
        out: List[List[Dict[str, Any]]] = []
        k = 0
        for g in groups:
            rows = []
            for _ in g.samples:
                rec = batch.record(k)
                rows.append({"reward": rec["reward"], "correct": rec["correct"], "error": rec["verifier_error"],
                             "verifier": rec["verifier_name"], "verifier_version": rec["verifier_version"],
                             "components": {"correctness": rec["correctness"],
                                            "overlong_penalty": rec["overlong_penalty"]}})
                k += 1
            out.append(rows)
        return out

    # ================================================================== the loop's verbs
    def warm_start(self) -> None:
        """Supervised steps on reference answers so that the tiny model's rewards are informative."""
        from dapo_mega.backends.megatron.batch import TrainSample
        from dapo_mega.data import PromptIterator

        cfg = self.cfg.trainer
        it = PromptIterator(self.train_problems, seed=self.cfg.data.seed + 1) if self.is_driver else None
        start = time.perf_counter()
        for k in range(cfg.sft_warmup_steps):
            samples = None
            if self.is_driver:
                eos = self.encoder.eos_token_id
                samples = [TrainSample(prompt_ids=self.prompt_input_ids(p),
                                       response_ids=self.encoder.encode_text(" " + p.ground_truth) + [eos])
                           for p in it.next_batch(cfg.sft_batch_size)]
            samples = _broadcast(samples)
            metrics = self.learner.sft_step(samples, lr=cfg.sft_lr)
            if self.is_driver and (k + 1) % max(1, cfg.sft_warmup_steps // 10) == 0:
                print(f"[warm start] {k + 1}/{cfg.sft_warmup_steps} loss {metrics['sft/loss']:.4f} "
                      f"({time.perf_counter() - start:.0f} s)", flush=True)
        self.state.warm_started = True

    def start_async_rollouts(self) -> None:
        c = self.cfg.cluster
        if self.is_driver and c.mode == "disaggregated" and c.max_staleness > 0:
            self.producer = AsyncRollouts(self, first_step=self.state.step + 1)

    def collect(self, step: int, learner_version: int) -> RolloutBatch:
        """Generate, score and filter one step's groups (driver only)."""
        a = self.cfg.algo
        t = time.perf_counter()
        self._verifier_stats = None  # this step's rounds only (score_groups sums them)
        # Surplus groups carried from an older version obey max_staleness too: in the
        # synchronous modes (0) they are dropped as `stale`, so every trained sample is on-policy.
        groups, records = self.manager.collect_step(
            step, learner_version, self._next_prompts, self.score_groups, a.train_batch_size, a.gen_batch_size,
            dynamic_sampling=a.dynamic_sampling, max_num_gen_batches=a.max_num_gen_batches,
            max_staleness=self.cfg.cluster.max_staleness)
        seconds = time.perf_counter() - t
        from dapo_mega.rollout.metrics import compute_rollout_metrics

        metrics = compute_rollout_metrics(records, seconds)
        metrics.update(self.manager.metrics)
        metrics["data/prompts_too_long"] = float(self.prompts_too_long)
        stats = getattr(self, "_verifier_stats", None)
        if stats is not None:
            metrics.update(stats.as_metrics())
        return RolloutBatch(step=step, groups=groups, records=records, metrics=metrics,
                            data_cursor=self.prompts.state_dict(), rollout_carry=self.manager.state_dict())

    def next_rollout_batch(self, step: int) -> RolloutBatch:
        if not self.is_driver:
            return RolloutBatch(step=step)
        if self.producer is None:
            return self.collect(step, self.state.policy_version)
        from dapo_mega.rollout.manager import drop_stale_groups

        batch = self.producer.get(step)
        fresh, stale = drop_stale_groups(batch.groups, self.state.policy_version, self.cfg.cluster.max_staleness)
        batch.records = [r for r in batch.records if r.reject_reason != "kept"] + \
            [r for g in fresh + stale for r in self.manager.records_of(g, step, self.state.policy_version)]
        batch.groups = fresh
        from dapo_mega.rollout.metrics import compute_age_metrics

        batch.metrics.update(compute_age_metrics(batch.records, len(stale)))
        return batch

    def build_train_samples(self, batch: RolloutBatch) -> Optional[list]:
        """Group-relative advantages (Eq. 9) and token lists of the kept groups (driver)."""
        if not self.is_driver:
            return None
        from dapo_mega.algo import compute_group_advantages
        from dapo_mega.backends.megatron.batch import TrainSample

        rewards = torch.tensor([r["reward"] for g in batch.groups for r in g.rewards], dtype=torch.float32)
        index = torch.tensor([i for i, g in enumerate(batch.groups) for _ in g.samples])
        if rewards.numel() == 0:
            return []
        adv = compute_group_advantages(rewards, index, eps=self.cfg.algo.adv_eps,
                                       normalize_std=self.cfg.algo.normalize_adv_std)
        samples, k = [], 0
        for g in batch.groups:
            prompt_ids = self.prompt_input_ids(g.prompt)
            for s in g.samples:
                masked = self.cfg.algo.overlong_filter and s.truncated
                samples.append(TrainSample(prompt_ids=prompt_ids, response_ids=list(s.token_ids),
                                           advantage=float(adv[k]), engine_log_probs=s.logprobs,
                                           loss_mask=[0] * len(s.token_ids) if masked else None))
                k += 1
        return samples

    def share_with_learners(self, samples: Optional[list]) -> list:
        return _broadcast(samples)

    def drop_dead_engines(self) -> None:
        """Engines the rollout manager found dead (no reply within rollout.request_timeout_s,
        connection refused) leave the weight sync too, so a lost engine costs the run its share
        of generation and nothing else. Collective: every learner rank calls it."""
        dead = _broadcast(sorted(self.manager.dead) if self.is_driver and self.manager is not None else [])
        if self.syncer is None or not dead:
            return
        for url in self.syncer.drop_engines(dead):
            if self.is_driver:
                print(f"[trainer] engine {url} dropped from rollouts and weight sync: {self.manager.dead[url]}",
                      file=sys.stderr, flush=True)

    def engines_release_memory(self) -> None:
        self.drop_dead_engines()
        if self.is_driver and self.cfg.cluster.mode == "colocated" and self.syncer is not None:
            self.syncer.release_engine_memory()

    def engines_resume_memory(self) -> None:
        if self.is_driver and self.cfg.cluster.mode == "colocated" and self.syncer is not None:
            self.syncer.resume_engine_memory()

    def sync_weights(self) -> Dict[str, float]:
        """Push the learner's weights into every engine as version `state.policy_version`."""
        from dapo_mega.weights.sync import sync_learner_weights

        self.drop_dead_engines()
        stats = sync_learner_weights(self.syncer, self.learner.model_chunks, self.learner.info, self.layout,
                                     str(self.state.policy_version))
        metrics = stats.as_metrics() if stats is not None else {}
        if self.is_driver and self.syncer is not None:
            metrics["sync/engines"] = len(self.syncer.clients)
        return metrics

    def write_ledger(self, step: int, batch: RolloutBatch) -> None:
        if self.is_driver:
            from dapo_mega.rollout.ledger import write_step

            write_step(self.run_dir, step, batch.records)
            self._last_batch = batch

    def should_eval(self, step: int) -> bool:
        n = self.cfg.trainer.eval_interval
        return n > 0 and (step % n == 0 or step == self.cfg.trainer.total_steps)

    def should_save(self, step: int) -> bool:
        n = self.cfg.trainer.save_interval
        return (n > 0 and step % n == 0) or step == self.cfg.trainer.total_steps

    def evaluate(self) -> Dict[str, float]:
        """avg@k on the held-out set through the same engines (driver); {} elsewhere."""
        if not self.is_driver or not self.eval_problems:
            return {}
        from dapo_mega.evaluate import evaluate_problems

        result = evaluate_problems(self.manager.alive_engines(), self.eval_problems, self.cfg, self.prompt_input_ids,
                                   self.verifier, api_key=self.cfg.rollout.api_key)
        result.write(self.run_dir / "eval" / f"step_{self.state.step:06d}.json")
        print(f"[eval] step {self.state.step}: avg@{result.k} = {result.avg_at_k:.4f} on "
              f"{len(result.problems)} problems", flush=True)
        return result.metrics()

    def save_checkpoint(self, step: int) -> None:
        from dapo_mega.backends.megatron.checkpoint import save_checkpoint

        state = dict(asdict(self.state))
        if self.is_driver:
            batch = getattr(self, "_last_batch", None)
            state["data_cursor"] = batch.data_cursor if batch and batch.data_cursor else self.prompts.state_dict()
            state["rollout_carry"] = batch.rollout_carry if batch and batch.rollout_carry else self.manager.state_dict()
        save_checkpoint(self.learner, self.run_dir, step, state, keep_last_k=self.cfg.trainer.keep_last_k)

    def log_step(self, step: int, metrics: Dict[str, Any], timings: Dict[str, float]) -> None:
        if not self.is_driver:
            return
        row = {"policy_version": self.state.policy_version, **metrics, **timings}
        if "time/train_s" in timings and "perf/train_tokens" in metrics:
            row["perf/train_tokens_per_s"] = metrics["perf/train_tokens"] / max(timings["time/train_s"], 1e-9)
        self.recorder.log_step(step, row)

    def _drop_records_after(self, step: int) -> None:
        """On resume: ledger shards of steps after the checkpoint are redone, not kept twice."""
        from dapo_mega.rollout.ledger import ledger_dir

        for path in ledger_dir(self.run_dir).glob("step_*.parquet"):
            if int(path.stem.split("_")[1]) > step:
                path.unlink()
        eval_dir = self.run_dir / "eval"
        if eval_dir.exists():
            for path in eval_dir.glob("step_*.json"):
                if int(path.stem.split("_")[1]) > step:
                    path.unlink()

    # ================================================================== shutdown
    def close(self) -> None:
        if self.producer is not None:
            self.producer.stop()
        if self.syncer is not None:
            try:
                self.syncer.close()
            except Exception as exc:  # an engine already gone must not hide the real error
                print(f"[trainer] closing the weight syncer: {exc}", file=sys.stderr)
        for engine in self.engines:
            engine.kill()
        if self.recorder is not None:
            self.recorder.close()
        try:
            from dapo_mega.reward.scoring import close_verifier_pools

            close_verifier_pools()
        except ImportError:
            pass
        if torch.distributed.is_initialized():
            layout = getattr(self, "layout", None)
            if layout is not None:
                layout.destroy()
            else:
                torch.distributed.destroy_process_group()


class AsyncRollouts:
    """Generation running ahead of training (disaggregated, max_staleness = k > 0).

    Batch b is started only once the learner's version is at least b - 1 - k, so that when
    it is consumed (at version b - 1) no token is more than k versions old — except tokens
    of groups carried over by dynamic sampling, which `drop_stale_groups` catches.
    """

    def __init__(self, session: Session, first_step: int):
        self.session = session
        self.k = session.cfg.cluster.max_staleness
        self.ready: "queue.Queue" = queue.Queue()
        self._stop = threading.Event()
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, args=(first_step,), name="rollouts", daemon=True)
        self._thread.start()

    def _run(self, first_step: int) -> None:
        s = self.session
        try:
            for step in range(first_step, s.cfg.trainer.total_steps + 1):
                while s.state.policy_version < step - 1 - self.k:
                    if self._stop.wait(0.05):
                        return
                if self._stop.is_set():
                    return
                self.ready.put(s.collect(step, s.state.policy_version))
        except BaseException as exc:  # handed to the main thread by get()
            self._error = exc
            self.ready.put(None)

    def get(self, step: int, timeout_s: float = 3600.0) -> RolloutBatch:
        batch = self.ready.get(timeout=timeout_s)
        if batch is None:
            raise RuntimeError(f"rollout thread failed: {self._error}") from self._error
        if batch.step != step:
            raise RuntimeError(f"rollout batch of step {batch.step} arrived for step {step}")
        return batch

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


class _PopenEngine:
    """An SGLang server process started by the trainer."""

    def __init__(self, proc: subprocess.Popen, url: str):
        self.proc, self.url = proc, url

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


def _wait_for_registry(directory: Path, count: int, timeout_s: float) -> List[str]:
    """URLs of `count` engines announced as `engine-<i>.json` files in `directory`."""
    import json

    deadline = time.monotonic() + timeout_s
    while True:
        files = sorted(directory.glob("engine-*.json")) if directory.exists() else []
        if len(files) >= count:
            return [json.loads(f.read_text())["url"] for f in files[:count]]
        if time.monotonic() > deadline:
            raise TimeoutError(f"rollout.engine_registry={directory}: {len(files)} of {count} engines announced "
                               f"after {timeout_s:.0f} s. Fix: check the engine role's log")
        time.sleep(0.5)


def _sum_verify_stats(a, b):
    """Verifier counts of two scoring rounds of one step (max of the per-item maximum)."""
    from dataclasses import fields, replace

    summed = {f.name: getattr(a, f.name) + getattr(b, f.name) for f in fields(a)}
    return replace(a, **{**summed, "max_item_seconds": max(a.max_item_seconds, b.max_item_seconds)})


def _problem_fields(d: Dict[str, Any]) -> Dict[str, Any]:
    d = dict(d)
    if isinstance(d.get("messages"), list):
        d["messages"] = tuple(d["messages"])
    return d


def _config_dict(cfg: DapoConfig) -> Dict[str, Any]:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)  # type: ignore[return-value]

