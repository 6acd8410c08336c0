"""One prompt encoder for training and evaluation, checked with a real BPE tokenizer that has
Qwen2.5's chat template (see chat_tokenizer.py).

The references are the tokenizer's own `apply_chat_template` and the ChatML text Qwen2.5
renders (system turn by default, `<|im_start|>assistant\\n` as the generation prompt);
`dapo-mega train`'s and `dapo-mega eval`'s own code paths must send the engines those ids.
"""

from __future__ import annotations

import pytest
import torch
from chat_tokenizer import build_chat_tokenizer

from dapo_mega.config import ConfigError, load_config
from dapo_mega.data import DAPO_PROMPT_TEMPLATE, Problem, PromptEncoder, token_ids_of

QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
PROBLEM = Problem(id="p1", prompt="What is 12 + 30?", ground_truth="42", data_source="math_dapo",
                  messages=({"role": "user", "content": "What is 12 + 30?"},))


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return build_chat_tokenizer(tmp_path_factory.mktemp("chat_tok"))


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def _chat_ids(tokenizer, messages):
    """The tokenizer's own answer, whatever its transformers version returns."""
    return token_ids_of(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True))


def test_chat_template_ids_equal_the_tokenizers_own(tokenizer):
    enc = PromptEncoder(tokenizer, prompt_template="dapo", apply_chat_template=True)
    user = DAPO_PROMPT_TEMPLATE.format(problem=PROBLEM.prompt)
    expected_text = (f"<|im_start|>system\n{QWEN_SYSTEM}<|im_end|>\n"
                     f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")
    assert enc.render(PROBLEM) == expected_text
    ids = enc.encode(PROBLEM)
    assert ids == _chat_ids(tokenizer, [{"role": "user", "content": user}])
    assert all(isinstance(i, int) for i in ids)
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    tail = token_ids_of(tokenizer("<|im_start|>assistant\n", add_special_tokens=False))
    assert ids.count(start) == 3 and tail[0] == start and ids[-len(tail):] == tail
    assert tokenizer.decode(ids) == expected_text
    assert enc.encode(PROBLEM) == ids  # cached copy, same ids


def test_stored_system_turn_is_kept_and_raw_template_uses_the_stored_prompt(tokenizer):
    chat = ({"role": "system", "content": "Think step by step."}, {"role": "user", "content": "What is 2+2?"})
    p = Problem(id="s", prompt="What is 2+2?", ground_truth="4", data_source="math_dapo", messages=chat)
    enc = PromptEncoder(tokenizer, prompt_template="raw", apply_chat_template=True)
    assert enc.render(p) == ("<|im_start|>system\nThink step by step.<|im_end|>\n"
                             "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert enc.encode(p) == _chat_ids(tokenizer, [dict(m) for m in chat])


def test_without_chat_template_the_formatted_text_is_tokenized_alone(tokenizer):
    enc = PromptEncoder(tokenizer, prompt_template="dapo", apply_chat_template=False)
    text = DAPO_PROMPT_TEMPLATE.format(problem=PROBLEM.prompt)
    assert enc.encode(PROBLEM) == list(tokenizer(text, add_special_tokens=False)["input_ids"])
    assert tokenizer.decode(enc.encode(PROBLEM)) == text


def test_token_ids_of_reads_every_return_type(tokenizer):
    batch = tokenizer("What is 12 + 30?", add_special_tokens=False)
    ids = list(batch["input_ids"])
    assert list(batch) != ids  # list(BatchEncoding) gives its keys: the bug this guards against
    assert token_ids_of(batch) == ids
    assert token_ids_of(ids) == ids
    assert token_ids_of(torch.tensor([ids])) == ids
    assert token_ids_of({"input_ids": [ids]}) == ids
    with pytest.raises(TypeError):
        token_ids_of(["input_ids", "attention_mask"])


def test_chat_template_without_one_is_a_config_error(tmp_path):
    from dapo_mega.models.tiny import build_char_tokenizer

    with pytest.raises(ConfigError, match=r"^data.apply_chat_template:.*Fix:"):
        PromptEncoder(build_char_tokenizer(), apply_chat_template=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer_dir):
    """A tiny HF directory whose tokenizer is the chat BPE tokenizer."""
    from transformers import AutoTokenizer

    from dapo_mega.models.tiny import build_tiny_model_dir

    out = tmp_path_factory.mktemp("chat_model") / "hf"
    build_tiny_model_dir(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                 "merges.txt", "chat_template.jinja"):
        (out / name).unlink(missing_ok=True)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    return out


def _eval_path_ids(cfg, model_dir, problems, monkeypatch, tmp_path):
    """What `dapo-mega eval` would send: evaluate_checkpoint with engines and generation faked."""
    import dapo_mega.evaluate as evaluate
    from dapo_mega.engines.fleet import EngineFleet
    from dapo_mega.engines.sglang.endpoint import EngineEndpoint

    seen = {}

    def fake_evaluate_problems(urls, probs, cfg_, encoding, verifier, **kwargs):
        seen.update({p.id: encoding.encode(p) for p in probs})
        return evaluate.EvalResult(k=1)

    monkeypatch.setattr(EngineFleet, "start", lambda self, *args, **kwargs: [EngineEndpoint("http://127.0.0.1:9")])
    monkeypatch.setattr(evaluate, "evaluate_problems", fake_evaluate_problems)
    evaluate.evaluate_checkpoint(cfg, str(model_dir), tmp_path)
    return [seen[p.id] for p in problems]


def _train_path_ids(cfg, problems, monkeypatch):
    """What `dapo-mega train`'s rollout manager would send (the driver's components, engines faked)."""
    from types import SimpleNamespace

    import dapo_mega.rollout.manager as manager
    from dapo_mega.session import Session

    captured = {}

    class CapturingManager:
        settings = SimpleNamespace(environment=None)  # the real manager's RoundSettings: no environment here

        @classmethod
        def from_config(cls, cfg, book, purpose, encoding=None, **kwargs):
            captured["encoding"] = encoding
            return cls()

        def __getattr__(self, name):
            return lambda *a, **k: None

    def fake_start_engines(self):
        self.fleet = SimpleNamespace(endpoints=["http://127.0.0.1:9"], engines=[], close=lambda: None,
                                     returns_routed_experts=False)
        return ["http://127.0.0.1:9"]

    monkeypatch.setattr(Session, "_start_engines", fake_start_engines)
    monkeypatch.setattr(manager, "RolloutManager", CapturingManager)
    s = Session(cfg)
    role = None
    try:
        role = s._start_driver()
        return [captured["encoding"].encode(p) for p in problems]
    finally:
        if role is not None:
            role.close()


def test_train_and_eval_send_identical_chat_prompt_ids(model_dir, tokenizer, tmp_path, monkeypatch):
    cfg = load_config([f"model.hf_path={model_dir}", "data.apply_chat_template=true", "data.prompt_template=raw",
                       f"trainer.output_dir={tmp_path}", "trainer.wandb_mode=disabled", "trainer.plot=false",
                       "data.synthetic_num_train=8", "data.synthetic_num_eval=4", "eval.max_problems=4",
                       f"eval.checkpoint={model_dir}"])
    from dapo_mega.data import build_datasets

    _, held_out, _ = build_datasets(cfg.data)
    held_out = held_out[:4]
    eval_ids = _eval_path_ids(cfg, model_dir, held_out, monkeypatch, tmp_path / "eval")
    train_ids = _train_path_ids(cfg, held_out, monkeypatch)
    assert eval_ids == train_ids
    for p, ids in zip(held_out, eval_ids):
        assert ids == _chat_ids(tokenizer, [{"role": "user", "content": p.prompt}])
        assert tokenizer.decode(ids).startswith(f"<|im_start|>system\n{QWEN_SYSTEM}<|im_end|>\n<|im_start|>user\n")


def test_the_fingerprint_changes_with_the_template_the_chat_template_and_the_tokenizer(tmp_path):
    """The ledger's `encoder` column: one string that any change of what the model is given
    changes (prompt template, chat template text, tokenizer vocabulary)."""
    from types import SimpleNamespace

    from dapo_mega.data.encoder import PromptEncoder

    def tokenizer(vocab, chat="{{ messages }}"):
        return SimpleNamespace(get_vocab=lambda: dict(vocab), chat_template=chat, name_or_path="/m/tiny")

    base = PromptEncoder(tokenizer({"a": 0, "b": 1}), "raw").fingerprint()
    assert base.startswith("template=raw;chat=off;tokenizer=tiny/vocab 2/")
    assert PromptEncoder(tokenizer({"a": 0, "b": 1}), "dapo").fingerprint() != base
    assert PromptEncoder(tokenizer({"a": 0, "c": 1}), "raw").fingerprint() != base
    chat_a = PromptEncoder(tokenizer({"a": 0, "b": 1}), "raw", apply_chat_template=True).fingerprint()
    chat_b = PromptEncoder(tokenizer({"a": 0, "b": 1}, "{{ other }}"), "raw", apply_chat_template=True).fingerprint()
    assert len({base, chat_a, chat_b}) == 3


def test_a_tool_answer_in_chat_form_is_the_templates_own_tool_turn(tokenizer_dir, tokenizer):
    """rollout.tool_message=chat (rollout/turns.py): the prompt, the model's turn that called
    the tool and `tool_message(answer)` are, as text and as tokens, what Qwen2.5's template
    renders for the whole conversation (the assistant turn closed, the answer as a tool
    message, the next assistant turn opened): the model continues exactly as its template
    would have it. Without the chat template it is refused, naming the fields."""
    from dapo_mega.config import DataConfig

    encoder = PromptEncoder.from_pretrained(tokenizer_dir, DataConfig(prompt_template="raw", apply_chat_template=True))
    problem = Problem(id="p", prompt="What is 2+2?", ground_truth="4", data_source="test")
    turn = 'Let me run it.\n<tool_call>\n{"name": "python", "arguments": {"code": "print(2+2)"}}\n</tool_call>'
    framed = encoder.tool_message("4")
    assert framed.startswith("<|im_end|>\n<|im_start|>user\n<tool_response>\n4\n</tool_response>"), framed
    assert framed.endswith("<|im_start|>assistant\n")
    whole = tokenizer.apply_chat_template(encoder.messages(problem) + [{"role": "assistant", "content": turn},
                                                                        {"role": "tool", "content": "4"}],
                                          tokenize=False, add_generation_prompt=True)
    assert encoder.render(problem) + turn + framed == whole
    assert encoder.encode(problem) + encoder.encode_text(turn) + encoder.encode_text(framed) == \
        encoder.encode_text(whole)
    plain = PromptEncoder.from_pretrained(tokenizer_dir, DataConfig(prompt_template="raw"))
    with pytest.raises(ConfigError, match="^rollout.tool_message: chat, but data.apply_chat_template is false"):
        plain.tool_message("4")
    with pytest.raises(ConfigError, match="^rollout.tool_message: is chat"):
        from dapo_mega.config import validate_config
        validate_config(load_config(["rollout.environment=python", "rollout.tool_message=chat"]))
