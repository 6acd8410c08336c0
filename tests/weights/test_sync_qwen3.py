"""A tiny Qwen3 on the embedded engine, before and after a live sync from Megatron learners.

Two embedded engines serve a tiny random Qwen3 (head_dim twice hidden / heads, random
q_norm / k_norm weights: `tests/qwen3_dirs.py`); their greedy tokens and log-probs equal
transformers' Qwen3ForCausalLM on the same checkpoint. Then learners at TP 2 and at PP 2,
after one DAPO update, sync into them over gloo (`sync_learner_weights`, the live path of
the HF <-> Megatron mapping): the engines hold exactly the HF export of the learner
(`export_learner_to_hf`, the conversion path) and their greedy output equals transformers'
on that export. The PP 2 case serves a tiny Llama with Llama-3 RoPE scaling instead (all
three bands of the rescaling inside its frequencies), so the scaled rotary path of the
engine and of the mapping is held to transformers after a sync too.
"""

from __future__ import annotations

import asyncio

import pytest
from dist_helpers import run_distributed
from qwen3_dirs import build_qwen3_dir, hf_greedy
from test_sync_learner_engines import _learner_sync, assert_engines_serve_export

from dapo_mega.config import RolloutConfig
from dapo_mega.engines.fleet import EngineFleet, free_port
from dapo_mega.engines.sglang.client import EngineClient

PROMPTS = ([20, 21, 22, 23, 24], [30, 31, 32], [5, 40, 41, 42, 7, 60])
GREEDY_STEPS = 6
LOGPROB_ATOL = 1e-4


LLAMA3_SCALING = {"factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def _model_dir(kind: str, root):
    if kind == "qwen3":
        return build_qwen3_dir(root / "qwen3", seed=3), "Qwen3ForCausalLM", "q_norm"
    from dapo_mega.models.tiny import build_tiny_model_dir

    return (build_tiny_model_dir(root / "llama3", seed=3, architecture="llama", rope_scaling=LLAMA3_SCALING),
            "LlamaForCausalLM", "q_proj")


def engine_greedy(url: str) -> list:
    """[(token ids, log-probs) per prompt] of one engine at temperature 0."""
    async def main():
        async with EngineClient(url) as client:
            res = await client.generate(list(PROMPTS), {"temperature": 0.0, "max_new_tokens": GREEDY_STEPS,
                                                        "ignore_eos": True}, return_logprob=True)
            return [(r.token_ids, r.logprobs) for r in res]
    return asyncio.run(main())


def assert_same_greedy(got: list, want: list, what: str) -> None:
    for prompt, (g, w) in zip(PROMPTS, zip(got, want)):
        assert g[0] == w[0], f"{what}: greedy tokens of prompt {prompt}: {g[0]} != transformers' {w[0]}"
        assert max(abs(a - b) for a, b in zip(g[1], w[1])) < LOGPROB_ATOL, f"{what}: log-probs {g[1]} vs {w[1]}"


@pytest.mark.slow  # ~57 s each on 2 cores
@pytest.mark.parametrize("kind,tp,pp", [("qwen3", 2, 1), ("llama3_scaled", 1, 2)], ids=["qwen3_tp2", "llama3_scaled_pp2"])
def test_engines_greedy_equals_transformers_before_and_after_learner_sync(tmp_path, kind, tp, pp):
    from safetensors.torch import load_file

    model_dir, architecture, some_weight = _model_dir(kind, tmp_path)
    with EngineFleet(RolloutConfig(), str(model_dir), tmp_path / "logs", num_threads=1) as fleet:
        urls = [e.url for e in fleet.start(2)]
        at_start = hf_greedy(model_dir, PROMPTS, GREEDY_STEPS, architecture=architecture)
        for url in urls:
            assert_same_greedy(engine_greedy(url), at_start, f"engine {url} at start")
        export_dir = tmp_path / "export"
        run_distributed(_learner_sync, 2, args=(tp, pp, str(model_dir), urls, [free_port(), free_port()],
                                                str(export_dir)), timeout_s=400)
        exported = {}
        for shard in export_dir.glob("*.safetensors"):
            exported.update(load_file(str(shard)))
        assert any(some_weight in name for name in exported)
        assert_engines_serve_export(urls, model_dir, exported, "7")
        after = hf_greedy(model_dir, PROMPTS, GREEDY_STEPS, exported, architecture=architecture)
        for url in urls:
            assert_same_greedy(engine_greedy(url), after, f"engine {url} after the sync")
