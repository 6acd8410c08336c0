"""`dapo-mega train` with multi-turn samples (issue #39 item 2): the tiny run, colocated and
synchronous (partial rollouts on, so an episode cut when the batch fills is resumed the next
step), with a test environment loaded by path. The run's records hold the turns: ledger rows
with several turns and environment spans, metrics rows with turns and tool figures, the
console line with them; and every record check a single-turn run passes."""

import json
from pathlib import Path

import pytest
from helpers.training import RUN_NAME, check_records_of_run, read_rows, records_by_step, run_train

ENV = str(Path(__file__).resolve().parents[1] / "rollout" / "vowel_env.py") + ":VowelEnv"


def test_a_multi_turn_run_trains_and_records_its_turns(tmp_path):
    # the warm-started tiny model answers in digits: each digit ends a turn
    # each answer rewards 0.25, folded by their mean (issue #47 item 3): 0.25 however many
    output = run_train(tmp_path, f"rollout.environment={ENV}", "rollout.max_turns=3",
                       "+rollout.environment_kwargs.done_after=2", "+rollout.environment_kwargs.stops=0123456789",
                       "+rollout.environment_kwargs.reward=0.25", "rollout.turn_reward=mean",
                       "trainer.total_steps=2", "trainer.eval_interval=0")
    run_dir = tmp_path / RUN_NAME
    check_records_of_run(run_dir, total_steps=2, max_staleness=0)
    rows = [r for recs in records_by_step(run_dir).values() for r in recs]
    assert max(r.turns for r in rows) >= 2 and all(1 <= r.turns <= 3 for r in rows)
    assert all(r.tool_calls <= 2 and (r.env_tokens > 0) == (r.tool_calls > 0) for r in rows)
    parts = [(r.tool_calls, json.loads(r.reward_components).get("environment", 0.0)) for r in rows]
    assert all(env == (0.25 if calls else 0.0) for calls, env in parts) and (2, 0.25) in parts, parts
    steps = [r for r in read_rows(run_dir) if r.get("step", 0) >= 1 and "loss/pg" in r]
    assert len(steps) == 2 and all("rollout/turns_mean" in r and "rollout/env_token_share" in r for r in steps)
    assert max(r["rollout/turns_mean"] for r in steps) > 1.2, steps
    # the learner's log-probs of the model's tokens, with the environment's answers in the
    # context, are the engine's: both saw the same sequence
    assert all(r["mismatch/logp_abs_max"] < 1e-4 for r in steps), [r["mismatch/logp_abs_max"] for r in steps]
    assert " turns " in output and "tool_err" in output


AGENT = str(Path(__file__).resolve().parents[1] / "rollout" / "openai_agent.py") + ":Continue"


def test_an_agent_that_runs_its_own_loop_trains_on_the_engines_tokens(tmp_path):
    """rollout.agent (issue #47 item 4): each sample is an episode of an agent written against
    the `openai` package, through the round's OpenAI-compatible endpoint; the ledger holds each
    episode's calls as turns with the agent's lines as environment tokens, and the learner's
    log-probs of the model's tokens are the engine's."""
    run_train(tmp_path, f"rollout.agent={AGENT}", "+rollout.agent_kwargs.calls=3", "trainer.total_steps=1",
              "trainer.eval_interval=0")
    run_dir = tmp_path / RUN_NAME
    check_records_of_run(run_dir, total_steps=1, max_staleness=0)
    rows = [r for recs in records_by_step(run_dir).values() for r in recs]
    assert rows and all(r.turns == 3 and r.env_tokens == 4 for r in rows), [(r.turns, r.env_tokens) for r in rows]
    (step,) = [r for r in read_rows(run_dir) if r.get("step", 0) >= 1 and "loss/pg" in r]
    assert step["mismatch/logp_abs_max"] < 1e-4, step["mismatch/logp_abs_max"]


CALC = ["data.synthetic_task=calc_tools", "data.synthetic_min_digits=1", "data.synthetic_max_digits=1",
        "data.prompt_template=raw", "data.apply_chat_template=true", "model.tiny_chat_template=true",
        "model.tiny_max_position_embeddings=512", "algo.max_prompt_length=128", "algo.max_response_length=384",
        "algo.overlong_buffer_length=32", "rollout.environment=tools", "rollout.max_turns=4",
        "+rollout.environment_kwargs.tools=[dapo_mega.environments.calculator:Mul,dapo_mega.environments.calculator:Add]",
        "algo.temperature=0.5", "trainer.total_steps=1", "trainer.eval_interval=0", "trainer.ledger_text=full"]
"""The calc task (a*b+c*d through `mul` and `add`, hermes calls, two at once; data/synthetic.py)
on the tiny model with the chat template that names the tools; its prompt with the tools is
~100 tokens and an episode ~350."""


TOOLS_SHOWN = "template=raw;chat="
"""How the encoder fingerprint of a run whose prompts are rendered by a chat template begins."""


def check_tool_calls(run_dir: Path) -> None:
    """Every call in the ledger (`tool_log`) with its turn, arguments and what the model read
    back, which is the tool's answer (the product or sum the test computes) framed in the
    response where the environment's tokens are; two calls of mul in one turn and add in the
    next made by some episode."""
    rows = [r for recs in records_by_step(run_dir).values() for r in recs]
    assert rows and all(len(json.loads(r.tool_log or "[]")) == r.tool_calls for r in rows)
    both = 0
    for r in rows:
        calls = json.loads(r.tool_log or "[]")
        for c in calls:
            assert 1 <= c["turn"] <= r.turns and f"<tool_response>\n{c['output']}\n</tool_response>" in r.response_text
            if not c["error"]:
                a, b = c["arguments"]["a"], c["arguments"]["b"]
                assert c["output"] == str(a * b if c["name"] == "mul" else a + b), c
        by_turn = [[c["name"] for c in calls if c["turn"] == t and not c["error"]] for t in (1, 2)]
        both += by_turn == [["mul", "mul"], ["add"]]
        assert (r.env_tokens > 0) == (r.tool_calls > 0), r
    assert both >= 2, [json.loads(r.tool_log or "[]") for r in rows]


@pytest.mark.slow
@pytest.mark.sglang
def test_two_tools_called_at_once_train_on_the_embedded_engine_and_on_sglang(tmp_path):
    """Issue #47's done-when: a multi-turn run with two tools and parallel calls (hermes, the
    calc task) trains on the embedded engine, its warm start in the same run, and then from the
    model it exported on the real SGLang 0.5.23 CPU server; each ledger holds every call, its
    result and its tokens, and the learner's log-probs of the model's tokens are the engine's."""
    from sglang_venv import sglang_python_or_skip

    python = sglang_python_or_skip()
    for name in ("embedded", "sglang"):
        (tmp_path / name).mkdir()
    run_train(tmp_path / "embedded", *CALC, "trainer.sft_warmup_steps=150", "trainer.sft_batch_size=16",
              "trainer.sft_lr=3e-3", "trainer.hf_export_interval=1", "trainer.hf_export_dtype=float32", timeout_s=600)
    run_dir = tmp_path / "embedded" / RUN_NAME
    check_records_of_run(run_dir, total_steps=1, max_staleness=0, encoder=TOOLS_SHOWN)
    check_tool_calls(run_dir)
    (step,) = [r for r in read_rows(run_dir) if r.get("step", 0) >= 1 and "loss/pg" in r]
    assert step["mismatch/logp_abs_max"] < 1e-4 and step["rollout/tool_calls"] > 0, step

    model = run_dir / "hf" / "step_000001"
    run_train(tmp_path / "sglang", *CALC, f"model.hf_path={model}", "trainer.sft_warmup_steps=0",
              "rollout.backend=sglang", f"rollout.engine_python={python}", "rollout.num_engines=1",
              "rollout.dtype=float32",  # the learner's (auto is bfloat16 on SGLang: a few hundredths apart)
              "rollout.extra_server_args=[--max-total-tokens,8192]", "rollout.request_timeout_s=300", timeout_s=600)
    run_dir = tmp_path / "sglang" / RUN_NAME
    check_records_of_run(run_dir, total_steps=1, max_staleness=0, encoder=TOOLS_SHOWN)
    check_tool_calls(run_dir)
    (step,) = [r for r in read_rows(run_dir) if r.get("step", 0) >= 1 and "loss/pg" in r]
    assert step["mismatch/logp_abs_max"] < 1e-3, step  # SGLang and the learner saw the same contexts
