"""`dapo-mega train` on a tiny random Qwen3 (`model.hf_path`), 3 steps, with each rollout backend.

Embedded engine, colocated: the run's records are those test_trainer_modes checks for the
tiny Qwen2. Real SGLang 0.5.23 on the CPU (its Qwen3ForCausalLM), disaggregated, attached
by URL to an engine the test starts with another seed's weights: after the run the engine
serves the learner's last version, and its greedy tokens and log-probs equal transformers'
on the HF export of the checkpoint the run saved (only the syncs can make them equal).

The model is random (no warm start on a pretrained checkpoint), so dynamic sampling is off
and the SGLang run's rewards differ through the overlong penalty only (responses of up to
48 tokens, penalised from the 5th, as the random-model SGLang runs did).
"""

from __future__ import annotations

import pytest
from helpers.training import RUN_NAME, check_records_of_run, run_cli, run_train
from qwen3_dirs import build_qwen3_dir, hf_greedy
from sglang_venv import sglang_python_or_skip

PROMPTS = ([20, 21, 22, 23, 24], [30, 31, 32], [5, 40, 41, 42, 7, 60])
GREEDY_STEPS = 8
LOGPROB_ATOL = 1e-3
"""fp32 on both sides: SGLang's CPU kernels and transformers agree to ~1e-5 in log-probs."""


@pytest.mark.slow  # ~75 s on 2 cores
def test_qwen3_trains_three_steps_with_the_embedded_engine(tmp_path):
    model = build_qwen3_dir(tmp_path / "qwen3", seed=7)
    run_train(tmp_path, f"model.hf_path={model}", "model.name=tiny-qwen3", "trainer.sft_warmup_steps=0")
    (tmp_path / RUN_NAME / "base_model").symlink_to(model)  # where the records check finds the synced bytes
    check_records_of_run(tmp_path / RUN_NAME, total_steps=3, max_staleness=0)


def _engine_greedy(url: str) -> tuple:
    import asyncio

    from dapo_mega.engines.sglang.client import EngineClient
    from dapo_mega.engines.sglang.endpoint import EngineEndpoint

    async def main():
        async with EngineClient(EngineEndpoint(url, timeout_s=300)) as client:
            res = await client.generate(list(PROMPTS), {"n": 1, "temperature": 0.0, "max_new_tokens": GREEDY_STEPS,
                                                        "ignore_eos": True}, return_logprob=True)
            return await client.weight_version(), [(r.token_ids, r.logprobs) for r in res]
    return asyncio.run(main())


def _hf_greedy(model_dir) -> list:
    return hf_greedy(model_dir, PROMPTS, GREEDY_STEPS)


def _same_greedy(got: list, want: list) -> bool:
    return all(g[0] == w[0] and max(abs(a - b) for a, b in zip(g[1], w[1])) < LOGPROB_ATOL
               for g, w in zip(got, want))


@pytest.mark.slow
@pytest.mark.sglang
def test_qwen3_trains_three_steps_with_real_sglang_and_serves_the_export(tmp_path):
    from dapo_mega.config import RolloutConfig
    from dapo_mega.engines.fleet import EngineFleet
    from dapo_mega.weights.convert import export_megatron_checkpoint

    python = sglang_python_or_skip()
    engine_model = build_qwen3_dir(tmp_path / "engine_model", seed=11)
    learner_model = build_qwen3_dir(tmp_path / "learner_model", seed=12)
    cfg = RolloutConfig(backend="sglang", engine_python=str(python), dtype="float32", health_timeout_s=600,
                        request_timeout_s=600, extra_server_args=["--max-total-tokens", "4096"], num_engines=1)
    with EngineFleet(cfg, str(engine_model), tmp_path / "logs", device="cpu", weight_version="engine-start",
                     extra_env={"OMP_NUM_THREADS": "1"}) as fleet:
        (url,) = [e.url for e in fleet.start(1)]
        version, got = _engine_greedy(url)
        assert version == "engine-start" and _same_greedy(got, _hf_greedy(engine_model)), got
        assert not _same_greedy(got, _hf_greedy(learner_model))  # the check below tells the weights apart
        out = run_cli("train", "cluster.mode=disaggregated", "rollout.backend=sglang", f"rollout.engine_python={python}",
                      f"rollout.engine_urls=[{url}]", "rollout.num_engines=1", f"model.hf_path={learner_model}",
                      "model.name=tiny-qwen3", "trainer.total_steps=3", "trainer.sft_warmup_steps=0",
                      "trainer.eval_interval=0", "algo.dynamic_sampling=false", "algo.n_samples_per_prompt=4",
                      "algo.train_batch_size=2", "algo.gen_batch_size=2", "algo.mini_batch_size=2", "algo.lr=2e-3",
                      "algo.max_response_length=48", "algo.overlong_buffer_length=44", f"trainer.output_dir={tmp_path}",
                      f"trainer.run_name={RUN_NAME}", "trainer.wandb_mode=disabled", "trainer.plot=false",
                      timeout_s=900)
        assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
        export = tmp_path / "hf"
        export_megatron_checkpoint(tmp_path / RUN_NAME, export, hf_config_from=learner_model, progress=False)
        version, got = _engine_greedy(url)
        want = _hf_greedy(export)
        assert version == "3", f"the engine serves version {version} after 3 steps"
        assert _same_greedy(got, want), f"SGLang after the run: {got}\ntransformers on the export: {want}"
