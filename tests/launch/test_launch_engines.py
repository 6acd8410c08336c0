"""The launcher's engine side (commands, threads, router) and its prepare step, without Slurm.

Engine command lines must be exactly those of `dapo_mega.engines.sglang.commands` (one
source of SGLang flags); the router start-up is exercised against a small HTTP server
posing as `python -m sglang_router.launch_router` (sglang-router is a GPU-image package),
which records the argv it was started with.
"""

from __future__ import annotations

import io
import json
import shlex
import sys
import textwrap
from contextlib import redirect_stdout
from pathlib import Path

import dapo_mega.launch as launch
from dapo_mega.config import load_config
from dapo_mega.engines.sglang.commands import build_engine_command, build_router_command
from dapo_mega.launch import (
    LearnerRank,
    SlurmTask,
    engine_fleet,
    engine_rollout_config,
    engine_threads,
    learner_env,
    router_wanted,
    run_prepare,
)


def _task(node: str = "n2", node_id: int = 1) -> SlurmTask:
    return SlurmTask(job_id="42", proc_id=0, num_tasks=1, node_id=node_id, num_nodes=2, local_id=0,
                     tasks_on_node=1, node_name=node)


def test_engine_commands_come_from_the_sglang_launch_module_through_the_fleet():
    assert not hasattr(launch, "build_engine_command")  # no second copy of the SGLang flags
    cfg = load_config(["+experiment=dapo_qwen2.5_32b"])
    rollout = engine_rollout_config(cfg, api_key="k3y")
    argv = engine_fleet(cfg, rollout, "/m", "10.0.0.2").command(30001)
    assert argv == build_engine_command(rollout, "/m", 30001, host="10.0.0.2", memory_saver=True)
    line = shlex.join(argv)
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    assert "--tp-size 4 " in line and "--api-key k3y" in line and "--host 10.0.0.2 --port 30001" in line
    assert "--num-threads" not in line and "--device" not in line  # GPU job: no CPU-only flags
    assert cfg.rollout.api_key == ""  # the job's key is filled into a copy, not the config

    tiny = load_config(["+experiment=tiny_cpu_slurm"])
    argv = engine_fleet(tiny, engine_rollout_config(tiny, "k"), "/m", "127.0.0.1", num_threads=3).command(5)
    assert argv[1:3] == ["-m", "dapo_mega.engines.embedded.server"] and argv[-2:] == ["--num-threads", "3"]
    user = load_config(["+experiment=tiny_cpu_slurm", "rollout.extra_server_args=[--num-threads,1]"])
    argv = engine_fleet(user, engine_rollout_config(user, "k"), "/m", "127.0.0.1", num_threads=3).command(5)
    assert argv.count("--num-threads") == 1 and argv[-1] == "1"  # the user's choice wins


def test_engine_threads_share_the_task_cpus():
    assert engine_threads({"SLURM_CPUS_ON_NODE": "16"}, 3) == 5
    assert engine_threads({"SLURM_CPUS_ON_NODE": "2"}, 4) == 1
    assert engine_threads({"SLURM_CPUS_ON_NODE": "8"}, 0) == 8


def test_router_only_for_sglang_on_the_first_engine_node():
    sglang = load_config(["+experiment=dapo_qwen2.5_32b", "rollout.use_router=true"])
    assert router_wanted(sglang, 0) and not router_wanted(sglang, 1)
    assert not router_wanted(load_config(["+experiment=dapo_qwen2.5_32b"]), 0)
    assert not router_wanted(load_config(["+experiment=tiny_cpu_slurm", "rollout.use_router=true"]), 0)


def test_learner_env_sync_address_is_the_nodes_slurm_address():
    rank = LearnerRank(rank=9, world_size=16, local_rank=1, local_world_size=8, node_rank=1,
                       master_addr="10.0.0.1", master_port=29500)
    env = {"DAPO_MEGA_NODE_ADDRS": "n1=10.0.0.1,n2=10.0.0.2", "PATH": "/bin"}
    out = learner_env(rank, _task("n2"), env)
    assert out["DAPO_MEGA_SYNC_ADDR"] == "10.0.0.2" and out["RANK"] == "9" and out["MASTER_ADDR"] == "10.0.0.1"
    assert out["OMP_NUM_THREADS"] == "1" and out["PATH"] == "/bin"
    out = learner_env(rank, _task("n2"), {**env, "OMP_NUM_THREADS": "4", "DAPO_MEGA_SYNC_ADDR": "192.168.1.5"})
    assert out["OMP_NUM_THREADS"] == "4" and out["DAPO_MEGA_SYNC_ADDR"] == "192.168.1.5"  # the user's wins


def test_learners_start_with_nccl_error_handling_named_in_their_environment():
    """Slurm's learner tasks and torchrun's ranks (`learner_ranks`) start with torch's default
    named, so the weight-update group's switch to 0 (`transport.init_custom_process_group`)
    replaces a value; a user's setting wins."""
    from dapo_mega.distributed import learner_process_env

    rank = LearnerRank(rank=0, world_size=8, local_rank=0, local_world_size=8, node_rank=0,
                       master_addr="10.0.0.1", master_port=29500)
    assert learner_env(rank, _task("n1", 0), {})["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert learner_env(rank, _task("n1", 0), {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"})[
        "TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert learner_process_env({"PATH": "/bin"}) == {"PATH": "/bin", "OMP_NUM_THREADS": "1",
                                                     "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}


def _fake_checkpoint(run_dir: Path, step: int) -> None:
    """The two files `is_complete_checkpoint` requires of a finished save."""
    ckpt = run_dir / "checkpoints" / f"step_{step:06d}"
    (ckpt / "model_optim").mkdir(parents=True)
    (ckpt / "model_optim" / "metadata.json").write_text("{}")
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": step}))


def _prepare(overrides) -> dict:
    cfg = load_config(["+experiment=tiny_cpu_slurm", *overrides])
    out = io.StringIO()
    with redirect_stdout(out):
        assert run_prepare(cfg, "colocated", 2, "77") == 0
    return dict(shlex.split(line)[0].split("=", 1) for line in out.getvalue().splitlines())


def test_prepare_reports_a_complete_run_and_prepares_nothing(tmp_path):
    base = [f"trainer.output_dir={tmp_path}", "trainer.run_name=r", "trainer.total_steps=3"]
    run_dir = tmp_path / "r"
    _fake_checkpoint(run_dir, 3)
    got = _prepare(base)
    assert (got["RUN_COMPLETE"], got["COMPLETED_STEPS"], got["TOTAL_STEPS"]) == ("1", "3", "3")
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoints"]  # no logs, registry, model
    # the same run asked to go further, or told not to resume: a normal start
    got = _prepare(base[:-1] + ["trainer.total_steps=5"])
    assert (got["RUN_COMPLETE"], got["COMPLETED_STEPS"]) == ("0", "3")
    assert Path(got["LOG_DIR"]) == run_dir / "logs" / "job-77" and (run_dir / "base_model" / "config.json").exists()
    assert _prepare(base + ["trainer.resume=false"])["RUN_COMPLETE"] == "0"


ROUTER_STAND_IN = textwrap.dedent('''
    """Poses as `python -m sglang_router.launch_router`: serves /health, records its argv."""
    import argparse, json, os, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer

    p = argparse.ArgumentParser()
    p.add_argument("--worker-urls", nargs="+", required=True)
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--policy", required=True)
    args = p.parse_args()
    with open(os.environ["ROUTER_ARGV_FILE"], "w") as f:
        json.dump(sys.argv[1:], f)

    class H(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *a):
            pass

    HTTPServer((args.host, args.port), H).serve_forever()
''')


def test_router_starts_in_front_of_every_announced_engine(tmp_path, monkeypatch):
    package = tmp_path / "pkgs" / "sglang_router"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "launch_router.py").write_text(ROUTER_STAND_IN)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "pkgs"))
    monkeypatch.setenv("ROUTER_ARGV_FILE", str(tmp_path / "argv.json"))
    cfg = load_config(["+experiment=dapo_qwen2.5_32b", "rollout.use_router=true", "rollout.num_engines=3",
                       "rollout.health_timeout_s=20"])
    registry = tmp_path / "engines"
    for i, port in enumerate((30000, 30001, 30002)):
        launch.announce_engine(registry, i, {"url": f"http://10.0.0.{i + 1}:{port}"})
    procs, logs = {}, {}
    try:
        failed = launch._start_router(cfg, registry, "127.0.0.1", "127.0.0.1", tmp_path, procs, logs, _task("n1", 0))
        assert failed is None, logs["router"].read_text()
        record = json.loads((registry / "router.json").read_text())
        workers = [f"http://10.0.0.{i + 1}:{30000 + i}" for i in range(3)]
        assert record["workers"] == workers
        port = int(record["url"].rsplit(":", 1)[1])
        argv = json.loads((tmp_path / "argv.json").read_text())
        assert [sys.executable, "-m", "sglang_router.launch_router", *argv] == \
            build_router_command(workers, port, host="127.0.0.1")
        assert procs["router"].poll() is None  # running, watched with the engines
    finally:
        launch._stop_all(procs)


def test_router_gives_up_when_engines_never_all_announce(tmp_path):
    cfg = load_config(["+experiment=dapo_qwen2.5_32b", "rollout.use_router=true", "rollout.num_engines=2",
                       "rollout.health_timeout_s=1"])
    launch.announce_engine(tmp_path / "engines", 0, {"url": "http://10.0.0.1:30000"})
    procs = {}
    assert launch._start_router(cfg, tmp_path / "engines", "h", "h", tmp_path, procs, {}, _task()) == 1
    assert procs == {} and not (tmp_path / "engines" / "router.json").exists()
