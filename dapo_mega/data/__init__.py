"""Prompts and reference answers: DAPO-Math-17k / AIME parquet and JSONL readers with
validation and deduplication, the synthetic tasks (arithmetic, chain, sum, sum_tool,
calc_tools: synthetic.py), and a resumable iterator.

    build_datasets(data_cfg) -> (train, held_out, revision)   the training and unnamed held-out split
    build_run_datasets(data_cfg, eval_cfg) -> (train, eval sets, revision)   what the trainer calls
    PromptIterator(train, seed).next_batch(n)                  deterministic, resumable
    format_prompt(problem, template)                           "dapo" template or "raw"
    verification_prefix(problem, template)                     prepended to the response for the verifier
    PromptEncoder.from_config(tokenizer, data_cfg).encode(p)   prompt token ids (training and evaluation)
"""

from dapo_mega.data.build import EvalSet, build_datasets, build_run_datasets
from dapo_mega.data.encoder import PromptEncoder, token_ids_of
from dapo_mega.data.iterator import PromptIterator
from dapo_mega.data.problem import (
    DAPO_PROMPT_TEMPLATE,
    DataError,
    Problem,
    compute_dataset_revision,
    format_prompt,
    reference_response,
    reference_segments,
    run_dataset_revision,
    verification_prefix,
)
from dapo_mega.data.readers import ReadReport, read_problems
from dapo_mega.data.synthetic import (
    ANSWER_PREFIX,
    CHAIN_SOURCE,
    SYNTHETIC_SOURCE,
    evaluate_expression,
    generate_synthetic_problems,
    make_arithmetic_problem,
    make_chain_problem,
    solve_chain,
)

__all__ = [
    "ANSWER_PREFIX",
    "CHAIN_SOURCE",
    "DAPO_PROMPT_TEMPLATE",
    "DataError",
    "Problem",
    "PromptEncoder",
    "PromptIterator",
    "ReadReport",
    "SYNTHETIC_SOURCE",
    "EvalSet",
    "build_datasets",
    "build_run_datasets",
    "compute_dataset_revision",
    "run_dataset_revision",
    "evaluate_expression",
    "format_prompt",
    "generate_synthetic_problems",
    "make_arithmetic_problem",
    "make_chain_problem",
    "read_problems",
    "reference_response",
    "reference_segments",
    "solve_chain",
    "token_ids_of",
    "verification_prefix",
]
