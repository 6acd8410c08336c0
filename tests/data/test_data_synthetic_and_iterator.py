"""The synthetic arithmetic task, prompt templates and the resumable prompt iterator."""

import pytest

from dapo_mega.config import DataConfig
from dapo_mega.data import (
    DAPO_PROMPT_TEMPLATE,
    DataError,
    Problem,
    PromptIterator,
    build_datasets,
    evaluate_expression,
    format_prompt,
    generate_synthetic_problems,
    make_arithmetic_problem,
    verification_prefix,
)
from dapo_mega.reward import DapoVerifier, score_responses


def test_expression_values_by_hand():
    assert evaluate_expression([12, 34], ["+"]) == 46
    assert evaluate_expression([5, 9], ["-"]) == -4
    assert evaluate_expression([2, 3, 4], ["+", "*"]) == 14      # 2 + 12
    assert evaluate_expression([2, 3, 4, 5], ["*", "-", "*"]) == -14  # 6 - 20
    p = make_arithmetic_problem("12+34", "train")
    assert p.prompt == "Q: 12+34\nAnswer:" and p.ground_truth == "46" and p.answer_prefix == "Answer:"


def test_synthetic_problems_are_short_disjoint_and_deterministic():
    train, held = generate_synthetic_problems(500, 50, min_digits=1, max_digits=2, ops="+-", seed=7)
    assert (len(train), len(held)) == (500, 50)
    assert not {p.prompt for p in train} & {p.prompt for p in held}
    assert len({p.prompt for p in train}) == 500 and len({p.id for p in train + held}) == 550
    for p in train + held:
        expression = p.prompt[len("Q: "):-len("\nAnswer:")]
        assert len(p.prompt) <= 20 and set(expression) <= set("0123456789+-")
        a, op, b = (expression.partition("+") if "+" in expression else expression.partition("-"))
        assert 0 <= int(a) <= 99 and 0 <= int(b) <= 99
        assert int(p.ground_truth) == (int(a) + int(b) if op == "+" else int(a) - int(b))
    again_train, again_held = generate_synthetic_problems(500, 50, min_digits=1, max_digits=2, ops="+-", seed=7)
    assert again_train == train and again_held == held
    other, _ = generate_synthetic_problems(500, 50, min_digits=1, max_digits=2, ops="+-", seed=8)
    assert other != train


def test_small_space_is_enumerated_and_capped():
    # 1-digit, "+" only, 2 operands: 10·10 = 100 expressions; 30 held out, train cut to 70
    train, held = generate_synthetic_problems(1000, 30, min_digits=1, max_digits=1, ops="+", seed=0)
    assert (len(train), len(held)) == (70, 30)
    assert len({p.prompt for p in train + held}) == 100
    with pytest.raises(DataError, match="synthetic_num_eval"):
        generate_synthetic_problems(10, 101, min_digits=1, max_digits=1, ops="+")
    with pytest.raises(DataError):
        generate_synthetic_problems(10, 10, ops="/")


def test_correct_synthetic_response_scores_with_the_dapo_verifier():
    train, _ = generate_synthetic_problems(20, 5, seed=3)
    responses = [f" {p.ground_truth}\n" for p in train] + [f" {int(p.ground_truth) + 1}\n" for p in train]
    truths = [p.ground_truth for p in train] * 2
    prefixes = [verification_prefix(p, "raw") for p in train] * 2
    results, _ = score_responses(DapoVerifier(), responses, truths, answer_prefixes=prefixes)
    assert [r.correct for r in results] == [True] * 20 + [False] * 20
    # the expected response fits the default 16-token budget of a character-level model
    assert max(len(r) for r in responses) <= 16


def test_format_prompt_templates():
    p = Problem("1", "What is 2+2?", "4", "toy", answer_prefix="Answer:")
    assert format_prompt(p, "raw") == "What is 2+2?"
    text = format_prompt(p, "dapo")
    assert text.startswith("Solve the following math problem step by step. The last line of your response")
    assert "\n\nWhat is 2+2?\n\n" in text
    assert text.endswith('Remember to put your answer on its own line after "Answer:".')
    assert text == DAPO_PROMPT_TEMPLATE.format(problem="What is 2+2?")
    assert verification_prefix(p, "raw") == "Answer:" and verification_prefix(p, "dapo") == ""
    with pytest.raises(ValueError):
        format_prompt(p, "chatml")


def test_build_datasets_synthetic_default():
    cfg = DataConfig(synthetic_num_train=300, synthetic_num_eval=40)
    train, held, revision = build_datasets(cfg)
    assert (len(train), len(held)) == (300, 40) and len(revision) == 12
    assert build_datasets(cfg)[2] == revision  # deterministic
    assert build_datasets(DataConfig(synthetic_num_train=300, synthetic_num_eval=40, seed=99))[2] != revision


def make_problems(n):
    return [Problem(str(i), f"p{i}", str(i), "toy") for i in range(n)]


def test_iterator_epochs_cover_everything_once():
    it = PromptIterator(make_problems(10), seed=1)
    first = [p.id for p in it.next_batch(10)]
    second = [p.id for p in it.next_batch(10)]
    assert sorted(first) == sorted(second) == sorted(str(i) for i in range(10))
    assert first != second  # reshuffled per epoch
    assert it.state_dict()["epoch"] == 2 and it.state_dict()["position"] == 0
    plain = PromptIterator(make_problems(4), shuffle=False)
    assert [p.id for p in plain.next_batch(6)] == ["0", "1", "2", "3", "0", "1"]  # crosses the epoch


@pytest.mark.parametrize("k", [0, 3, 7, 10, 23])
def test_iterator_resume_equals_uninterrupted(k):
    problems = make_problems(7)
    uninterrupted = PromptIterator(problems, seed=42, revision="abc")
    expected = [p.id for p in uninterrupted.next_batch(k + 20)]

    first = PromptIterator(problems, seed=42, revision="abc")
    head = [p.id for p in first.next_batch(k)]
    state = dict(first.state_dict())
    resumed = PromptIterator(problems, seed=42, revision="abc")
    resumed.load_state_dict(state)
    tail = [p.id for b in (3, 5, 12) for p in resumed.next_batch(b)]
    assert head + tail == expected


def test_iterator_refuses_other_data():
    state = PromptIterator(make_problems(5), seed=1, revision="r1").state_dict()
    with pytest.raises(DataError, match="revision"):
        PromptIterator(make_problems(5), seed=1, revision="r2").load_state_dict(state)
    with pytest.raises(DataError, match="num_problems"):
        PromptIterator(make_problems(6), seed=1, revision="r1").load_state_dict(state)
    with pytest.raises(DataError, match="seed"):
        PromptIterator(make_problems(5), seed=2, revision="r1").load_state_dict(state)
    with pytest.raises(DataError):
        PromptIterator([], seed=1)


def test_the_sum_tasks_draw_the_same_problems_and_the_tool_reference_is_the_tool_turn():
    """`sum` and `sum_tool` (issue #39 item 5): one expression set for a seed, so the two arms
    of the python-tool ablation are held out on the same problems; `sum_tool`'s reference is
    exactly what a rollout's turn with the python tool produces (the model's code block, the
    tool's answer from a real sandbox run, then the answer line), and the DAPO verifier
    accepts both references."""
    from dapo_mega.data.synthetic import generate_synthetic_problems
    from dapo_mega.environments.python_tool import PythonTool
    from dapo_mega.reward import build_verifier

    kw = dict(min_digits=5, max_digits=5, ops="+", seed=3)
    train_tool, eval_tool = generate_synthetic_problems(20, 6, task="sum_tool", **kw)
    train_plain, eval_plain = generate_synthetic_problems(20, 6, task="sum", **kw)
    assert [p.prompt for p in eval_tool] == [p.prompt for p in eval_plain]
    assert [p.ground_truth for p in train_tool] == [p.ground_truth for p in train_plain]
    p = eval_tool[0]
    a, b = p.prompt[3:-1].split("+")
    assert len(a) == len(b) == 5 and p.ground_truth == str(int(a) + int(b))
    turn = p.reference_response[:p.reference_response.index("</code>") + len("</code>")]
    tool = PythonTool()
    tool.reset(p)
    step = tool.step(turn)
    assert not step.done and step.tool_errors == {}, step
    assert p.reference_response == turn + step.observation + f"Answer: {p.ground_truth}"
    assert eval_plain[0].reference_response == f"Answer: {p.ground_truth}"
    verifier = build_verifier("dapo")
    assert verifier.score(p.reference_response, p.ground_truth).correct
    assert verifier.score(eval_plain[0].reference_response, p.ground_truth).correct


def test_the_calc_reference_is_the_tools_episode_and_its_answer_is_right():
    """`calc_tools` (issue #47): a*b+c*d; the reference's messages, each ended where the model
    writes its EOS (MESSAGE_END), are answered by the tools environment with the calculator
    tools exactly as the reference reads on (two mul calls at once, then add), and the answer
    line holds the value Python computes from the prompt."""
    from dapo_mega.data.problem import MESSAGE_END
    from dapo_mega.data.synthetic import generate_synthetic_problems
    from dapo_mega.environments.calculator import TOOL_PATHS
    from dapo_mega.environments.tool_calls import ToolEnvironment
    from dapo_mega.reward import build_verifier

    train, held_out = generate_synthetic_problems(30, 5, min_digits=2, max_digits=2, task="calc_tools", seed=5)
    assert len(train) == 30 and not {p.prompt for p in train} & {p.prompt for p in held_out}
    for p in held_out:
        expression = p.prompt[3:-1]
        assert p.ground_truth == str(eval(expression)) and expression.count("*") == 2  # noqa: S307 -- digits and ops
        env = ToolEnvironment(list(TOOL_PATHS))
        *turns, last = p.reference_response.split(MESSAGE_END)
        text, calls = turns[0], []
        for rest in [*turns[1:], last]:
            step = env.step(text.rsplit("</tool_response>\n", 1)[-1])
            assert not step.done and step.tool_errors == {} and rest.startswith(step.observation), (step, rest)
            calls.append([c["name"] for c in step.calls])
            text = rest
        assert calls == [["mul", "mul"], ["add"]]
        assert last.endswith(f"Answer: {p.ground_truth}") and env.step(last.split("</tool_response>\n")[-1]).done
        assert build_verifier("dapo").score(p.reference_response.replace(MESSAGE_END, ""), p.ground_truth).correct
