"""The unit of data: a `Problem` (one prompt with its reference answer), how it becomes
the text a model sees, and the content hash that names a dataset revision."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple


class DataError(ValueError):
    """Unusable data. The message names the file, the row (0-based) and the field."""


DAPO_PROMPT_TEMPLATE = (
    "Solve the following math problem step by step. The last line of your response should be "
    "of the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
    "{problem}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)
"""The DAPO user-message template (DAPO-Math-17k's prompts already contain it: use
`prompt_template=raw` for that file)."""

PROMPT_TEMPLATES = ("dapo", "raw")


@dataclass(frozen=True)
class Problem:
    """One prompt and its reference answer.

    id: stable identifier (DAPO parquet: extra_info.index; JSONL: "id"; else a hash of
        the prompt), recorded in the ledger.
    prompt: the problem text given to the model: for a chat-list prompt, the content of
        its (last) user message.
    ground_truth: the reference answer, a string (DAPO-Math-17k: an integer as text).
    data_source: where it comes from ("math_dapo", "aime", "synthetic_arithmetic", ...).
    messages: the chat list as stored ([{"role": "user", "content": prompt}] for plain
        prompts), for `data.apply_chat_template`.
    answer_prefix: the tail of a raw prompt that is part of the answer line. The synthetic
        task's prompt ends with "Answer:" and the model only writes " 46"; the reward
        scores answer_prefix + response (see `verification_prefix`). Empty for real data.
    reference_response: a worked response the supervised warm start trains on (the chain
        task's solution lines and `Answer:` line); empty: " " + ground_truth.
    extra_info: the row's `extra_info` as stored (verl's parquet schema), every field: a
        reward function written for verl gets it whole.
    """

    id: str
    prompt: str
    ground_truth: str
    data_source: str
    messages: Tuple[Dict[str, str], ...] = field(default=(), compare=False)
    answer_prefix: str = ""
    reference_response: str = ""
    extra_info: Dict[str, object] = field(default_factory=dict, compare=False)


def format_prompt(problem: Problem, template: str) -> str:
    """The prompt text for the model: "dapo" wraps it in the DAPO template, "raw" keeps it."""
    if template == "raw":
        return problem.prompt
    if template == "dapo":
        return DAPO_PROMPT_TEMPLATE.format(problem=problem.prompt)
    raise ValueError(f"unknown prompt template {template!r}; use one of {PROMPT_TEMPLATES} (data.prompt_template)")


MESSAGE_END = "<|message_end|>"
"""Where a reference response's model ends its message inside the episode (a hermes tool call,
answered after the model's EOS): the warm start writes the tokenizer's EOS there
(`reference_segments`)."""


def reference_segments(problem: Problem) -> List[str]:
    """The reference response cut at each `MESSAGE_END`: the warm start joins the pieces with EOS."""
    return reference_response(problem).split(MESSAGE_END)


def reference_response(problem: Problem) -> str:
    """What the supervised warm start trains the model to write for `problem`."""
    return problem.reference_response or " " + problem.ground_truth


def verification_prefix(problem: Problem, template: str) -> str:
    """What the reward prepends to the response before verification.

    The answer prefix belongs to the end of the raw prompt; the DAPO template ends with an
    instruction instead, so there the model writes the whole "Answer: ..." line itself.
    """
    return problem.answer_prefix if template == "raw" else ""


def compute_dataset_revision(problems: Sequence[Problem]) -> str:
    """12-hex-digit sha256 of the problems' content, in order (ids, prompts, answers,
    sources, answer prefixes). Any change of content or order gives a new revision."""
    digest = hashlib.sha256()
    for p in problems:
        line = json.dumps([p.id, p.prompt, p.ground_truth, p.data_source, p.answer_prefix], ensure_ascii=False)
        digest.update(line.encode("utf-8", errors="surrogatepass"))
        digest.update(b"\n")
    return digest.hexdigest()[:12]


def run_dataset_revision(train_revision: str, eval_revision: str) -> str:
    """The revision a run stamps into every ledger row: its training and held-out splits'
    revisions together (`build_datasets`; `tools/prepare_data.py` prints the same one)."""
    return hashlib.sha256(f"{train_revision}:{eval_revision}".encode()).hexdigest()[:12]
