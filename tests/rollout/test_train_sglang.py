"""`dapo-mega train rollout.backend=sglang` with the real SGLang 0.5.23 server on a CPU, colocated
(update from tensor in SGLang's own format, engine memory released while the learner trains),
the engine started by the trainer: two steps, and the ledger's policy versions, read from
SGLang's replies, equal the learner's versions.

Then disaggregated (update from distributed over a gloo group) with two learner processes and
two SGLang engines that the test starts through the fleet and the runs attach to by URL, so
the engines outlive each run: one step at TP 2, then resumed at PP 2 to a second; after
each run every engine took the run's pushes inside weight-update sessions, serves the
learner's version, and its greedy output (tokens and log-probs) equals transformers' on the
HF export of the checkpoint the run saved. A disaggregated run whose trainer starts the SGLang
engines itself: tests/faults/test_faults_engines_sglang.py (one engine killed there) and the
Slurm jobs of the recipes' twins with SGLang engines (tests/launch/test_twin_runs.py: a
mixture replaying its experts, and the python tool's turns with SGLang, there).

Needs the SGLang venv (`tools/setup_sglang_cpu.sh`, see test_conformance.py); skips
without it (fails under CI=true). The model is random (no warm start), so dynamic sampling is off: every group
is all-wrong and would be filtered. In the TP 2 / PP 2 runs rewards differ only through the
overlong penalty, so responses run to 48 tokens and are penalised from the 5th: this random
model ends ~40% of them early (EOS), at different lengths, so a step's advantages are never
all zero (all 16 samples running to the end: ~5e-4) and each step moves the weights. With
the default 16 tokens and a 4-token buffer, ~7% of steps had no gradient at all.
"""

import glob
import json
import subprocess
from pathlib import Path

import pytest
from helpers.training import cli_command, kill_group, run_cli, start_train
from sglang_venv import sglang_python_or_skip

from dapo_mega.engines.sglang.endpoint import EngineEndpoint

REPO = Path(__file__).resolve().parents[2]


def test_train_colocated_with_real_sglang(tmp_path):
    """Colocated: the trainer starts the engine itself; disaggregated (update from distributed)
    is the TP 2 / PP 2 test below, whose engine logs are checked the same way."""
    sglang_python = sglang_python_or_skip()
    import pyarrow.parquet as pq

    update_path = "/update_weights_from_tensor"
    out = run_cli("train", "cluster.mode=colocated", "rollout.backend=sglang", f"rollout.engine_python={sglang_python}",
                  "trainer.total_steps=2", "trainer.sft_warmup_steps=0", "algo.dynamic_sampling=false",
                  f"trainer.output_dir={tmp_path}", "trainer.run_name=run",
                  "rollout.extra_server_args=[--max-total-tokens,4096]", timeout_s=900)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    run = tmp_path / "run"
    engine_log = (run / "logs" / "engine-0.log").read_text(errors="replace")
    assert engine_log.count(f"POST {update_path} ") >= 3  # the first push and one per step
    assert engine_log.count("POST /begin_weight_update ") == engine_log.count("POST /end_weight_update ") >= 3
    for step in (1, 2):
        table = pq.read_table(glob.glob(str(run / "ledger" / f"step_{step:08d}.parquet"))[0]).to_pydict()
        assert set(map(int, table["learner_version"])) == {step - 1}
        assert set(map(int, table["policy_version_min"])) == set(map(int, table["policy_version_max"])) == {step - 1}
    # every sync checked exactly: the engine's checksum of every tensor it holds (q/k/v and
    # gate/up fused, SGLang's CPU hash) is the learner's of what it sent (issue #37 item 4)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    checked = [r for r in rows if "checksum/tensors" in r]
    assert len(checked) == 2 and all(r["checksum/tensors"] > 10 and r["checksum/engines"] == 1
                                     and r["checksum/errors"] == 0 for r in checked), checked


# ------------------------------------------------------------------------------------------------
# Disaggregated, TP 2 and PP 2 learners, two SGLang engines that outlive each `dapo-mega train`


PROMPTS = ([20, 21, 22, 23, 24], [30, 31, 32], [5, 40, 41, 42, 7, 60])
GREEDY_STEPS = 8
LOGPROB_ATOL = 1e-3
"""fp32 on both sides: SGLang's CPU kernels and transformers agree to ~1e-5 in log-probs."""


def _engine_greedy(url: str) -> tuple:
    """(weight version, [(token ids, log-probs) per prompt]) of one engine, temperature 0."""
    import asyncio

    from dapo_mega.engines.sglang.client import EngineClient

    async def main():
        async with EngineClient(EngineEndpoint(url, timeout_s=300)) as client:
            res = await client.generate(list(PROMPTS), {"n": 1, "temperature": 0.0, "max_new_tokens": GREEDY_STEPS,
                                                        "ignore_eos": True}, return_logprob=True)
            return await client.weight_version(), [(r.token_ids, r.logprobs) for r in res]
    return asyncio.run(main())


def _hf_greedy(model_dir: Path) -> list:
    """[(token ids, log-probs) per prompt]: transformers' argmax decoding of the HF checkpoint, fp32."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids, logprobs = list(prompt), []
            for _ in range(GREEDY_STEPS):
                logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
                ids.append(int(logp.argmax()))
                logprobs.append(float(logp[ids[-1]]))
            out.append((ids[len(prompt):], logprobs))
    return out


def _assert_same_greedy(got: list, want: list, what: str) -> None:
    for prompt, (g, w) in zip(PROMPTS, zip(got, want)):
        assert g[0] == w[0], f"{what}: greedy tokens of prompt {prompt}: {g[0]} != transformers' {w[0]}"
        assert max(abs(a - b) for a, b in zip(g[1], w[1])) < LOGPROB_ATOL, f"{what}: log-probs {g[1]} vs {w[1]}"


def _differs(a: list, b: list) -> bool:
    return any(x[0] != y[0] or max(abs(p - q) for p, q in zip(x[1], y[1])) > 10 * LOGPROB_ATOL for x, y in zip(a, b))


def _update_counts(logs: Path) -> dict:
    """engine log name -> (POST /update_weights_from_distributed, /begin_weight_update,
    /end_weight_update) counts so far."""
    counts = {}
    for log in sorted(logs.glob("engine-*.log")):
        text = log.read_text(errors="replace")
        counts[log.name] = tuple(text.count(f"POST {path} ") for path in (
            "/update_weights_from_distributed", "/begin_weight_update", "/end_weight_update"))
    return counts


@pytest.fixture(scope="module")
def two_sglang_engines(tmp_path_factory):
    """Two real SGLang engines (fp32, CPU) serving a tiny model of another seed than the
    learner's, as weight version "engine-start": only a weight sync makes them answer as the
    learner's export does. Started through the project's fleet; the runs attach by URL."""
    from dapo_mega.config import RolloutConfig
    from dapo_mega.engines.fleet import EngineFleet
    from dapo_mega.models.tiny import build_tiny_model_dir

    python = sglang_python_or_skip()
    root = tmp_path_factory.mktemp("two_engines")
    engine_model, learner_model = root / "engine_model", root / "learner_model"
    build_tiny_model_dir(engine_model, seed=11)
    build_tiny_model_dir(learner_model, seed=12)
    cfg = RolloutConfig(backend="sglang", engine_python=str(python), dtype="float32", health_timeout_s=600,
                        request_timeout_s=600, extra_server_args=["--max-total-tokens", "4096"], num_engines=2)
    fleet = EngineFleet(cfg, str(engine_model), root / "logs", device="cpu", weight_version="engine-start",
                        extra_env={"OMP_NUM_THREADS": "1"})
    try:
        urls = [e.url for e in fleet.start(2)]
        learner_greedy = _hf_greedy(learner_model)
        for url in urls:  # the check below can tell the learner's weights from the engines' own
            version, got = _engine_greedy(url)
            assert version == "engine-start"
            _assert_same_greedy(got, _hf_greedy(engine_model), f"engine {url} at start")
            assert _differs(got, learner_greedy)
        yield urls, learner_model, root / "logs"
    finally:
        fleet.close()


@pytest.mark.slow
@pytest.mark.sglang
def test_disaggregated_parallel_learners_sync_two_sglang_engines(tmp_path, two_sglang_engines):
    """`dapo-mega train` disaggregated with two learner processes attached by URL to two SGLang
    engines: one step at TP 2, then resumed at PP 2 (two stages taking turns to broadcast; the
    optimizer state is fully reshardable) to a second. After each run every engine reports the
    learner's version and its greedy output (tokens and log-probs) equals transformers' on the
    HF export of the checkpoint that run saved; the ledger's versions are those SGLang's
    replies carried."""
    import pyarrow.parquet as pq

    from dapo_mega.weights.convert import export_megatron_checkpoint

    urls, learner_model, engine_logs = two_sglang_engines
    run = tmp_path / "run"
    base = cli_command("train", "cluster.mode=disaggregated", "rollout.backend=sglang",
            f"rollout.engine_python={sglang_python_or_skip()}", f"rollout.engine_urls=[{','.join(urls)}]",
            "rollout.num_engines=2", "cluster.num_learner_processes=2", "megatron.optimizer_sharding=fully_reshardable",
            f"model.hf_path={learner_model}",
            "trainer.sft_warmup_steps=0", "trainer.eval_interval=0", "algo.dynamic_sampling=false",
            "algo.n_samples_per_prompt=4", "algo.train_batch_size=4", "algo.gen_batch_size=4",
            "algo.mini_batch_size=2", "algo.lr=2e-3",
            "algo.max_response_length=48", "algo.overlong_buffer_length=44", f"trainer.output_dir={tmp_path}", "trainer.run_name=run",
            "trainer.wandb_mode=disabled", "trainer.plot=false")
    layout = {1: "megatron.tensor_model_parallel_size=2", 2: "megatron.pipeline_model_parallel_size=2"}
    exported: dict = {}
    engine_logs_before = _update_counts(engine_logs)
    for steps in (1, 2):
        log_path = tmp_path / f"train-{steps}.log"
        proc = start_train(base + [layout[steps], f"trainer.total_steps={steps}"], log_path)
        try:
            proc.wait(timeout=900)
        except subprocess.TimeoutExpired:
            pass
        finally:
            code = proc.poll()
            kill_group(proc)  # the trainer and its torchrun ranks (their own process group)
        assert code == 0, f"run to step {steps} exited with {code}:\n" + log_path.read_text(errors="replace")[-6000:]

        table = pq.read_table(glob.glob(str(run / "ledger" / f"step_{steps:08d}.parquet"))[0]).to_pydict()
        assert set(map(int, table["learner_version"])) == {steps - 1}
        assert set(map(int, table["policy_version_min"])) == set(map(int, table["policy_version_max"])) == {steps - 1}
        assert len(table["learner_version"]) == 4 * 4 and set(table["engine_id"]) <= set(urls)
        # each engine took this run's first push and its step's sync from distributed, inside
        # weight-update sessions that all ended
        counts = _update_counts(engine_logs)
        for log, (updates, begins, ends) in counts.items():
            updates_before, begins_before, _ = engine_logs_before.get(log, (0, 0, 0))
            assert updates - updates_before >= 2 and begins == ends and begins - begins_before >= 2, (log, counts)
        engine_logs_before = counts

        # the sync checked exactly on both engines: their checksums, in the dtype they report
        # (fp32, started by the fixture; this config alone would say bf16), are the learner's
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
        assert rows[-1]["checksum/engines"] == 2 and rows[-1]["checksum/errors"] == 0, rows[-1]

        export = tmp_path / f"hf-{steps}"
        export_megatron_checkpoint(run, export, hf_config_from=learner_model, progress=False)
        want = _hf_greedy(export)
        if steps == 2:  # the step moved the weights: the check below tells step 2 from step 1
            assert _differs(want, exported[1])
        exported[steps] = want
        for url in urls:
            version, got = _engine_greedy(url)
            assert version == str(steps), f"engine {url} serves version {version} after step {steps}"
            _assert_same_greedy(got, want, f"engine {url} after step {steps}")
        if steps == 2:
            assert "resumed from" in log_path.read_text(errors="replace")
            for log in sorted(engine_logs.glob("engine-*.log")):  # each stage broadcast on a group of its own
                assert "group_name=dapo_weight_sync_pp1" in log.read_text(errors="replace"), log
