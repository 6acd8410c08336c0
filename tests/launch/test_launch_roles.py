"""Role/rank decisions of dapo_mega.launch and the experiment configs it launches."""

from __future__ import annotations

import json

import pytest

from dapo_mega.config import load_config, validate_config
from dapo_mega.launch import (
    announce_engine,
    compute_engine_slots,
    compute_learner_rank,
    hydra_value,
    parse_node_addrs,
    read_slurm_task,
)

EXPERIMENTS = ["dapo_qwen2.5_32b", "dapo_qwen2.5_32b_disagg", "dapo_qwen2.5_32b_fp8",
               "dapo_qwen2.5_32b_disagg_fp8", "dapo_qwen2.5_7b", "tiny_cpu_slurm"]


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_composes_and_validates_against_its_world(name):
    cfg = load_config([f"+experiment={name}"])
    c = cfg.cluster
    learner_nodes = c.num_nodes - (c.engine_nodes if c.mode == "disaggregated" else 0)
    validate_config(cfg, world_size=learner_nodes * c.gpus_per_node)
    assert cfg.trainer.run_name == name


def test_32b_recipe_numbers():
    cfg = load_config(["+experiment=dapo_qwen2.5_32b"])
    a = cfg.algo
    assert (a.clip_ratio_low, a.clip_ratio_high) == (0.2, 0.28)
    assert (a.train_batch_size, a.n_samples_per_prompt, a.train_batch_size // a.mini_batch_size) == (512, 16, 16)
    assert (a.gen_batch_size, a.max_num_gen_batches, a.dynamic_sampling) == (1536, 10, True)
    assert (a.lr, a.lr_warmup_steps, a.weight_decay, a.grad_clip) == (1e-6, 20, 0.1, 1.0)
    assert (a.max_prompt_length, a.max_response_length, a.overlong_buffer_length) == (2048, 20480, 4096)
    assert (cfg.eval.n_samples, cfg.eval.temperature, cfg.eval.top_p) == (32, 1.0, 0.7)
    assert cfg.data.train_path.endswith("dapo_math_17k.parquet") and a.verifier == "dapo"
    assert cfg.rollout.backend == "sglang" and cfg.cluster.mode == "colocated"
    assert load_config(["+experiment=dapo_qwen2.5_32b_fp8"]).megatron.fp8.enabled
    assert not cfg.megatron.fp8.enabled
    assert load_config(["+experiment=dapo_qwen2.5_32b_disagg_fp8"]).cluster.mode == "disaggregated"


def _slurm_env(procid, ntasks, nodeid, nnodes, localid):
    return {"SLURM_JOB_ID": "7", "SLURM_PROCID": str(procid), "SLURM_NTASKS": str(ntasks),
            "SLURM_NODEID": str(nodeid), "SLURM_NNODES": str(nnodes), "SLURM_LOCALID": str(localid),
            "SLURM_TASKS_PER_NODE": f"{ntasks // nnodes}(x{nnodes})", "SLURMD_NODENAME": f"n{nodeid + 1}",
            "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}


def test_learner_rank_from_slurm_task_variables():
    env = _slurm_env(procid=13, ntasks=16, nodeid=1, nnodes=2, localid=5)
    rank = compute_learner_rank(read_slurm_task(env), env)
    assert rank.env() == {"RANK": "13", "WORLD_SIZE": "16", "LOCAL_RANK": "5", "LOCAL_WORLD_SIZE": "8",
                          "GROUP_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    env.pop("MASTER_ADDR")
    with pytest.raises(RuntimeError, match="MASTER_ADDR"):
        compute_learner_rank(read_slurm_task(env), env)


def test_engine_slots_spread_over_nodes_with_disjoint_gpus():
    cfg = load_config(["+experiment=dapo_qwen2.5_32b"])  # 32 engines x TP4 over 16 nodes
    slots = compute_engine_slots(cfg, node_index=3, engine_nodes=16, use_gpu=True)
    assert [(s.index, s.gpu_ids) for s in slots] == [(6, [0, 1, 2, 3]), (7, [4, 5, 6, 7])]
    every = [s.index for n in range(16) for s in compute_engine_slots(cfg, n, 16, True)]
    assert every == list(range(32))
    with pytest.raises(RuntimeError, match="more than cluster.gpus_per_node"):
        compute_engine_slots(cfg, 0, engine_nodes=8, use_gpu=True)  # 4 engines x 4 GPUs > 8
    tiny = load_config(["+experiment=tiny_cpu_slurm", "rollout.num_engines=3"])
    assert [[s.index for s in compute_engine_slots(tiny, n, 2, False)] for n in (0, 1)] == [[0, 1], [2]]


def test_registry_file_written_atomically_and_helpers(tmp_path):
    path = announce_engine(tmp_path / "engines", 4, {"url": "http://10.0.0.2:30000"})
    assert path.name == "engine-4.json" and json.loads(path.read_text())["url"] == "http://10.0.0.2:30000"
    assert [p.name for p in (tmp_path / "engines").iterdir()] == ["engine-4.json"]  # no tmp left behind
    assert parse_node_addrs("n1=10.0.0.1,n2=10.0.0.2") == {"n1": "10.0.0.1", "n2": "10.0.0.2"}
    assert hydra_value("/lustre/run-1") == "/lustre/run-1"
    assert hydra_value("/a b/it's") == "'/a b/it\\'s'"
    cfg = load_config(["trainer.output_dir=" + hydra_value(str(tmp_path / "a b"))])
    assert cfg.trainer.output_dir == str(tmp_path / "a b")


def test_slurm_durations_as_slurm_documents_them():
    from dapo_mega.launch import parse_slurm_duration

    # sbatch --time forms (Slurm's man page): minutes, minutes:seconds, hours:minutes:seconds,
    # days-hours, days-hours:minutes, days-hours:minutes:seconds
    assert parse_slurm_duration("45") == 45 * 60
    assert parse_slurm_duration("29:59") == 29 * 60 + 59
    assert parse_slurm_duration("1:00:00") == 3600
    assert parse_slurm_duration("2-3") == 2 * 86400 + 3 * 3600
    assert parse_slurm_duration("2-03:04") == 2 * 86400 + 3 * 3600 + 4 * 60
    assert parse_slurm_duration("1-00:00:01") == 86401
    for no_limit in ("UNLIMITED", "NOT_SET", "INVALID", "", "1:2:3:4", "-5"):
        assert parse_slurm_duration(no_limit) is None, no_limit


def test_learners_get_the_jobs_time_left_unless_the_user_set_a_limit(tmp_path, monkeypatch):
    import os
    import stat

    from dapo_mega.launch import learner_overrides, slurm_time_left

    squeue = tmp_path / "squeue"  # a stand-in that answers as squeue -h -j JOB -o %L does
    squeue.write_text("#!/bin/sh\n[ \"$3\" = 4242 ] && [ \"$5\" = %L ] && echo 1:30:00\n")
    squeue.chmod(squeue.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert slurm_time_left({"SLURM_JOB_ID": "4242"}) == 5400
    assert slurm_time_left({"SLURM_JOB_ID": "7"}) is None and slurm_time_left({}) is None

    cfg = load_config([f"trainer.output_dir={tmp_path}"])
    assert "trainer.wall_time_minutes=90.00" in learner_overrides(cfg, {}, 5400.0)
    assert not any("wall_time" in o for o in learner_overrides(cfg, {}, None))
    mine = load_config([f"trainer.output_dir={tmp_path}", "trainer.wall_time_minutes=30"])
    assert not any("wall_time" in o for o in learner_overrides(mine, {}, 5400.0))


def test_a_step_that_would_not_fit_the_wall_time_stops_the_run():
    from dapo_mega.driver.run_state import would_overrun

    # 50 min in, steps of up to 5 min, saves of 2 min, 2 min of margin: 59 fits 60, 61 does not
    assert not would_overrun(50 * 60, 5 * 60, 2 * 60, 60 * 60, 2 * 60)
    assert would_overrun(52 * 60, 5 * 60, 2 * 60, 60 * 60, 2 * 60)
    assert not would_overrun(10**9, 10**9, 10**9, 0, 0)  # no limit
