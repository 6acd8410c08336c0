"""`dapo-mega train` with multi-turn samples (issue #39 item 2): the tiny run, colocated and
synchronous (partial rollouts on, so an episode cut when the batch fills is resumed the next
step), with a test environment loaded by path. The run's records hold the turns: ledger rows
with several turns and environment spans, metrics rows with turns and tool figures, the
console line with them; and every record check a single-turn run passes."""

from pathlib import Path

from helpers.training import RUN_NAME, check_records_of_run, read_rows, records_by_step, run_train

ENV = str(Path(__file__).resolve().parents[1] / "rollout" / "vowel_env.py") + ":VowelEnv"


def test_a_multi_turn_run_trains_and_records_its_turns(tmp_path):
    # the warm-started tiny model answers in digits: each digit ends a turn
    output = run_train(tmp_path, f"rollout.environment={ENV}", "rollout.max_turns=3",
                       "+rollout.environment_kwargs.done_after=2", "+rollout.environment_kwargs.stops=0123456789",
                       "trainer.total_steps=2", "trainer.eval_interval=0")
    run_dir = tmp_path / RUN_NAME
    check_records_of_run(run_dir, total_steps=2, max_staleness=0)
    rows = [r for recs in records_by_step(run_dir).values() for r in recs]
    assert max(r.turns for r in rows) >= 2 and all(1 <= r.turns <= 3 for r in rows)
    assert all(r.tool_calls <= 2 and (r.env_tokens > 0) == (r.tool_calls > 0) for r in rows)
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
