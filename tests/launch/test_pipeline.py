"""launch/pipeline.py: the whole reproduction as dependent Slurm jobs, and on one machine.

Fast (no Slurm): the dry run's sbatch lines and dependencies for a colocated and a
disaggregated experiment; the plan's refusals (a learner that does not fit, a training job
whose --time cannot hold one step, a model whose heads do not split over the recipe's TP),
each before anything is submitted; a missing input named by its flag; `--local` stopping
at a failing stage with its reason.

Slow (the local two-node Slurm cluster of tests/slurm_cluster.py): the whole pipeline of
the tiny CPU experiment from a published-format parquet and an HF directory to the final
eval result, every stage COMPLETED; and a data stage fed a bad row, which fails and cancels
every later stage before it starts. Nothing is stubbed: prepare_data, the conversion tool,
the trainer, the embedded engines and `dapo-mega eval` run as a user would run them.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

REPO = Path(__file__).resolve().parents[2]
PIPELINE = REPO / "launch" / "pipeline.py"
# the tiny model's HF directory stands for the published checkpoint, so it starts from
# random weights: no warm start (its rewards are mostly 0; 3 steps still train and save)
EXPERIMENTS = sorted(p.stem for p in (REPO / "configs" / "experiment").glob("*.yaml"))
TINY = ["--experiment", "tiny_cpu_slurm"]
TINY_OVERRIDES = ["--", "trainer.sft_warmup_steps=0"]
BAD_ROW = "bad.parquet: row 1: field reward_model.ground_truth: empty"  # prepare_data's own message


def _write_published(path: Path, problems, bad_row: bool = False) -> None:
    """Problems in the published DAPO-Math / AIME parquet schema (tools/prepare_data.py's input)."""
    rows = {"data_source": [], "prompt": [], "ability": [], "reward_model": [], "extra_info": []}
    for i, p in enumerate(problems):
        rows["data_source"].append(p.data_source)
        rows["prompt"].append([{"role": "user", "content": p.prompt}])
        rows["ability"].append("MATH")
        rows["reward_model"].append({"ground_truth": "" if bad_row and i == 1 else p.ground_truth,
                                     "style": "rule-lean"})
        rows["extra_info"].append({"index": p.id})
    pq.write_table(pa.table(rows), path)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """An HF directory (the tiny model) and the two published-format data files."""
    from dapo_mega.data.synthetic import generate_synthetic_problems
    from dapo_mega.models.tiny import build_tiny_model_dir

    root = tmp_path_factory.mktemp("inputs")
    build_tiny_model_dir(root / "hf")
    train, held_out = generate_synthetic_problems(64, 8)
    _write_published(root / "dapo.parquet", train)
    _write_published(root / "aime.parquet", held_out)
    _write_published(root / "bad.parquet", train[:4], bad_row=True)
    return root


def _pipeline(args, timeout_s: float = 120, env=None, entry=None) -> subprocess.CompletedProcess:
    """launch/pipeline.py, or an experiment's entry point (`entry`: launch/<experiment>.sh)."""
    command = ["bash", str(entry), *args] if entry else [sys.executable, str(PIPELINE), *args]
    # the entry points run ${PYTHON:-python}: the tests' interpreter, whether or not a venv is activated
    env = {**(os.environ if env is None else env), "PYTHON": (env or {}).get("PYTHON", sys.executable)}
    return subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=timeout_s, env=env)


def _files(inputs: Path, dapo: str = "dapo.parquet") -> list:
    return ["--hf-model", str(inputs / "hf"), "--dapo-math", str(inputs / dapo), "--aime", str(inputs / "aime.parquet")]


def _sbatch_lines(stdout: str) -> dict:
    """job name suffix -> the sbatch line's arguments, from a dry run's output."""
    lines = [shlex.split(line) for line in stdout.splitlines() if line.startswith("sbatch ")]
    return {re.search(r"--job-name=\S+?-(\w+(?:-\d+)?)$", next(a for a in ln if a.startswith("--job-name"))).group(1): ln
            for ln in lines}


def test_dry_run_prints_every_stage_with_its_dependency(inputs, tmp_path):
    out = _pipeline([*TINY, *_files(inputs), "--output-dir", str(tmp_path), "--chain", "3", "--time", "30",
                     "--partition", "cpu", "--sbatch-opt=--mem=4000", "--dry-run", *TINY_OVERRIDES])
    assert out.returncode == 0, out.stderr
    lines = _sbatch_lines(out.stdout)
    assert list(lines) == ["data", "import", "verify", "train-1", "train-2", "train-3", "export", "eval"]
    dep = {name: next((a.split("=", 1)[1] for a in ln if a.startswith("--dependency=")), None)
           for name, ln in lines.items()}
    assert dep == {"data": None, "import": "afterok:<data>", "verify": "afterok:<import>",
                   "train-1": "afterok:<verify>", "train-2": "afterany:<train-1>,afterok:<verify>",
                   "train-3": "afterany:<train-2>,afterok:<verify>", "export": "afterok:<train-3>",
                   "eval": "afterok:<export>"}
    run_dir = tmp_path / "tiny_cpu_slurm"
    for name, ln in lines.items():
        assert ("--kill-on-invalid-dep=yes" in ln) == (name != "data")
        assert f"--output={run_dir}/logs/pipeline/{name}-%j.log" in ln and "--partition=cpu" in ln
        script = next(i for i, a in enumerate(ln) if a.endswith(".sbatch"))
        assert all(a.startswith("--") for a in ln[2:script])  # every option before the script, none after
    train = lines["train-2"]
    assert train[train.index("--nodes=2"):train.index("slurm/colocated.sbatch")] == \
        ["--nodes=2", "--signal=B:USR1@600", "--time=30", "--partition=cpu", "--mem=4000"]  # a tiny step: the floor
    overrides = train[train.index("slurm/colocated.sbatch") + 1:]
    assert overrides[0] == "+experiment=tiny_cpu_slurm" and "trainer.sft_warmup_steps=0" in overrides
    assert f"model.hf_path={inputs / 'hf'}" in overrides and "cluster.num_nodes=2" in overrides
    assert f"data.train_path={run_dir / 'data' / 'dapo_math_17k.parquet'}" in overrides
    assert lines["import"][-6:] == ["--megatron-path", str(run_dir / "base_megatron"), "--tp", "1", "--pp", "1"]
    assert lines["export"][-7:-4] == [str(run_dir), "3", str(run_dir / "hf_final")]  # 3: trainer.total_steps
    assert f"eval.output={run_dir / 'eval' / 'final.json'}" in lines["eval"]
    assert "--time=30" not in lines["data"]  # --time is the training jobs'; --stage-time the others'
    assert not run_dir.exists()  # a dry run writes nothing


def test_dry_run_disaggregated_heterogeneous_links_and_from(inputs, tmp_path):
    # the recipe's TP 8 does not split the tiny model's heads: the plan refuses before any line
    out = _pipeline(["--experiment", "dapo_qwen2.5_32b_disagg", *_files(inputs), "--output-dir", str(tmp_path),
                     "--dry-run", "--", ENGINE_PYTHON])
    assert out.returncode == 1 and not _sbatch_lines(out.stdout)
    assert "refused, the plan says: 4 heads / 2 KV heads do not split over TP 8" in out.stderr
    # the tiny experiment, disaggregated: learner nodes : engine nodes, job-wide options before ':'
    out = _pipeline([*TINY, *_files(inputs), "--output-dir", str(tmp_path), "--from", "train", "--chain", "2",
                     "--nodes", "1", "--engine-nodes", "1", "--time", "20", "--sbatch-opt=--mem=4000", "--dry-run",
                     *TINY_OVERRIDES,
                     "cluster.mode=disaggregated"])
    assert out.returncode == 0, out.stderr
    lines = _sbatch_lines(out.stdout)
    assert list(lines) == ["train-1", "train-2", "export", "eval"]  # --from train: data and conversion done
    link = lines["train-2"]
    script = link.index("slurm/disaggregated.sbatch")
    assert link[2:6] == ["--job-name=" + link[2].split("=", 1)[1], link[3], "--dependency=afterany:<train-1>",
                         "--kill-on-invalid-dep=yes"]
    # each component its own time limit and site options (a component without --time gets the partition's)
    # the stop signal goes to the component that runs the batch script
    assert link[6:script] == ["--nodes=1", "--signal=B:USR1@600", "--time=20", "--mem=4000", ":", "--nodes=1",
                              "--time=20", "--mem=4000"]
    assert "cluster.num_nodes=2" in link and "cluster.engine_nodes=1" in link
    assert not any(a.startswith("--dependency") for a in lines["train-1"])
    # --from eval: only the evaluation of the export already made
    out = _pipeline([*TINY, *_files(inputs), "--output-dir", str(tmp_path), "--from", "eval", "--dry-run",
                     *TINY_OVERRIDES])
    assert list(_sbatch_lines(out.stdout)) == ["eval"], out.stdout + out.stderr


QWEN25_32B_CONFIG = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 5120,
                     "intermediate_size": 27648, "num_hidden_layers": 64, "num_attention_heads": 40,
                     "num_key_value_heads": 8, "vocab_size": 152064, "max_position_embeddings": 131072,
                     "rope_theta": 1000000.0, "rms_norm_eps": 1e-05, "tie_word_embeddings": False,
                     "hidden_act": "silu", "torch_dtype": "bfloat16"}
GPU_OPTS = ["--sbatch-opt=--gpus-per-node=8", "--sbatch-opt=--gres=gpu:8"]
ENGINE_PYTHON = "rollout.engine_python=/opt/sglang/bin/python"  # docs/cluster.md section 1's SGLang venv
CONVERSION = ("import", "verify", "export")


def _gpu_stage(name: str) -> bool:
    return name.startswith("train-") or name == "eval"


def test_a_launcher_whose_python_cannot_import_the_package_says_which_python_and_the_fix(tmp_path):
    """`${PYTHON:-python}` without the venv: one line naming the interpreter and PYTHON=, no traceback."""
    bare = tmp_path / "python"  # an interpreter without site-packages, as the shell's python outside the venv
    bare.write_text(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")
    bare.chmod(0o755)
    out = _pipeline(["--hf-model", str(tmp_path), "--dapo-math", "x", "--aime", "y", "--output-dir", str(tmp_path),
                     "--dry-run"], entry=REPO / "launch" / "dapo_qwen2.5_32b.sh",
                    env={**os.environ, "PYTHON": str(bare)})
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    line, = out.stderr.strip().splitlines()
    assert line.startswith(f"pipeline: error: {sys.executable} cannot import dapo_mega") and "PYTHON=" in line, line


def test_32b_dry_run_asks_for_gpus_only_in_gpu_stages_and_times_every_stage(tmp_path):
    """What a GRES site passes (launch/README.md): the GPU options reach the training links and
    the eval only; conversion, data and export run on the CPU; every stage has a --time."""
    hf = tmp_path / "Qwen2.5-32B"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(QWEN25_32B_CONFIG))
    for name in ("dapo.parquet", "aime.parquet"):
        (tmp_path / name).touch()
    args = ["--hf-model", str(hf), "--dapo-math", str(tmp_path / "dapo.parquet"), "--aime",
            str(tmp_path / "aime.parquet"), "--output-dir", str(tmp_path / "runs"), "--dry-run", *GPU_OPTS,
            "--sbatch-opt=--mem=0"]
    # the recipe's SGLang engines would start from the jobs' Python, which the GPU install keeps SGLang out of
    out = _pipeline(args, entry=REPO / "launch" / "dapo_qwen2.5_32b.sh")
    assert out.returncode == 2 and not _sbatch_lines(out.stdout)
    assert out.stderr.strip().startswith("pipeline: error: rollout.engine_python: empty, so the SGLang engines of "
                                         "the training jobs and the eval would start from the jobs' Python")
    assert "Fix: add -- rollout.engine_python=" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    out = _pipeline([*args, "--", ENGINE_PYTHON], entry=REPO / "launch" / "dapo_qwen2.5_32b.sh")
    assert out.returncode == 0, out.stderr
    lines = _sbatch_lines(out.stdout)
    assert [n for n in lines if not n.startswith("train-")] == ["data", "import", "verify", "export", "eval"]
    for name, ln in lines.items():
        gpu = [a for a in ln if a in ("--gpus-per-node=8", "--gres=gpu:8")]
        assert gpu == (["--gpus-per-node=8", "--gres=gpu:8"] if _gpu_stage(name) else []), name
        assert "--mem=0" in ln and len([a for a in ln if a.startswith("--time=")]) == 1, name
    assert "--time=24:00:00" in lines["train-1"]  # the entry point's
    assert "--time=00:10:00" in lines["data"]  # the plan's: its start-up only
    assert "--device" not in lines["import"]  # the conversion's default: the CPU
    # import/export spawn tp 8 x pp 2 gloo ranks, a CPU each (verify's one rank: as threads);
    # eval's two TP-4 engines: a scheduler per GPU, a tokenizer and a detokenizer each, + 4 for
    # the eval process and its verifier workers: 2 x (4 + 2) + 4 (Slurm's default was one CPU)
    cpus = {name: [a for a in ln if a.startswith("--cpus-per-task")] for name, ln in lines.items()}
    assert cpus == {name: ["--cpus-per-task=16"] if name in CONVERSION + ("eval",) else [] for name in lines}
    # a 32B step (~22 min), its evaluation and a checkpoint save outlast the sbatch scripts' 600 s
    signals = {name: [a for a in ln if a.startswith("--signal=")] for name, ln in lines.items()}
    lead = int(signals["train-1"][0].rsplit("@", 1)[1])
    assert signals == {name: [f"--signal=B:USR1@{lead}"] if name.startswith("train-") else [] for name in lines}
    assert 1.5 * (22 * 60 + 229) < lead < 24 * 3600
    assert "GPU options --gpus-per-node=8 --gres=gpu:8: only in the stages that use GPUs" in out.stdout


def _launcher():
    sys.path.insert(0, str(REPO / "launch"))
    try:
        import pipeline
        import pipeline_stages
    finally:
        sys.path.remove(str(REPO / "launch"))
    return pipeline, pipeline_stages


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_every_stage_has_a_time_and_gpus_only_where_used(name, tmp_path):
    """Every shipped experiment's stages from the plan's clock (no --time, no --stage-time):
    each job and each component of a heterogeneous one has a --time, and the GPU options only
    the stages whose processes use GPUs (none in a CPU run)."""
    from dapo_mega.config import compose_config, register_configs
    from dapo_mega.plan.clock import estimate_clock

    pipeline, stages_module = _launcher()
    args = pipeline.parse_args(["--experiment", name, "--hf-model", str(tmp_path / "hf"), "--output-dir",
                                str(tmp_path), "--dapo-math", "d.parquet", "--aime", "a.parquet", "--chain", "3",
                                *GPU_OPTS, "--sbatch-opt=--mem=0", "--dry-run"])
    launcher = stages_module.Pipeline(args)
    register_configs()
    cfg = compose_config("config", launcher.overrides)
    stages = launcher.stages({"clock": estimate_clock(cfg).to_dict()})
    assert [s.name for s in stages] == ["data", "import", "verify", "train-1", "train-2", "train-3", "export",
                                        "eval"]
    clock = estimate_clock(cfg)
    lead = math.ceil(max(600, clock.stop_signal_lead_s))
    # a conversion rank per TP x PP rank, and for a mixture data-parallel copies where EP exceeds TP
    # (each rank holds its share of the experts: EP 8 at TP 4 is 8 ranks)
    m = cfg.megatron
    ranks = m.tensor_model_parallel_size * m.pipeline_model_parallel_size * \
        (m.expert_model_parallel_size // math.gcd(m.tensor_model_parallel_size, m.expert_model_parallel_size))
    for stage in stages:
        components = " ".join(stage.sbatch).split(" : ")
        assert all(len(re.findall(r"--time=(?:\d+-)?\d\d:\d\d:00\b", c)) == 1 for c in components), stage.sbatch
        cpus = [o for o in stage.sbatch if o.startswith("--cpus-per-task=")]
        r = cfg.rollout
        engines = cfg.cluster.gpus_per_node // (r.engine_tp_size * r.engine_dp_size)
        eval_cpus = [f"--cpus-per-task={engines * (r.engine_tp_size * r.engine_dp_size + 2) + 4}"]
        assert cpus == ([f"--cpus-per-task={ranks}"] if stage.name in CONVERSION else
                        eval_cpus if stage.name == "eval" and cfg.cluster.device != "cpu" else []), stage.sbatch
        signal = [c for c in components if f"--signal=B:USR1@{lead}" in c.split()]
        assert signal == (components[:1] if stage.name.startswith("train-") else []), stage.sbatch
        gpu = cfg.cluster.device != "cpu" and _gpu_stage(stage.name)
        assert stage.gpu == gpu
        for component in components:
            assert ("--gpus-per-node=8" in component.split()) == gpu and ("--gres=gpu:8" in component) == gpu
            assert "--mem=0" in component.split()


def test_stage_times_refused_without_the_plan_unless_given():
    pipeline, stages_module = _launcher()
    common = ["--experiment", "tiny_cpu_slurm", "--hf-model", "/nowhere", "--output-dir", "/tmp/x", "--dapo-math",
              "d.parquet", "--aime", "a.parquet", "--dry-run"]
    with pytest.raises(stages_module.PipelineError, match="no time limit for stage 'data'.*Fix: pass --stage-time"):
        stages_module.Pipeline(pipeline.parse_args(common)).stages({})
    with pytest.raises(stages_module.PipelineError, match="no step time .* Fix: pass --time"):
        stages_module.Pipeline(pipeline.parse_args([*common, "--stage-time", "1:00:00"])).stages({})
    given = stages_module.Pipeline(pipeline.parse_args([*common, "--stage-time", "1:00:00", "--time", "30"]))
    assert {next(o for o in s.sbatch if o.startswith("--time=")) for s in given.stages({})} == \
        {"--time=1:00:00", "--time=30"}
    # the stop signal (600 s without a clock) must leave the link time to train
    short = stages_module.Pipeline(pipeline.parse_args([*common, "--stage-time", "1:00:00", "--time", "10"]))
    with pytest.raises(stages_module.PipelineError, match=r"--time 10: the learners need their stop signal 600 s "
                                                          r"before the limit.*Fix: pass a --time well over 600 s"):
        short.stages({})
    assert [stages_module.requests_gpus(o) for o in ("--gpus-per-node=8", "-G8", "--gres=gpu:a100:4",
                                                     "--gres gpu:8", "--mem-per-gpu=80G", "--gres=nvme:1",
                                                     "--mem=0", "-pgpu", "--constraint=gpu")] == \
        [True, True, True, True, True, False, False, False, False]
    assert [stages_module.slurm_time(s) for s in (1, 600, 5161, 86400 + 61)] == \
        ["00:01:00", "00:10:00", "01:27:00", "1-00:02:00"]


def test_sglang_engines_need_a_python_with_sglang_before_anything_is_submitted(tmp_path):
    """Slurm: an empty rollout.engine_python is refused (the jobs' Python may be inside a
    container; naming it is the user's say-so), a named one visible here is asked; --local:
    the jobs run here, so the engines' Python is asked as `dapo-mega train` would."""
    from helpers.interpreters import stand_in_python

    pipeline, stages_module = _launcher()
    lacking, having = stand_in_python(tmp_path, False), stand_in_python(tmp_path, True)

    def problem(*extra: str, overrides=()) -> str:
        mode = [] if "--local" in extra else ["--dry-run"]  # the two exclude each other
        args = pipeline.parse_args(["--experiment", "tiny_cpu_slurm", "--hf-model", "/nowhere", "--output-dir",
                                    str(tmp_path), *mode, *extra, "rollout.backend=sglang", *overrides])
        return stages_module.Pipeline(args).engine_python_problem() or ""

    assert problem().startswith("rollout.engine_python: empty, so the SGLang engines of the training jobs")
    assert problem(overrides=["rollout.engine_python=/opt/sglang/bin/python"]) == ""  # not here: the job checks
    assert problem(overrides=[f"rollout.engine_python={lacking}"]).startswith(
        f"rollout.engine_python: {lacking} cannot import sglang. Fix: point it at the bin/python of the SGLang venv")
    assert problem(overrides=[f"rollout.engine_python={having}"]) == ""
    assert problem("--container", "img.sqsh", overrides=[f"rollout.engine_python={lacking}"]) == ""  # its own
    assert problem("--local", overrides=[f"rollout.engine_python={lacking}"]).startswith(
        f"rollout.engine_python: {lacking} cannot import sglang, so no SGLang engine can start")
    assert problem("--local", overrides=[f"rollout.engine_python={having}"]) == ""


def test_plan_refusals_stop_before_submitting(inputs, tmp_path):
    env_path = tmp_path / "bin"  # an sbatch that records being called: the launcher must not reach it
    env_path.mkdir()
    (env_path / "sbatch").write_text(f"#!/bin/sh\ntouch {tmp_path}/sbatch-called\necho 1\n")
    (env_path / "sbatch").chmod(0o755)
    import os

    env = {**os.environ, "PATH": f"{env_path}:{os.environ['PATH']}"}
    common = [*TINY, *_files(inputs), "--output-dir", str(tmp_path / "runs")]
    too_small = _pipeline([*common, *TINY_OVERRIDES, "cluster.gpu_memory_gib=0.0001"], env=env)
    assert too_small.returncode == 1
    assert "pipeline: refused, the plan says: learner does not fit: stage 0 needs" in too_small.stderr
    short = _pipeline([*common, "--time", "1", *TINY_OVERRIDES], env=env)  # 1 minute < engine start + a step
    assert short.returncode == 1
    assert "refused, the plan says: clock: trainer.wall_time_minutes=1 leaves no room for one step" in short.stderr
    assert not (tmp_path / "sbatch-called").exists() and not (tmp_path / "runs").exists()
    missing = _pipeline([*TINY, "--hf-model", str(tmp_path / "nowhere"), "--dapo-math", "x", "--aime", "y",
                         "--dry-run"], env=env)
    assert missing.returncode == 2
    assert missing.stderr.strip() == (f"pipeline: error: --hf-model {tmp_path / 'nowhere'}: no config.json there. "
                                      "Fix: point it at the HF checkpoint directory (config.json, tokenizer, "
                                      "*.safetensors)")


def test_local_stops_at_the_failing_stage_with_its_reason(inputs, tmp_path):
    out = _pipeline([*TINY, *_files(inputs, "bad.parquet"), "--output-dir", str(tmp_path), "--local",
                     *TINY_OVERRIDES])
    logs = tmp_path / "tiny_cpu_slurm" / "logs" / "pipeline"
    assert out.returncode == 1, out.stdout + out.stderr
    assert "pipeline: stage 'data' failed with exit 1; the later stages did not run" in out.stderr
    assert BAD_ROW in out.stderr and BAD_ROW in (logs / "data.log").read_text()
    assert sorted(p.name for p in logs.iterdir()) == ["data.log"]
    assert "[import]" not in out.stdout


def test_export_stage_refuses_a_run_the_chain_left_short(tmp_path):
    # the chain ended at step 2 of 3 (a link failed, or the chain was too short): exporting
    # would make the final eval score an intermediate checkpoint
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "step_000002").mkdir(parents=True)
    (run_dir / "checkpoints" / "latest").write_text("step_000002\n")
    out = subprocess.run(["bash", str(REPO / "launch" / "export_final.sh"), str(run_dir), "3", str(tmp_path / "hf")],
                         capture_output=True, text=True, cwd=REPO, timeout=30)
    assert out.returncode == 1
    assert (f"run {run_dir} is not complete: its latest checkpoint is 'step_000002', the last step's is "
            "step_000003") in out.stderr
    assert not (tmp_path / "hf").exists()


def test_wait_names_the_stage_that_stopped_the_pipeline():
    sys.path.insert(0, str(REPO / "launch"))
    try:
        from pipeline import stopping_stage
        from pipeline_stages import Stage
    finally:
        sys.path.remove(str(REPO / "launch"))
    names = ["data", "import", "verify", "train-1", "train-2", "train-3", "export", "eval"]
    stages = [Stage(n, [], "") for n in names]

    def stopped(**states):
        return getattr(stopping_stage(stages, {n: states.get(n.replace("-", "_"), "COMPLETED") for n in names}),
                       "name", None)

    assert stopped() is None
    assert stopped(train_1="FAILED") is None  # link 2 resumed the run; export and eval completed
    assert stopped(data="FAILED", **{n.replace("-", "_"): "CANCELLED" for n in names[1:]}) == "data"
    # the last link failed: export and eval cancelled by the dependency
    assert stopped(train_1="TIMEOUT", train_3="NODE_FAIL", export="CANCELLED", eval="CANCELLED") == "train-3"
    assert stopped(eval="FAILED") == "eval"
    assert stopped(export="CANCELLED", eval="CANCELLED") == "export"  # cancelled by hand


# --------------------------------------------------------------------------------------
# on the local two-node Slurm cluster
# --------------------------------------------------------------------------------------
@pytest.fixture
def cluster(slurm_cluster):
    return slurm_cluster


def _slurm_pipeline(cluster, args, timeout_s: float, entry=None) -> subprocess.CompletedProcess:
    from dapo_mega.distributed import free_port

    env = {**cluster.env(), "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1", "PYTHON": sys.executable}
    return _pipeline(["--sbatch-opt=--mem=4000", "--wait", *args], timeout_s, env, entry)


def _job_ids(stdout: str) -> dict:
    """stage -> job id, from the launcher's summary table (its first printing)."""
    ids = {}
    for m in re.finditer(r"^(data|import|verify|train-\d+|export|eval)\s+(\d+)\s", stdout, re.M):
        ids.setdefault(m.group(1), m.group(2))
    return ids


@pytest.mark.slow  # seven jobs of the tiny model: ~2 min on 2 cores
@pytest.mark.slurm
def test_whole_pipeline_on_slurm_every_stage_completed(cluster, inputs, tmp_path):
    # the experiment's entry point: 2 nodes, a chain of 2 jobs of 30 minutes
    out = _slurm_pipeline(cluster, [*_files(inputs), "--output-dir", str(tmp_path), *TINY_OVERRIDES], timeout_s=300,
                          entry=REPO / "launch" / "tiny_cpu_slurm.sh")
    run_dir = tmp_path / "tiny_cpu_slurm"
    logs = run_dir / "logs" / "pipeline"
    ids = _job_ids(out.stdout)
    everything = out.stdout + out.stderr + "".join(f"\n===== {p.name}\n{p.read_text()[-2000:]}"
                                                   for p in sorted(logs.glob("*.log")))
    assert out.returncode == 0, everything
    assert list(ids) == ["data", "import", "verify", "train-1", "train-2", "export", "eval"], everything
    for stage, job in ids.items():
        assert cluster.job_info(int(job))["JobState"] == "COMPLETED", everything
        assert (logs / f"{stage}-{job}.log").exists()
    verified = (logs / f"verify-{ids['verify']}.log").read_text()
    assert re.search(r"logits max \|diff\| = \S+ ", verified) and "compared in float32" in verified, verified
    assert "\n  -> PASS\n" in verified and "-> FAIL" not in verified, verified
    # the first link trained the run to its end; the second found it complete and started nothing
    assert "already complete (checkpoint at step 3 of 3)" in (logs / f"train-2-{ids['train-2']}.log").read_text()
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000003"
    assert (run_dir / "hf_final" / "config.json").exists()
    result = json.loads((run_dir / "eval" / "final.json").read_text())
    assert result["k"] == 4 and len(result["problems"]) == 8  # the held-out file's 8 problems x eval.n_samples
    assert result["settings"]["checkpoint"] == str(run_dir / "hf_final")
    assert f"pipeline: the final eval completed; result {run_dir / 'eval' / 'final.json'}" in out.stdout


@pytest.mark.slow
@pytest.mark.slurm
def test_failing_stage_on_slurm_cancels_every_later_stage(cluster, inputs, tmp_path):
    out = _slurm_pipeline(cluster, [*TINY, *_files(inputs, "bad.parquet"), "--output-dir", str(tmp_path),
                                    "--chain", "2", *TINY_OVERRIDES], timeout_s=180)
    logs = tmp_path / "tiny_cpu_slurm" / "logs" / "pipeline"
    ids = _job_ids(out.stdout)
    assert out.returncode == 1, out.stdout + out.stderr
    assert cluster.job_info(int(ids["data"]))["JobState"] == "FAILED"
    data_log = (logs / f"data-{ids['data']}.log").read_text()
    assert "prepare_data: error:" in data_log and BAD_ROW in data_log
    assert "stage 'data' failed with status 1" in data_log
    for stage in ("import", "verify", "train-1", "train-2", "export", "eval"):
        assert cluster.job_info(int(ids[stage]))["JobState"] == "CANCELLED", stage
        assert not (logs / f"{stage}-{ids[stage]}.log").exists(), stage  # never started
    # the launcher's report names the failed stage and quotes its log
    assert "pipeline: stage 'data' ended FAILED; the end of its log:" in out.stdout
    assert BAD_ROW in out.stdout
