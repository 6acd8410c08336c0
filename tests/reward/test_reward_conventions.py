"""Rewards written for verl or slime load unchanged: every accepted return form by hand
(reward/returns.py), verl's and slime's calling conventions (reward/plugin.py), a reward
file loaded by its path, and the shipped examples scored in the worker pool."""

import textwrap
from pathlib import Path

import pytest

from dapo_mega.config import AlgoConfig
from dapo_mega.reward import (
    PluginVerifier,
    RewardResult,
    VerifierPool,
    build_verifier,
    check_verifier,
    problem_metadata,
    score_responses,
    to_verify_result,
)
from dapo_mega.reward.types import VerifyResult

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "rewards"
VERL_FILE = EXAMPLES / "verl_compute_score.py"


@pytest.mark.parametrize("value, expected", [
    (1.0, VerifyResult(correct=None, reward=1.0)),  # a score, no verdict: accuracy never reads one from it
    (0.0, VerifyResult(correct=None, reward=0.0)),
    (-1, VerifyResult(correct=None, reward=-1.0)),
    (0.1, VerifyResult(correct=None, reward=0.1)),  # a format credit for a wrong answer: not "correct"
    ({"score": 0.0, "acc": True, "pred": 7}, VerifyResult(correct=True, reward=0.0, extracted="7")),
    ({"score": 1.0, "acc": 0.0}, VerifyResult(correct=False, reward=1.0)),  # acc decides, not the score
    ({"score": -0.5}, VerifyResult(correct=None, reward=-0.5)),
    ({"score": 0.1, "format": 0.1}, VerifyResult(correct=None, reward=0.1, components=(("format", 0.1),))),
    ({"score": 2, "acc": False, "pred": None, "fmt": True, "len": 3, "note": "kept out", "ids": [1]},
     VerifyResult(correct=False, reward=2.0, components=(("fmt", 1.0), ("len", 3.0)))),
    (True, VerifyResult(correct=True, reward=1.0)),  # verl: float(res); a bool is a verdict
    (False, VerifyResult(correct=False, reward=0.0)),
    ((1.0, "7"), VerifyResult(correct=None, reward=1.0)),  # verl's float(res[0]): prime_math's pairs
    ((True, "7"), VerifyResult(correct=True, reward=1.0)),
    ([False, None], VerifyResult(correct=False, reward=0.0)),
    (RewardResult(score=0.5, correct=True, components={"b": 1, "a": 2}, extracted="x" * 300),
     VerifyResult(correct=True, reward=0.5, extracted="x" * 200, components=(("a", 2.0), ("b", 1.0)))),
])
def test_each_accepted_return_form_by_hand(value, expected):
    assert to_verify_result("reward plugin m:f", value) == expected


def test_a_bad_return_names_the_reward_what_it_returned_and_what_is_accepted():
    with pytest.raises(TypeError) as info:
        to_verify_result("reward plugin m:f", ["1.0"])
    assert str(info.value) == ("reward plugin m:f returned list ['1.0']; accepted: a finite number (the score, no "
                               "verdict), a bool (the verdict), a tuple whose first item is one of those "
                               "(verl reads res[0]), a dict with a finite 'score' (optional 'acc' verdict, 'pred' "
                               "answer, other numeric keys as components), or dapo_mega.reward.RewardResult")
    for bad in ((), (float("nan"), 1), float("-inf"), "1.0", {"acc": True}):
        with pytest.raises(TypeError, match=r"^reward plugin m:f"):
            to_verify_result("reward plugin m:f", bad)


CONVENTIONS = """
import asyncio

SEEN = []

def verl_style(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 1.0 if solution_str.endswith(ground_truth) else 0.0, "source": 1.0 * (data_source == "aime"),
            "index_is_id": float(extra_info["index"] == extra_info["id"])}

def verl_kwargs(**kwargs):  # verl calls by keyword: a **kwargs function is called too
    return float(sorted(kwargs) == ["data_source", "extra_info", "ground_truth", "solution_str"])

async def slime_style(args, sample):
    await asyncio.sleep(0)
    return {"score": 1.0 if sample.response.endswith(sample.label) else -1.0, "prompt_len": len(sample.prompt),
            "id_seen": float(sample.metadata["id"] == "p1")}

async def slime_reads_args(args, sample):
    return float(getattr(args, "rm_url", None) is None)  # getattr with a default works

async def slime_reads_tokens(args, sample):
    return float(len(sample.tokens))

def native(response, ground_truth, metadata):
    return 0.5

def verl_batch(data_sources, solution_strs, ground_truths, extra_infos):  # verl's BatchRewardManager form
    return [{"score": float(s.endswith(g)), "n": float(len(solution_strs)), "id_seen": float(e["id"] == "p1")}
            for s, g, e in zip(solution_strs, ground_truths, extra_infos)]

def verl_batch_one_value(data_sources, solution_strs, ground_truths, extra_infos):
    return 1.0

def verl_batch_unbindable(solution_strs, ground_truths):
    return [1.0]

def verl_with_kwargs(data_source, solution_str, ground_truth, extra_info=None, format_score=0.0, level_bonus=0.0):
    return {"score": format_score + level_bonus * extra_info.get("level", 0), "acc": False}
"""


@pytest.fixture
def conventions(tmp_path, monkeypatch):
    name = f"conv_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(CONVENTIONS))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_verl_and_slime_signatures_are_called_as_their_trainers_call_them(conventions):
    meta = problem_metadata(type("P", (), {"id": "p1", "data_source": "aime", "prompt": "What is 3+4?"})())

    def score(function, response="Answer: 7"):
        return build_verifier(f"{conventions}:{function}").score(response, "7", meta)

    assert score("verl_style") == VerifyResult(correct=None, reward=1.0,
                                               components=(("index_is_id", 1.0), ("source", 1.0)))
    assert score("verl_style", "Answer: 8").reward == 0.0
    assert score("verl_kwargs") == VerifyResult(correct=None, reward=1.0)
    assert score("slime_style") == VerifyResult(correct=None, reward=1.0,
                                                components=(("id_seen", 1.0), ("prompt_len", 12.0)))
    assert score("slime_reads_args").reward == 1.0
    with pytest.raises(AttributeError, match=r"gives a slime reward the Sample fields prompt, response, label and "
                                             r"metadata, not 'tokens'"):
        score("slime_reads_tokens")
    assert score("native").reward == 0.5
    assert score("verl_batch") == VerifyResult(correct=None, reward=1.0, components=(("id_seen", 1.0), ("n", 1.0)))
    with pytest.raises(TypeError, match=r"verl batch reward returned float for one response; it must return a list"):
        score("verl_batch_one_value")
    with pytest.raises(Exception, match=r"verl's batch solution_strs .* or write the per-sample form "
                                        r"\(data_source, solution_str, ground_truth, extra_info=None\)"):
        build_verifier(f"{conventions}:verl_batch_unbindable")


def test_a_slime_reward_that_reads_what_is_not_given_is_refused_at_the_probe(conventions):
    with pytest.raises(Exception, match=r"failed its probe call .*AttributeError: dapo-mega gives a slime reward"):
        check_verifier(f"{conventions}:slime_reads_tokens", timeout_s=5.0)
    assert isinstance(check_verifier(f"{conventions}:slime_style", timeout_s=5.0), PluginVerifier)


def test_a_verl_file_loads_by_its_path_with_verls_default_function(monkeypatch, tmp_path):
    monkeypatch.chdir(REPO)
    relative = "examples/rewards/verl_compute_score.py"
    AlgoConfig(verifier=relative).validate()  # a file path is left to the preflight, like a module path
    verifier = check_verifier(relative, timeout_s=5.0)  # compute_score, verl's default name
    assert verifier.name == relative and verifier.version.startswith(f"{relative}-")  # the file's hash
    assert verifier.score("Answer: 46", "46", {}) == VerifyResult(
        correct=True, reward=1.0, extracted="46", components=(("format_ok", 1.0),))
    named = build_verifier(f"{relative}:exact_match_reward")
    assert named.score("Answer: 46.", "46", {}) == VerifyResult(correct=None, reward=1.0)  # a float: no verdict
    assert named.score("no answer", "46", {}) == VerifyResult(correct=None, reward=-1.0)
    copy = tmp_path / "verl_compute_score.py"  # a second file of the same name is another module
    copy.write_text(VERL_FILE.read_text().replace('"score": 1.0 if acc', '"score": 2.0 if acc'))
    assert build_verifier(str(copy)).score("Answer: 46", "46", {}).reward == 2.0
    assert build_verifier(relative).score("Answer: 46", "46", {}).reward == 1.0


def test_the_shipped_verl_and_slime_examples_score_in_the_worker_pool(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    for spec in (str(VERL_FILE), "slime_custom_rm:custom_rm"):
        verifier = build_verifier(spec)
        pool = VerifierPool(verifier, num_workers=1)
        try:
            results, stats = score_responses(verifier, [" 46\n", " 47\n", "x"], ["46", "46", "46"], timeout_s=5.0,
                                             answer_prefixes=["Answer:"] * 3, pool=pool, metadata=[{"id": "a"}] * 3)
        finally:
            pool.close()
        assert [r.reward for r in results] == [1.0, -1.0, -1.0], spec
        # verl's dict carries its verdict ('acc'); slime's float is a score, no verdict
        assert [r.correct for r in results] == ([True, False, False] if spec == str(VERL_FILE) else [None] * 3)
        assert [r.reward for r in results] == [1.0, -1.0, -1.0] and stats.num_errors == 0, spec
        assert stats.num_in_pool == 3


def test_reward_kwargs_and_a_rows_whole_extra_info_reach_a_verl_function(conventions, tmp_path):
    """verl's custom_reward_function.reward_kwargs (algo.reward_kwargs) go to every call, in the
    worker pool too; a parquet row's extra_info reaches the function whole; a kwarg the function
    does not take, or kwargs for a built-in verifier, are refused naming algo.reward_kwargs."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dapo_mega.config import ConfigError
    from dapo_mega.data.readers import read_problems

    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist([{
        "data_source": "math_dapo", "prompt": [{"role": "user", "content": "What is 3+4?"}],
        "ability": "MATH", "reward_model": {"ground_truth": "7", "style": "rule"},
        "extra_info": {"index": "a1", "level": 3, "split": "train"}}]), path)
    problem = read_problems(path)[0][0]
    assert problem.id == "a1" and problem.extra_info == {"index": "a1", "level": 3, "split": "train"}
    spec = f"{conventions}:verl_with_kwargs"
    verifier = build_verifier(spec, {"format_score": 0.1, "level_bonus": 1.0})
    assert verifier.score("Answer: 7", "7", problem_metadata(problem)).reward == pytest.approx(3.1)
    pool = VerifierPool(verifier, num_workers=1)
    try:
        results, _ = score_responses(verifier, ["Answer: 7"], ["7"], timeout_s=5.0, pool=pool,
                                     metadata=[problem_metadata(problem)])
    finally:
        pool.close()
    assert results[0].reward == pytest.approx(3.1) and results[0].error is None
    with pytest.raises(ConfigError, match=r"^algo.reward_kwargs: \['typo'\] are not parameters of"):
        build_verifier(spec, {"typo": 1})
    with pytest.raises(ConfigError, match=r"^algo.reward_kwargs: \['format_score'\] given, but algo.verifier=dapo"):
        AlgoConfig(verifier="dapo", reward_kwargs={"format_score": 0.1}).validate()
