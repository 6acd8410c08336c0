"""One prompt encoder: a `Problem` becomes the token ids that engines and the learner see.

Training (rollouts, the learner's prompt tokens, the supervised warm start) and evaluation
(`dapo-mega eval`, the trainer's held-out evaluation) all encode through `PromptEncoder`, so
the two cannot drift apart:

    encoder = PromptEncoder.from_config(tokenizer, cfg.data)
    ids = encoder.encode(problem)          # list[int], cached per problem

With `data.apply_chat_template` the problem's chat list (its stored messages, with the last
user message replaced by the formatted prompt) is rendered by the tokenizer's chat template
with `add_generation_prompt=True`, as verl's DAPO recipe does, then tokenised without
adding special tokens (the template writes them). Rendering to text first and tokenising
that is what `apply_chat_template(..., tokenize=True)` does inside transformers 4.x and 5.x,
and it sidesteps the return type that changed between them (5.x returns a `BatchEncoding`,
whose `list()` is its keys). Without the chat template the formatted prompt text is
tokenised as it is.

The cache and the tokenizer are guarded by one lock: the asynchronous rollout thread and the
main thread encode through the same object.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

from dapo_mega.config import ConfigError, DataConfig
from dapo_mega.data.problem import Problem, format_prompt

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def token_ids_of(encoded: Any) -> List[int]:
    """Plain `list[int]` from what a tokenizer call returns, in transformers 4.x or 5.x.

    Accepts a list of ints, a `BatchEncoding` / dict with `input_ids`, or a tensor / array
    (one row); `list(BatchEncoding)` would give its keys, so that is read by key.
    """
    if isinstance(encoded, Mapping):  # BatchEncoding is a UserDict
        encoded = encoded["input_ids"]
    if hasattr(encoded, "tolist"):
        encoded = encoded.tolist()
    ids = list(encoded)
    if ids and isinstance(ids[0], (list, tuple)):  # a batch of one
        if len(ids) != 1:
            raise ValueError(f"expected the ids of one prompt, got a batch of {len(ids)}")
        ids = list(ids[0])
    if not all(isinstance(i, int) for i in ids):
        raise TypeError(f"token ids must be ints, got {[type(i).__name__ for i in ids[:3]]}")
    return ids


TURN_MARK = "\u2063turn\u2063"
"""Stands for an assistant turn's text when the chat template renders what follows it."""


class PromptEncoder:
    """Problem -> prompt token ids, with or without the tokenizer's chat template."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_template: str = "dapo", apply_chat_template: bool = False):
        self.tokenizer = tokenizer
        self.prompt_template = prompt_template
        self.apply_chat_template = apply_chat_template
        if apply_chat_template and not getattr(tokenizer, "chat_template", None):
            name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
            raise ConfigError(f"data.apply_chat_template: true, but the tokenizer {name!r} has no chat template. "
                              "Fix: set data.apply_chat_template=false, or use a model whose tokenizer_config.json "
                              "has a chat_template")
        self._cache: Dict[Tuple[str, str], List[int]] = {}
        self._lock = threading.Lock()
        self._fingerprint: Optional[str] = None
        self.tools: List[Dict[str, Any]] = []
        """The tools' function schemas the chat template shows in the prompt (`show_tools`)."""

    def show_tools(self, schemas: Sequence[Dict[str, Any]]) -> None:
        """Show `schemas` (OpenAI function schemas: environments/tool_calls.py) in every prompt,
        through the chat template's `tools=`; the prompts encoded so far are encoded again."""
        if schemas and not self.apply_chat_template:
            raise ConfigError("rollout.environment: its tools are shown to the model through the chat template, but "
                              "data.apply_chat_template is false. Fix: set data.apply_chat_template=true")
        with self._lock:
            self.tools = [dict(s) for s in schemas]
            self._cache.clear()
            self._fingerprint = None

    @classmethod
    def from_config(cls, tokenizer: PreTrainedTokenizerBase, data_cfg: DataConfig) -> "PromptEncoder":
        """From a tokenizer and a DataConfig (prompt_template, apply_chat_template)."""
        return cls(tokenizer, data_cfg.prompt_template, data_cfg.apply_chat_template)

    @classmethod
    def from_pretrained(cls, model_dir: Path | str, data_cfg: DataConfig) -> "PromptEncoder":
        """Load the tokenizer of an HF directory and build the encoder for `data_cfg`."""
        from transformers import AutoTokenizer

        return cls.from_config(AutoTokenizer.from_pretrained(str(model_dir)), data_cfg)

    def fingerprint(self) -> str:
        """What the model is given, in one string every ledger row carries: the prompt template,
        the chat template (a hash of its text, or off) and the tokenizer (its name and vocabulary
        size, and a hash of its vocabulary), e.g.
        `template=dapo;chat=off;tokenizer=tiny-qwen2/vocab 99/4f1c0a2b9e3d`. A change of any
        of them changes the string. Computed once (the tokenizer does not change)."""
        if self._fingerprint is None:
            self._fingerprint = self._compute_fingerprint()
        return self._fingerprint

    def _compute_fingerprint(self) -> str:
        import hashlib

        tok = self.tokenizer
        chat = "off"
        if self.apply_chat_template:
            chat = hashlib.sha256(str(tok.chat_template).encode()).hexdigest()[:12]
        vocab = tok.get_vocab() if hasattr(tok, "get_vocab") else {}
        digest = hashlib.sha256(repr(sorted(vocab.items())).encode()).hexdigest()[:12]
        name = str(getattr(tok, "name_or_path", "") or type(tok).__name__).rstrip("/").split("/")[-1]
        tools = ""
        if self.tools:
            tools = ";tools=" + hashlib.sha256(json.dumps(self.tools, sort_keys=True).encode()).hexdigest()[:12]
        return f"template={self.prompt_template};chat={chat}{tools};tokenizer={name}/vocab {len(vocab)}/{digest}"

    # ------------------------------------------------------------------ the prompt
    def messages(self, problem: Problem) -> List[Dict[str, str]]:
        """The chat list given to the chat template: the stored messages (system turns kept),
        the last user message holding the formatted prompt."""
        text = format_prompt(problem, self.prompt_template)
        chat = [{"role": str(m["role"]), "content": str(m["content"])} for m in problem.messages]
        users = [i for i, m in enumerate(chat) if m["role"] == "user"]
        if not users:
            return [{"role": "user", "content": text}]
        chat[users[-1]]["content"] = text
        return chat

    def render_messages(self, messages: Sequence[Mapping[str, Any]], tools: Optional[Sequence[Dict[str, Any]]] = None
                        ) -> str:
        """A chat (an agent's messages, rollout/openai_endpoint.py) as the chat template renders it
        for the assistant's next turn, `tools` shown."""
        with self._lock:
            return self._chat_text(messages, tools)

    def _chat_text(self, messages: Sequence[Mapping[str, Any]], tools: Optional[Sequence[Dict[str, Any]]]) -> str:
        """The chat template's rendering for the assistant's next turn (the caller holds the lock)."""
        return self.tokenizer.apply_chat_template(list(messages), tools=list(tools) if tools else None,
                                                  tokenize=False, add_generation_prompt=True)

    def render(self, problem: Problem) -> str:
        """The prompt as text: the chat template's rendering, or the formatted prompt."""
        if not self.apply_chat_template:
            return format_prompt(problem, self.prompt_template)
        return self._chat_text(self.messages(problem), self.tools)

    def encode(self, problem: Problem) -> List[int]:
        """Token ids of the problem's prompt (cached; thread-safe)."""
        key = (problem.id, problem.prompt)
        with self._lock:
            ids = self._cache.get(key)
            if ids is None:
                ids = self._tokenize(self.render(problem))
                self._cache[key] = ids
            return list(ids)

    def tool_message(self, texts: Sequence[str], after: Optional[int] = None) -> str:
        """`texts` (one per call) as the chat template renders the tools' answers after an
        assistant turn that called them (rollout.tool_message=chat, rollout/turns.py): the end of
        that turn, one tool message each, and the start of the assistant's next turn. For
        Qwen2.5: `<|im_end|>\n<|im_start|>user\n<tool_response>\n{text}\n</tool_response><|im_end|>\n<|im_start|>assistant\n`
        (several: `<tool_response>` blocks in one user turn). `after`: the last token of the
        model's turn; when it is the template's end of turn (the model ended its message: a
        tool-call format), the framing starts after it instead of writing it again."""
        if not self.apply_chat_template:
            raise ConfigError("rollout.tool_message: chat, but data.apply_chat_template is false: the prompt has no "
                              "chat turns to continue. Fix: set data.apply_chat_template=true, or "
                              "rollout.tool_message=text")
        texts = [texts] if isinstance(texts, str) else list(texts)
        turn = [{"role": "user", "content": "q"}, {"role": "assistant", "content": TURN_MARK}]
        with self._lock:
            full = self.tokenizer.apply_chat_template(turn + [{"role": "tool", "content": t} for t in texts],
                                                      tokenize=False, add_generation_prompt=True)
            framed = full[full.index(TURN_MARK) + len(TURN_MARK):]
            if after is not None and after in self.tokenizer.all_special_ids:
                end = self.tokenizer.convert_ids_to_tokens(after)
                if framed.startswith(end):
                    framed = framed[len(end):]
        return framed

    def encode_text(self, text: str) -> List[int]:
        """Token ids of plain text (a reference answer), no special tokens added."""
        with self._lock:
            return self._tokenize(text)

    @property
    def eos_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    def _tokenize(self, text: str) -> List[int]:
        return token_ids_of(self.tokenizer(text, add_special_tokens=False))
