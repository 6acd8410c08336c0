"""Reward plugins (`algo.verifier=package.module:function`): resolution, every bad input's
error, the worker pool's bound, the version in the ledger, and a training run graded by the
example plugin (examples/rewards/boxed_answer.py).

Test plugins are modules written into tmp_path (put on sys.path, which the pool hands to
its workers as PYTHONPATH), each under its own name: Python caches a module by name.
"""

import hashlib
import json
import os
import re
import sys
import textwrap
from pathlib import Path

import pytest
from helpers.training import run_cli

from dapo_mega.config import AlgoConfig, ConfigError
from dapo_mega.records.ledger import ledger_record, read_records, write_step
from dapo_mega.reward import (
    DapoVerifier,
    MathVerifyVerifier,
    PluginVerifier,
    VerifierPool,
    build_verifier,
    check_verifier,
    compute_rewards,
    problem_metadata,
    score_responses,
)
from dapo_mega.rollout.samples import ScoredSample

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "rewards"
EXAMPLE = "boxed_answer:score"

HEADER = "from dapo_mega.reward import RewardResult\n"


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    """write(body) -> the module name of a new plugin module holding `body`."""
    monkeypatch.syspath_prepend(str(tmp_path))
    count = [0]

    def write(body: str, header: str = HEADER) -> str:
        count[0] += 1
        name = f"plugin_{tmp_path.name.replace('-', '_')}_{count[0]}"
        (tmp_path / f"{name}.py").write_text(header + textwrap.dedent(body))
        return name

    return write


@pytest.fixture
def examples_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))


def test_names_and_paths_resolve_through_one_registry(examples_on_path):
    assert isinstance(build_verifier("dapo"), DapoVerifier)
    assert isinstance(build_verifier("math_verify"), MathVerifyVerifier)
    example = build_verifier(EXAMPLE)
    assert isinstance(example, PluginVerifier) and example.name == EXAMPLE
    assert example.version == "boxed_answer:score-1.0"  # the module's declared __version__
    assert example.runs_in_process is False  # always in the killable worker pool
    AlgoConfig(verifier=EXAMPLE).validate()  # config validation leaves a path to the preflight
    with pytest.raises(ConfigError, match=r"^algo\.verifier: unknown 'nope'\. Fix: .*package\.module:function"):
        AlgoConfig(verifier="nope").validate()
    with pytest.raises(ConfigError, match=r"^algo\.verifier: unknown verifier 'a:b:c'\. Fix: use one of dapo, math_verify"):
        build_verifier("a:b:c")


def test_the_example_plugin_by_hand(examples_on_path):
    from boxed_answer import score

    text = "so x = \\boxed{\\frac{1}{2}}"  # 26 characters
    result = score(text, "\\frac{1}{2}", {})  # nested braces kept
    assert len(text) == 26 and result.correct and result.extracted == "\\frac{1}{2}"
    assert result.components == {"exact_match": 1.0, "length": pytest.approx(-0.1 * 26 / 2000)}
    assert result.score == pytest.approx(1.0 - 0.1 * 26 / 2000)
    wrong = score("\\boxed{3} then \\boxed{4", "3", {})  # the last box is unclosed: the one before it
    assert wrong.correct and wrong.extracted == "3"
    assert not score("Answer: 47\n", "46", {}).correct
    long = score("x" * 5000, "46", {})
    assert long.extracted is None and long.components == {"exact_match": -1.0, "length": -0.1}


def test_undeclared_version_is_the_hash_of_the_source_and_the_function_declaration_wins(plugins, tmp_path):
    body = textwrap.dedent("""
        def score(response, ground_truth, metadata):
            return RewardResult(score=0.0, correct=False)
    """)
    hashed = plugins(body)
    source = (tmp_path / f"{hashed}.py").read_bytes()
    assert build_verifier(f"{hashed}:score").version == f"{hashed}:score-{hashlib.sha256(source).hexdigest()[:10]}"
    edited = plugins(body + "# a comment is an edit\n")
    assert build_verifier(f"{edited}:score").version != build_verifier(f"{hashed}:score").version
    declared = plugins("VERSION = 'module-2'\n" + body + "score.__version__ = 'fn-3'\n")
    assert build_verifier(f"{declared}:score").version == f"{declared}:score-fn-3"


BAD_PATHS = [
    ("no_such_module_anywhere:score", None, (r"cannot be imported \(No module named 'no_such_module_anywhere'\)\. "
                                             r"Fix: put the folder holding it on PYTHONPATH")),
    ("{m}:missing", "def score(response, ground_truth, metadata): pass\n",
     r"not found: module \w+ has no attribute 'missing'\. Fix: name a function"),
    ("{m}:score", "def score(response, ground_truth): pass\n",
     (r"has the signature \(response, ground_truth\), which cannot be called with \(response, ground_truth, "
      r"metadata\)\. Fix: define it as \(response: str")),
    ("{m}:score", "def score(response, ground_truth, metadata, extra): pass\n", r"has the signature"),
    ("{m}:score", "score = 3\n", r"is an object of type int, not a function"),
    ("{m}:score", "async def score(args, samples): pass\n",
     r"is slime's --group-rm batch form \(args, samples\), which dapo-mega does not call\. Fix: write slime's "
     r"per-sample form"),
    ("{m}:score", "def score(solution_str, ground_truth): pass\n",
     r"has verl's solution_str but the signature \(solution_str, ground_truth\), which verl's keyword call"),
    ("no/such/reward_file.py", None, r"names the file /\S+/no/such/reward_file\.py, which does not exist"),
    ("{m}:score", "raise RuntimeError('needs a GPU')\n", r"raised RuntimeError on import: needs a GPU"),
]


@pytest.mark.parametrize("spec, body, message", BAD_PATHS)
def test_a_bad_path_or_signature_is_one_line_naming_the_field_and_the_fix(plugins, spec, body, message):
    if body is not None:
        spec = spec.format(m=plugins(body))
    with pytest.raises(ConfigError) as info:
        build_verifier(spec)
    text = str(info.value)
    assert "\n" not in text and text.startswith(f"algo.verifier: reward plugin '{spec}' "), text
    assert re.search(message, text), text


BAD_RESULTS = [
    ("return RewardResult(score='high', correct=True)", r"score 'high' is not a finite number"),
    ("return RewardResult(score=float('nan'), correct=True)", r"score nan is not a finite number"),
    ("return RewardResult(score=True, correct=True)", r"score True is not a finite number"),
    ("return RewardResult(score=1.0, correct=1)", r"correct 1 is not a bool"),
    ("return RewardResult(score=1.0, correct=True, components={'len': 'x'})", r"component 'len'='x' is not"),
    ("return {'correct': True}", r"returned a dict without 'score' \(keys \['correct'\]\); accepted: a finite number"),
    ("return 'yes'", r"returned str 'yes'; accepted: a finite number \(the score, no verdict\), a bool"),
    ("return float('nan')", r"returned float nan; accepted: a finite number"),
    ("return None", r"returned NoneType None; accepted"),
    ("return {'score': float('inf'), 'acc': True}", r"'score' inf is not a finite number; accepted"),
    ("return {'score': 1.0, 'acc': 'yes'}", r"'acc' 'yes' is not a bool or a finite number"),
    ("return {'score': 1.0, 'len': float('nan')}", r"key 'len'=nan is not a name and a finite number"),
    ("raise KeyError('problem_id')", r"KeyError: 'problem_id'"),
    ("import time; time.sleep(60)", r"timeout after 1s"),
]


@pytest.mark.parametrize("line, message", BAD_RESULTS)
def test_a_plugin_that_fails_its_probe_call_is_refused(plugins, line, message):
    name = plugins(f"def score(response, ground_truth, metadata):\n    {line}\n")
    with pytest.raises(ConfigError) as info:
        check_verifier(f"{name}:score", timeout_s=1.0)
    text = str(info.value)
    assert "\n" not in text and text.startswith(f"algo.verifier: reward plugin '{name}:score' failed its probe"), text
    assert re.search(message, text), text
    assert check_verifier("dapo", timeout_s=1.0).name == "dapo"  # built-ins are not probed


def test_dapo_mega_train_refuses_a_bad_plugin_before_building_anything(plugins, tmp_path):
    name = plugins("def score(response, ground_truth, metadata):\n    return RewardResult(score=None, correct=True)\n")
    out = tmp_path / "out"
    proc = run_cli("train", f"trainer.output_dir={out}", f"algo.verifier={name}:score", "trainer.total_steps=1",
                   "trainer.sft_warmup_steps=0", timeout_s=120,
                   env={"PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])})
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("dapo-mega:")]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"dapo-mega: config error: algo.verifier: reward plugin '{name}:score' failed its "
                               "probe call"), lines
    assert "score None is not a finite number" in lines[0]
    assert not any(out.rglob("config.json")), "a model was built before the plugin was checked"


PROBE_PLUGIN = """
import os, time

def score(response, ground_truth, metadata):
    if "hang" in response:
        time.sleep(3600)
    if "boom" in response:
        raise ValueError("cannot grade boom")
    if "bad" in response:
        return RewardResult(score=float("inf"), correct=False)
    ok = response.strip().endswith(ground_truth)
    return RewardResult(score=0.5 if ok else -0.5, correct=ok, extracted=metadata.get("id"),
                        components={"pid": float(os.getpid()), "chars": float(len(response))})
"""


def test_a_plugin_runs_in_the_killable_worker_pool_with_metadata(plugins):
    verifier = build_verifier(f"{plugins(PROBE_PLUGIN)}:score")
    pool = VerifierPool(verifier, num_workers=2)
    problems = [type("P", (), {"id": f"p{i}", "data_source": "test", "prompt": "q"})() for i in range(5)]
    try:
        results, stats = score_responses(verifier, ["x 7", "hang", "y 8", "boom", "bad"], ["7", "1", "9", "1", "1"],
                                         timeout_s=1.0, answer_prefixes=["Answer:"] * 5, pool=pool,
                                         metadata=[problem_metadata(p) for p in problems])
    finally:
        pool.close()
    good, hung, wrong, raised, invalid = results
    assert (good.correct, good.reward, good.extracted) == (True, 0.5, "p0")
    parts = dict(good.components)
    assert parts["pid"] != os.getpid() and parts["chars"] == len("Answer:x 7")  # in a worker, prefix included
    assert (wrong.correct, wrong.reward, wrong.extracted, wrong.error) == (False, -0.5, "p2", None)
    assert (hung.correct, hung.reward, hung.error) == (False, -1.0, "verifier_error: timeout after 1s")
    assert raised.error == "verifier_error: ValueError: cannot grade boom" and raised.reward == -1.0
    assert invalid.error.startswith("verifier_error: TypeError: reward plugin") and "score inf" in invalid.error
    assert (stats.num_in_pool, stats.num_timeouts, stats.num_exceptions, stats.num_errors) == (5, 1, 2, 3)
    assert pool.num_restarts == 1  # the hung worker was killed and replaced


def test_the_plugin_version_and_components_in_ledger_rows(examples_on_path, tmp_path):
    algo = AlgoConfig(verifier=EXAMPLE, max_response_length=64, overlong_buffer_length=16, overlong_penalty_factor=1.0)
    verifier = build_verifier(algo.verifier)
    responses = ["\\boxed{46}", "Answer: 12"]
    batch = compute_rewards(verifier, responses, ["46", "46"], [10, 56], algo)
    records = []
    for k, (text, score) in enumerate(zip(responses, batch.items())):
        sample = ScoredSample(prompt_id="p", sample_index=k, token_ids=[1] * 3, logprobs=None,
                              weight_versions=[{"version": "0", "start": 0, "end": 3}], response_text=text,
                              truncated=False, seed=1, engine_id="e", queue_delay_s=0.0, generation_latency_s=0.0,
                              score=score, step=1)
        records.append(ledger_record(sample, run_id="r"))
    write_step(tmp_path, 1, records)
    rows = read_records(tmp_path)
    assert {(r.verifier, r.verifier_version) for r in rows} == {(EXAMPLE, "boxed_answer:score-1.0")}
    right, wrong = (json.loads(r.reward_components) for r in rows)
    # Eq. 13 by hand: 56 tokens, limit 64, buffer 16 -> (64 - 16 - 56) / 16 = -0.5
    assert right == pytest.approx({"correctness": 1.0 - 0.1 * 10 / 2000, "overlong_penalty": 0.0,
                                   "verifier/exact_match": 1.0, "verifier/length": -0.1 * 10 / 2000})
    assert wrong == pytest.approx({"correctness": -1.0 - 0.1 * 10 / 2000, "overlong_penalty": -0.5,
                                   "verifier/exact_match": -1.0, "verifier/length": -0.1 * 10 / 2000})
    assert [r.reward for r in rows] == pytest.approx([right["correctness"], wrong["correctness"] - 0.5])
    assert [r.extracted_answer for r in rows] == ["46", "12"] and [r.correct for r in rows] == [True, False]


VERL_FILE = "examples/rewards/verl_compute_score.py"


@pytest.mark.slow
def test_training_two_steps_graded_by_a_verl_reward_file(tmp_path):
    """The shipped file written as verl's documentation shows (verl's signature, its dict
    return), named by its path as verl's custom_reward_function.path: compute_score by default."""
    from helpers.training import RUN_NAME, run_train

    run_train(tmp_path, f"algo.verifier={VERL_FILE}", "trainer.total_steps=2", "trainer.sft_warmup_steps=5",
              timeout_s=180)
    rows = read_records(tmp_path / RUN_NAME)
    assert rows and {r.step for r in rows} == {1, 2}
    digest = hashlib.sha256((REPO / VERL_FILE).read_bytes()).hexdigest()[:10]
    assert {(r.verifier, r.verifier_version) for r in rows} == {(VERL_FILE, f"{VERL_FILE}-{digest}")}
    for r in rows:
        parts = json.loads(r.reward_components)
        # by hand: the verifier saw "Answer:" + response (the synthetic task's answer prefix)
        lines = re.findall(r"Answer\s*:\s*([^\n]*)", ("Answer:" + r.response_text)[-300:])
        pred = lines[-1].replace("$", "").replace(" ", "").strip().rstrip(".") if lines else None
        assert r.extracted_answer == pred and parts["verifier/format_ok"] == float(pred is not None)
        a, op, b = re.search(r"Q: (\d+)([+-])(\d+)\nAnswer:$", r.prompt_text).groups()  # the synthetic sum
        assert r.correct == (pred == str(int(a) + int(b) if op == "+" else int(a) - int(b)))
        assert parts["correctness"] == (1.0 if r.correct else -1.0) and r.verifier_error is None
        assert r.reward == pytest.approx(parts["correctness"] + parts["overlong_penalty"])


VERL_READS_SPLIT = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    split = extra_info["split"]          # as verl's functions read their row (KeyError without it)
    level = extra_info["difficulty"]
    right = solution_str.strip().endswith(str(ground_truth))
    return {"score": 1.0 if right else -1.0, "train_row": float(split == "train"), "difficulty": float(level)}
"""


def _parquet_of_sums(path: Path, count: int) -> Path:
    """`count` sums in verl's parquet schema, each row's extra_info with the keys verl functions read."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"data_source": "sums", "prompt": [{"role": "user", "content": f"Q: {i}+{i % 3}\nAnswer:"}],
             "ability": "MATH", "reward_model": {"ground_truth": str(i + i % 3), "style": "rule"},
             "extra_info": {"index": i, "split": "train", "difficulty": i % 3}} for i in range(count)]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_the_probe_calls_a_verl_function_on_a_real_training_row_and_says_which(tmp_path):
    """A function that reads its row's extra_info["split"] starts (it failed with KeyError: 'split'
    on the made-up probe row); one that fails on the row is refused naming the row."""
    from dapo_mega.config import DataConfig
    from dapo_mega.plan.preflight import check_verifier as preflight_check

    data = DataConfig(train_path=str(_parquet_of_sums(tmp_path / "train.parquet", 4)))
    reads_split = tmp_path / "reads_split.py"
    reads_split.write_text(VERL_READS_SPLIT)
    preflight_check(AlgoConfig(verifier=str(reads_split), verifier_timeout_s=30.0), data)
    picky = tmp_path / "picky.py"
    picky.write_text(VERL_READS_SPLIT.replace('extra_info["split"]', 'extra_info["tools_kwargs"]'))
    with pytest.raises(ConfigError, match=r"probe call on data.train_path row 0 \(id '0'\).*'tools_kwargs'"):
        preflight_check(AlgoConfig(verifier=str(picky), verifier_timeout_s=30.0), data)


@pytest.mark.slow
def test_training_on_parquet_rows_graded_by_a_verl_function_that_reads_extra_info(tmp_path):
    """The done-when of issue #45 item 2: such a function trains, and saw each row's own extra_info."""
    from helpers.training import RUN_NAME, run_train

    train = _parquet_of_sums(tmp_path / "train.parquet", 24)
    reward = tmp_path / "reads_split.py"
    reward.write_text(VERL_READS_SPLIT)
    run_train(tmp_path, f"algo.verifier={reward}", f"data.train_path={train}", "data.apply_chat_template=false",
              "trainer.total_steps=1", "trainer.sft_warmup_steps=0", timeout_s=180)
    rows = read_records(tmp_path / RUN_NAME)
    assert rows and all(r.verifier_error is None for r in rows)
    by_prompt = {int(re.search(r"Q: (\d+)\+", r.prompt_text).group(1)): json.loads(r.reward_components) for r in rows}
    for i, parts in by_prompt.items():
        assert parts["verifier/train_row"] == 1.0 and parts["verifier/difficulty"] == float(i % 3), parts
