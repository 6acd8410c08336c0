"""The chain task (data.synthetic_task=chain): worked solutions whose length grows with the
number of operands, verified on the final `Answer:` line by the DAPO verifier."""

import random

import pytest

from dapo_mega.config import ConfigError, load_config
from dapo_mega.data import (
    CHAIN_SOURCE,
    build_datasets,
    evaluate_expression,
    generate_synthetic_problems,
    make_chain_problem,
    reference_response,
    solve_chain,
    verification_prefix,
)
from dapo_mega.reward import build_verifier


def test_worked_solution_by_hand():
    p = make_chain_problem("12+34-5", "train")
    assert p.prompt == "Q: 12+34-5\n" and p.ground_truth == "41" and p.data_source == CHAIN_SOURCE
    assert p.reference_response == "12+34=46\n46-5=41\nAnswer: 41"
    assert reference_response(p) == p.reference_response and p.answer_prefix == ""
    # multiplication first (leftmost first), then left to right
    assert solve_chain([2, 3, 4, 5], ["+", "*", "-"]) == (["3*4=12", "2+12=14", "14-5=9"], 9)
    assert solve_chain([2, 3, 4], ["*", "*"]) == (["2*3=6", "6*4=24"], 24)
    assert solve_chain([5, 9, 1], ["-", "-"]) == (["5-9=-4", "-4-1=-5"], -5)


def test_solution_value_equals_the_expression_value():
    rng = random.Random(0)
    for _ in range(500):
        n = rng.randint(2, 6)
        operands = [rng.randint(0, 99) for _ in range(n)]
        operators = [rng.choice("+-*") for _ in range(n - 1)]
        lines, value = solve_chain(operands, operators)
        assert value == evaluate_expression(operands, operators) and len(lines) == n - 1


def test_length_grows_with_operands_and_difficulty_is_adjustable():
    train, held_out = generate_synthetic_problems(1000, 100, 1, 2, "+-", num_operands=5, seed=3, task="chain")
    assert {p.id for p in train}.isdisjoint({p.id for p in held_out})
    by_ops = {}
    for p in train:
        by_ops.setdefault(p.prompt.count("+") + p.prompt.count("-") + 1, []).append(len(p.reference_response))
    assert sorted(by_ops) == [2, 3, 4, 5]  # 2..num_operands operands
    means = [sum(v) / len(v) for _, v in sorted(by_ops.items())]
    assert means == sorted(means) and means[-1] > means[0] + 20
    harder, _ = generate_synthetic_problems(200, 20, 3, 3, "+-*", num_operands=5, seed=3, task="chain")
    assert sum(len(p.reference_response) for p in harder) > sum(len(p.reference_response) for p in train[:200])
    # deterministic in the seed; the plain task is unchanged by the new parameter
    assert generate_synthetic_problems(50, 5, task="chain", seed=9) == generate_synthetic_problems(50, 5, task="chain", seed=9)
    plain, _ = generate_synthetic_problems(50, 5, seed=9)
    assert all(p.reference_response == "" and p.prompt.endswith("Answer:") for p in plain)


def test_the_verifier_accepts_the_worked_solution_and_checks_the_final_answer():
    verifier = build_verifier("dapo")
    p = make_chain_problem("7+8-20", "eval")
    prefix = verification_prefix(p, "raw")
    assert verifier.score(prefix + p.reference_response, p.ground_truth).correct
    wrong_end = "7+8=15\n15-20=-5\nAnswer: 5"
    assert not verifier.score(prefix + wrong_end, p.ground_truth).correct
    assert not verifier.score(prefix + "7+8=15\n15-20=-5", p.ground_truth).correct  # truncated: no answer line


def test_selected_by_the_data_config():
    cfg = load_config(["data.synthetic_task=chain", "data.synthetic_num_operands=3", "data.synthetic_num_train=50",
                       "data.synthetic_num_eval=10"])
    train, held_out, _ = build_datasets(cfg.data)
    assert all(p.data_source == CHAIN_SOURCE for p in train + held_out)
    with pytest.raises(ConfigError, match="data.synthetic_task"):
        load_config(["data.synthetic_task=essay"])
