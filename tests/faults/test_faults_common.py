"""Fault injection for the trainer fault tests (test-only; holds no tests itself).

    python tests/faults/test_faults_common.py --fault kill:train:3 [--fault ...] -- <hydra overrides>

runs `dapo-mega train <overrides>` in this process after patching the named phase, so the
fault hits a deterministic point of a real run without any hook in the product code:

    kill:generate:N       SIGKILL this process after the first /generate reply of step N
    kill:train:N          SIGKILL after the first optimizer update of step N (half-trained)
    kill:save:N           SIGKILL after checkpoint step N's model/optimizer files are written,
                          before the checkpoint is renamed into place
    kill:saved:N          SIGKILL once checkpoint step N is in place, before step N's metrics row
    nan:N                 every advantage of step N is NaN (NaN loss and gradients)
    enospc:N              checkpoint step N's writer raises OSError(ENOSPC)
    engine:SIG:K:N        send SIG (KILL or STOP) to engine K just before its first /generate
                          request of step N (the other engines' first requests wait for it,
                          up to 10 s, so that engine K surely takes a chunk)
    engine:CONT:K:N       SIGCONT to (stopped) engine K at the first /generate request of step N
    engine:SIG:K:N:inflight  the same, but once that request is in flight: sent, and (SGLang)
                          its prefill logged by the engine; prints whether it was still in flight
                          and whether any process of the engine (SGLang: launch process,
                          scheduler, detokenizer) outlived the fault
    engine:SIG:K:N:inflight-scheduler  the same, sent to SGLang's scheduler process instead
    engine:KILL:K:N:sync  SIGKILL to engine K in the weight sync after step N, as the learner
                          POSTs it its first bucket (the engines are paused in the sync's
                          session, the other engines' POSTs already wait in the broadcast)
    engine:RESTART:K:N    engine K is killed after step N's first optimizer update and started
                          again at its port (rollout.base_port), as the Slurm engines role does:
                          the colocated engines are released then, and the new process holds its
                          memory (weights/engine_memory.py)
    verifier:RAISE:HANG   the verifier raises on ground truths in RAISE and never returns on
                          those in HANG (comma-separated; it runs in the verifier pool)

The trainer runs with one learner process, so everything it does happens in this process
(engines and verifier workers are children). `run_trainer` starts this script with a
bounded wall time and returns the finished process.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

HERE = Path(__file__).resolve().parent

# A run small enough for 2 cores: 4 prompts x 4 samples per step, 2 optimizer updates per
# step, 16-token responses, no warm start, no eval, no wandb, no plot.
TINY_OVERRIDES = [
    "trainer.sft_warmup_steps=0", "trainer.eval_interval=0", "trainer.wandb_mode=disabled", "trainer.plot=false",
    "algo.n_samples_per_prompt=4", "algo.train_batch_size=4", "algo.gen_batch_size=4", "algo.mini_batch_size=2",
    "algo.dynamic_sampling=false", "algo.max_response_length=12", "algo.overlong_buffer_length=4",
    "megatron.micro_batch_tokens=512",
]


def run_trainer(output_dir: Path, run_name: str, overrides: Sequence[str] = (), faults: Sequence[str] = (),
                timeout_s: float = 240.0, learner_processes: int = 1) -> subprocess.CompletedProcess:
    """`dapo-mega train` with TINY_OVERRIDES + overrides and the given faults; never hangs.
    With `learner_processes` > 1, torchrun starts that many ranks of this script (each patches
    itself; the faults act on the driver, rank 0)."""
    argv = [sys.executable, str(HERE / "test_faults_common.py")]
    if learner_processes > 1:
        from dapo_mega.distributed import free_port

        argv[1:1] = ["-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(learner_processes),
                     "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    for fault in faults:
        argv += ["--fault", fault]
    argv += ["--", f"trainer.output_dir={output_dir}", f"trainer.run_name={run_name}", *TINY_OVERRIDES,
             *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get(
        "PYTHONPATH", "")]), "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("RANK", None)
    log_path = Path(output_dir) / f"{run_name}.{len(list(Path(output_dir).glob(run_name + '.*.log')))}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    # Output to a file, not a pipe: children of a SIGKILLed trainer (engines, megatron's
    # checkpoint helpers) would hold a pipe open. Its own session, so all of them can be ended.
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_orphans(proc.pid)
            proc.wait()
            raise AssertionError(f"trainer did not finish within {timeout_s} s:\n{log_path.read_text()[-4000:]}")
        finally:
            _kill_orphans(proc.pid)
    return subprocess.CompletedProcess(argv, proc.returncode, log_path.read_text(), "")


def _kill_orphans(pgid: int) -> None:
    """Engines and verifier workers of a SIGKILLed trainer outlive it: end its process group."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def read_metric_rows(run_dir: Path) -> List[Dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def load_checkpoint_tensors(step_dir: Path, prefix: str = "") -> Dict[str, "object"]:
    """Every tensor of a `step_<N>/model_optim` torch_dist checkpoint, read without megatron
    (torch.distributed.checkpoint's own reader: an independent view of what was saved)."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(Path(step_dir) / "model_optim"))
    meta = reader.read_metadata()
    state = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in meta.state_dict_metadata.items()
             if isinstance(v, TensorStorageMetadata) and k.startswith(prefix)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=reader)
    return state


def model_tensors(step_dir: Path) -> Dict[str, "object"]:
    return {k: v for k, v in load_checkpoint_tensors(step_dir).items() if not k.startswith("optimizer.")}


# --------------------------------------------------------------------------- the faults

_current_step = [0]


def _die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _install(fault: str) -> None:
    kind, _, rest = fault.partition(":")
    if kind == "kill":
        phase, step = rest.split(":")
        _install_kill(phase, int(step))
    elif kind == "nan":
        from dapo_mega.driver.roles import DriverRole

        step = int(rest)
        original = DriverRole.advantage_step

        def advantage_step(self, batch):
            samples = original(self, batch)
            if samples and batch.step == step:
                for s in samples:
                    s.advantage = float("nan")
            return samples
        DriverRole.advantage_step = advantage_step
    elif kind == "enospc":
        from dapo_mega.backends.megatron import checkpoint as C
        from dapo_mega.run_files.checkpoints import step_dir_name

        step = int(rest)
        original = C.save_dist_checkpoint

        def save_dist_checkpoint(state, ckpt_dir):
            if step_dir_name(step) in str(ckpt_dir):
                raise OSError(errno.ENOSPC, "No space left on device", str(ckpt_dir))
            return original(state, ckpt_dir)
        C.save_dist_checkpoint = save_dist_checkpoint
    elif kind == "engine" and rest.startswith("RESTART:"):
        _, k, step = rest.split(":")
        _install_engine_restart(int(k), int(step))
    elif kind == "engine":
        sig, k, step, *when = rest.split(":")
        if when == ["sync"]:
            _install_engine_sync_fault(getattr(signal, f"SIG{sig}"), int(k), int(step))
            return
        in_flight = when[0].partition("-")[2] if when and when[0].startswith("inflight") else None
        _install_engine_fault(getattr(signal, f"SIG{sig}"), int(k), int(step), in_flight=in_flight)
    elif kind == "verifier":
        raise_on, hang_on = rest.split(":")
        from test_faults_common import FaultyVerifier  # by module name: the pool's workers unpickle it

        import dapo_mega.reward as R

        R.VERIFIERS["dapo"] = lambda: FaultyVerifier(raise_on.split(","), hang_on.split(","))
    else:
        raise SystemExit(f"unknown fault {fault!r}")


def _track_steps() -> None:
    from dapo_mega.rollout.source import RolloutSource

    if getattr(RolloutSource.collect, "_tracked", False):
        return
    original = RolloutSource.collect

    def collect(self, step, learner_version):
        _current_step[0] = step
        return original(self, step, learner_version)
    collect._tracked = True
    RolloutSource.collect = collect


def _install_kill(phase: str, step: int) -> None:
    _track_steps()
    if phase == "generate":
        from dapo_mega.engines.sglang.client import EngineClient

        original = EngineClient.generate

        async def generate(self, *args, **kwargs):
            out = await original(self, *args, **kwargs)
            if _current_step[0] == step:
                print(f"[fault] SIGKILL during generation of step {step}", flush=True)
                _die()
            return out
        EngineClient.generate = generate
    elif phase == "train":
        from dapo_mega.backends.megatron.learner import MegatronLearner

        original = MegatronLearner._update

        def _update(self, *args, **kwargs):
            info = original(self, *args, **kwargs)
            if _current_step[0] == step:
                print(f"[fault] SIGKILL after the first update of step {step}", flush=True)
                _die()
            return info
        MegatronLearner._update = _update
    elif phase == "save":
        from dapo_mega.backends.megatron import checkpoint as C
        from dapo_mega.run_files.checkpoints import step_dir_name

        original = C.save_dist_checkpoint

        def save_dist_checkpoint(state, ckpt_dir):
            original(state, ckpt_dir)
            if step_dir_name(step) in str(ckpt_dir):
                print(f"[fault] SIGKILL while saving checkpoint step {step}", flush=True)
                _die()
        C.save_dist_checkpoint = save_dist_checkpoint
    elif phase == "saved":
        from dapo_mega.session import Session

        original_save = Session.save_checkpoint

        def save_checkpoint(self, at_step, *args, **kwargs):
            original_save(self, at_step, *args, **kwargs)
            if at_step == step:
                print(f"[fault] SIGKILL once checkpoint step {step} is in place", flush=True)
                _die()
        Session.save_checkpoint = save_checkpoint
    else:
        raise SystemExit(f"unknown phase {phase!r}")


def _capture_fleets() -> List:
    """The run's engine fleets, whoever in the trainer starts them."""
    from dapo_mega.engines.fleet import EngineFleet

    fleets: List = []
    original_start = EngineFleet.start

    def start(self, *args, **kwargs):
        fleets.append(self)
        return original_start(self, *args, **kwargs)
    EngineFleet.start = start
    return fleets


def _install_engine_restart(engine_index: int, step: int) -> None:
    from dapo_mega.backends.megatron.learner import MegatronLearner

    _track_steps()
    fleets = _capture_fleets()
    original = MegatronLearner._update
    done = [False]

    def _update(self, *args, **kwargs):
        info = original(self, *args, **kwargs)
        if _current_step[0] == step and not done[0]:
            done[0] = True
            old = fleets[0].get(engine_index)
            fleets[0].restart(engine_index)
            new = fleets[0].get(engine_index)
            print(f"[fault] engine {engine_index} ({old.url}) pid {old.pid} restarted during step {step}'s "
                  f"training as pid {new.pid} at {new.url}", flush=True)
        return info
    MegatronLearner._update = _update


def _install_engine_fault(sig: int, engine_index: int, step: int, in_flight: Optional[str] = None) -> None:
    """`in_flight`: None (before the request), "" (the engine's process, once the request is in
    flight) or a child's title after `sglang::` (that child instead)."""
    from dapo_mega.engines.sglang.client import EngineClient

    _track_steps()
    fleets = _capture_fleets()
    original = EngineClient.generate
    done = [False]
    signalled = [False]  # the in-flight fault acts on one request (several may go to engine K at once)

    async def generate(self, *args, **kwargs):
        import asyncio

        engine = fleets[0].engines[engine_index]
        if _current_step[0] == step and not done[0] and sig == signal.SIGCONT:  # a stopped engine gets no request
            done[0] = True
            print(f"[fault] SIGCONT to engine {engine_index} ({engine.url}) at step {step}", flush=True)
            os.kill(engine.proc.pid, sig)
        if _current_step[0] == step and not done[0]:
            if self.url == engine.url and in_flight is not None and not signalled[0]:
                signalled[0] = True
                return await _signal_in_flight(engine, engine_index, sig, step, original(self, *args, **kwargs), done,
                                               in_flight)
            if self.url == engine.url and in_flight is None:
                done[0] = True
                print(f"[fault] {signal.Signals(sig).name} to engine {engine_index} ({engine.url}) pid "
                      f"{engine.proc.pid} at step {step}", flush=True)
                os.kill(engine.proc.pid, sig)
            else:  # hold the other requests (engine K's later ones too) until the fault is done
                deadline = time.monotonic() + 10.0
                while not done[0] and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
        return await original(self, *args, **kwargs)
    EngineClient.generate = generate


def _install_engine_sync_fault(sig: int, engine_index: int, step: int) -> None:
    from dapo_mega.engines.sglang.client import EngineClient

    _track_steps()
    fleets = _capture_fleets()
    original = EngineClient.update_weights_from_distributed
    done = [False]

    async def update_weights_from_distributed(self, *args, **kwargs):
        engine = fleets[0].engines[engine_index]
        if _current_step[0] == step and not done[0] and self.url == engine.url:
            done[0] = True
            print(f"[fault] {signal.Signals(sig).name} to engine {engine_index} ({engine.url}) in the weight sync "
                  f"of step {step}", flush=True)
            os.kill(engine.proc.pid, sig)
            engine.proc.wait(timeout=30)
        return await original(self, *args, **kwargs)
    EngineClient.update_weights_from_distributed = update_weights_from_distributed


PREFILL_MARKERS = (b"Prefill batch",)
"""What an engine logs once a request reached its scheduler (SGLang 0.5.23's metrics reporter)."""


async def _signal_in_flight(engine, engine_index: int, sig: int, step: int, request, done: List[bool],
                            target: str = ""):
    """Send `request`; once the engine logged its prefill (at most 30 s), send `sig` to the
    engine's launch process, or (`target` "scheduler") to its child whose title is SGLang's
    `sglang::scheduler` (the biggest process, an OOM killer's pick); then report whether the
    request was still in flight and whether every process of the engine (launch process and
    children) exited (bounded wait). Returns (or raises) what the request does."""
    import asyncio

    import psutil

    offset = engine.log_path.stat().st_size
    task = asyncio.ensure_future(request)
    deadline = time.monotonic() + 30.0
    while not task.done() and time.monotonic() < deadline:
        with open(engine.log_path, "rb") as f:
            f.seek(offset)
            if any(m in f.read() for m in PREFILL_MARKERS):
                break
        await asyncio.sleep(0.02)
    launch = psutil.Process(engine.proc.pid)
    processes = [launch, *launch.children(recursive=True)]
    victim = launch
    if target:
        victim = next(c for c in processes[1:] if " ".join(c.cmdline()).startswith(f"sglang::{target}"))
    state = "with a /generate request in flight" if not task.done() else "after its /generate request finished"
    print(f"[fault] {signal.Signals(sig).name} to engine {engine_index} ({engine.url}) {target or 'launch'} pid "
          f"{victim.pid} at step {step} {state}; children {[c.pid for c in processes[1:]]}", flush=True)
    os.kill(victim.pid, sig)
    done[0] = True
    try:
        return await task
    except BaseException as exc:
        print(f"[fault] the in-flight request to engine {engine_index} failed: {type(exc).__name__}: {exc}",
              flush=True)
        raise
    finally:
        end = time.monotonic() + 30.0
        while time.monotonic() < end and any(_alive(c) for c in processes):
            await asyncio.sleep(0.1)
        left = [c.pid for c in processes if _alive(c)]
        print(f"[fault] engine {engine_index}'s processes after the fault: "
              f"{'still alive ' + str(left) if left else 'all exited'}", flush=True)


def _alive(proc) -> bool:
    import psutil

    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class FaultyVerifier:
    """The DAPO verifier, except that it raises on some ground truths and hangs on others.

    runs_in_process is False so that it is scored in the verifier pool, where a hang can be
    killed at `algo.verifier_timeout_s`.
    """

    name, version, max_response_chars, runs_in_process = "faulty-dapo", "1", 300, False

    def __init__(self, raise_on: Sequence[str], hang_on: Sequence[str]):
        self.raise_on, self.hang_on = set(raise_on), set(hang_on)

    def score(self, response: str, ground_truth: str):
        from dapo_mega.reward import DapoVerifier

        if ground_truth in self.raise_on:
            raise RuntimeError(f"injected verifier failure on ground truth {ground_truth}")
        if ground_truth in self.hang_on:
            time.sleep(3600)
        return DapoVerifier().score(response, ground_truth)


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # torchrun's argparse drops a "--" that comes first (no --fault before it)
    split = argv.index("--") if "--" in argv else -1
    options, overrides = argv[:split], argv[split + 1:]
    faults = [options[i + 1] for i, a in enumerate(options) if a == "--fault"]
    for fault in faults:
        _install(fault)
    from dapo_mega.cli import main as cli_main

    return cli_main(["train", *overrides])


if __name__ == "__main__":
    sys.exit(main())
