"""Synthetic multi-digit arithmetic, the embedded CPU default's task.

A problem looks like

    prompt         "Q: 12+34\\nAnswer:"      (raw template; ~16 characters)
    answer_prefix  "Answer:"
    ground_truth   "46"

and a correct response is " 46\\n": a character-level tiny model with a 16-token
response budget can produce it. The reward verifies answer_prefix + response, i.e.
"Answer: 46\\n", with the same DAPO verifier as the real data (last `Answer:` line).

Operands have `min_digits..max_digits` digits (1-digit operands include 0), operators are
drawn from `ops` (+, -, *) with the usual precedence, so answers are integers (possibly
negative). Train and held-out problems are disjoint as expressions; both are a pure
function of the seed.

The chain task (`task="chain"`, data.synthetic_task=chain) asks for a worked solution:

    prompt              "Q: 12+34-5\n"
    reference_response  "12+34=46\n46-5=41\nAnswer: 41"

one line per operation with its intermediate result (`*` first, leftmost first, then `+`
and `-` left to right), then the answer line. Each problem draws its number of operands
uniformly from 2..num_operands, so the solution length varies with the problem (about 9
characters per operation with 2-digit operands, plus ~10 for the answer line): a response
budget below the longest solutions truncates some, and length shaping, token-level loss and
entropy collapse can show with the tiny model. The verifier checks the final `Answer:`
line only (answer_prefix is empty: the model writes that line itself).

The sum tasks (`sum`, `sum_tool`) are where a tool matters (issue #39 item 5): long operands
(data.synthetic_min_digits=5 and up) that a tiny model cannot add in its head. Both ask

    prompt              "Q: 48213+97120\n"

`sum` is answered directly ("Answer: 145333"); `sum_tool`'s reference hands the sum to the
python tool and copies its output, in the exact text the tool's turn produces
(environments/python_tool.py):

    "<code>print(48213+97120)</code>\n<interpreter>\n145333\n</interpreter>\nAnswer: 145333"

The two draw the same expressions for a seed, so their held-out sets are the same problems.

The calc task (`calc_tools`, issue #47) needs two tools and calls made at once: `a*b+c*d`
answered with the calculator tools `mul` and `add` (environments/calculator.py) in the hermes
format. Its reference calls `mul` twice in one message, ends the message (EOS), reads both
answers, calls `add` on them, reads that, and writes the answer line; with 2-digit operands:

    prompt              "Q: 48*97+31*77\n"
    reference_response  '<tool_call>\n{"name": "mul", "arguments": {"a": 48, "b": 97}}\n</tool_call>\n'
                        '<tool_call>\n{"name": "mul", "arguments": {"a": 31, "b": 77}}\n</tool_call>'
                        '<|message_end|>\n<tool_response>\n4656\n</tool_response>\n'
                        '<tool_response>\n2387\n</tool_response>\n<tool_call>\n{"name": "add", ...'
                        '... <|message_end|>\n<tool_response>\n7043\n</tool_response>\nAnswer: 7043'

(`data.problem.MESSAGE_END` stands for the EOS; the tool responses are the tools environment's
text framing, rollout.tool_message=text).
"""

from __future__ import annotations

import random
from typing import List, Sequence, Set, Tuple

from dapo_mega import log
from dapo_mega.data.problem import DataError, Problem

logger = log.get(__name__)

SYNTHETIC_SOURCE = "synthetic_arithmetic"
CHAIN_SOURCE = "synthetic_chain"
SUM_SOURCE = "synthetic_sum"
CALC_SOURCE = "synthetic_calc"
SYNTHETIC_TASKS = ("arithmetic", "chain", "sum", "sum_tool", "calc_tools")
TASK_OPERATORS = {"calc_tools": "*+*"}
"""The tasks whose expressions have one shape: their operators in order (data.synthetic_ops and
data.synthetic_num_operands do not apply)."""
ANSWER_PREFIX = "Answer:"


def evaluate_expression(operands: Sequence[int], operators: Sequence[str]) -> int:
    """Value of o0 op0 o1 op1 ... with * binding tighter than + and -."""
    terms: List[int] = [operands[0]]
    signs: List[int] = [1]
    for op, value in zip(operators, operands[1:]):
        if op == "*":
            terms[-1] *= value
        elif op in "+-":
            terms.append(value)
            signs.append(1 if op == "+" else -1)
        else:
            raise ValueError(f"unknown operator {op!r}")
    return sum(sign * term for sign, term in zip(signs, terms))


def _operand_count(min_digits: int, max_digits: int) -> int:
    return sum(10 if d == 1 else 9 * 10 ** (d - 1) for d in range(min_digits, max_digits + 1))


def _draw_operand(rng: random.Random, min_digits: int, max_digits: int) -> int:
    digits = rng.randint(min_digits, max_digits)
    return rng.randint(0, 9) if digits == 1 else rng.randint(10 ** (digits - 1), 10 ** digits - 1)


def _enumerate_all(min_digits: int, max_digits: int, ops: str, num_operands: int, shape: str = "") -> List[str]:
    values = [v for d in range(min_digits, max_digits + 1)
              for v in (range(10) if d == 1 else range(10 ** (d - 1), 10 ** d))]
    expressions = [str(v) for v in values]
    for i in range(num_operands - 1):
        expressions = [f"{e}{op}{v}" for e in expressions for op in (shape[i] if shape else ops) for v in values]
    return expressions


def _parse(expression: str) -> Tuple[List[int], List[str]]:
    operands, operators, number = [], [], ""
    for ch in expression:
        if ch.isdigit():
            number += ch
        else:
            operands.append(int(number))
            operators.append(ch)
            number = ""
    operands.append(int(number))
    return operands, operators


def make_arithmetic_problem(expression: str, split: str) -> Problem:
    """The Problem of one expression such as "12+34"."""
    operands, operators = _parse(expression)
    prompt = f"Q: {expression}\n{ANSWER_PREFIX}"
    return Problem(
        id=f"arith-{split}-{expression}",
        prompt=prompt,
        ground_truth=str(evaluate_expression(operands, operators)),
        data_source=SYNTHETIC_SOURCE,
        messages=({"role": "user", "content": prompt},),
        answer_prefix=ANSWER_PREFIX,
    )


def solve_chain(operands: Sequence[int], operators: Sequence[str]) -> Tuple[List[str], int]:
    """(worked lines "a op b=c", value): `*` first (leftmost first), then + and - left to right.
    The value equals `evaluate_expression`."""
    values, ops, lines = list(operands), list(operators), []
    for wanted in ("*", "+-"):
        i = 0
        while i < len(ops):
            if ops[i] not in wanted:
                i += 1
                continue
            a, op, b = values[i], ops[i], values[i + 1]
            c = a * b if op == "*" else a + b if op == "+" else a - b
            lines.append(f"{a}{op}{b}={c}")
            values[i:i + 2] = [c]
            del ops[i]
    return lines, values[0]


def make_chain_problem(expression: str, split: str) -> Problem:
    """The chain-task Problem of one expression such as "12+34-5" (see the module docstring)."""
    operands, operators = _parse(expression)
    lines, value = solve_chain(operands, operators)
    prompt = f"Q: {expression}\n"
    return Problem(
        id=f"chain-{split}-{expression}",
        prompt=prompt,
        ground_truth=str(value),
        data_source=CHAIN_SOURCE,
        messages=({"role": "user", "content": prompt},),
        reference_response="\n".join([*lines, f"{ANSWER_PREFIX} {value}"]),
    )


def make_sum_problem(expression: str, split: str, tool: bool) -> Problem:
    """The sum-task Problem of one expression (module docstring): answered directly, or with
    the python tool (`tool`)."""
    from dapo_mega.environments.python_tool import CODE_CLOSE, CODE_OPEN, OUTPUT_CLOSE, OUTPUT_OPEN

    operands, operators = _parse(expression)
    value = evaluate_expression(operands, operators)
    prompt = f"Q: {expression}\n"
    answer = f"{ANSWER_PREFIX} {value}"
    worked = f"{CODE_OPEN}print({expression}){CODE_CLOSE}\n{OUTPUT_OPEN}\n{value}\n{OUTPUT_CLOSE}\n{answer}"
    return Problem(id=f"sum-{split}-{expression}", prompt=prompt, ground_truth=str(value), data_source=SUM_SOURCE,
                   messages=({"role": "user", "content": prompt},), reference_response=worked if tool else answer)


def make_calc_problem(expression: str, split: str) -> Problem:
    """The calc-task Problem of one expression a*b+c*d (module docstring)."""
    import json

    from dapo_mega.data.problem import MESSAGE_END
    from dapo_mega.environments.tool_calls import CALL_CLOSE, CALL_OPEN, RESPONSE_CLOSE, RESPONSE_OPEN

    (a, b, c, d), _ = _parse(expression)

    def call(name: str, x: int, y: int) -> str:
        return f"{CALL_OPEN}\n{json.dumps({'name': name, 'arguments': {'a': x, 'b': y}})}\n{CALL_CLOSE}"

    def answers(*values: int) -> str:
        return MESSAGE_END + "\n" + "\n".join(f"{RESPONSE_OPEN}\n{v}\n{RESPONSE_CLOSE}" for v in values) + "\n"

    value = a * b + c * d
    worked = (call("mul", a, b) + "\n" + call("mul", c, d) + answers(a * b, c * d) + call("add", a * b, c * d)
              + answers(value) + f"{ANSWER_PREFIX} {value}")
    prompt = f"Q: {expression}\n"
    return Problem(id=f"calc-{split}-{expression}", prompt=prompt, ground_truth=str(value), data_source=CALC_SOURCE,
                   messages=({"role": "user", "content": prompt},), reference_response=worked)


def generate_synthetic_problems(
    num_train: int,
    num_eval: int,
    min_digits: int = 1,
    max_digits: int = 2,
    ops: str = "+-",
    num_operands: int = 2,
    seed: int = 1234,
    task: str = "arithmetic",
) -> Tuple[List[Problem], List[Problem]]:
    """Disjoint (train, held-out) arithmetic problems, deterministic in `seed`.

    task: "arithmetic" (num_operands operands, the answer only), "chain" (2..num_operands
    operands, a worked solution) or "sum" / "sum_tool" (answered directly / with the python
    tool); see the module docstring.

    When the expression space is smaller than num_train + num_eval, the held-out split is
    served first and the training split gets what is left (with a warning).
    """
    if not 1 <= min_digits <= max_digits:
        raise DataError(f"synthetic task: need 1 <= min_digits ({min_digits}) <= max_digits ({max_digits})")
    op_set = "".join(sorted(set(ops)))
    if not op_set or set(op_set) - set("+-*"):
        raise DataError(f"synthetic task: ops {ops!r} must be a non-empty subset of '+-*' (data.synthetic_ops)")
    if num_operands < 2:
        raise DataError(f"synthetic task: num_operands must be >= 2, got {num_operands}")
    if task not in SYNTHETIC_TASKS:
        raise DataError(f"synthetic task: unknown task {task!r}; use one of {SYNTHETIC_TASKS} (data.synthetic_task)")
    shape = TASK_OPERATORS.get(task, "")
    counts = list(range(2, num_operands + 1)) if task == "chain" else [len(shape) + 1] if shape else [num_operands]
    space = sum(_operand_count(min_digits, max_digits) ** n * (1 if shape else len(op_set)) ** (n - 1) for n in counts)
    if num_eval > space:
        raise DataError(f"synthetic task: {num_eval} held-out problems requested but only {space} distinct "
                        "expressions exist; lower data.synthetic_num_eval or raise data.synthetic_max_digits")
    if num_train + num_eval > space:
        logger.warning("synthetic task: only %d distinct expressions; training split cut from %d to %d",
                       space, num_train, space - num_eval)
        num_train = space - num_eval
    needed = num_train + num_eval
    rng = random.Random(seed)
    if space <= 2 * needed:
        # dense: enumerate and shuffle (rejection sampling would need ~space·log(space) draws)
        expressions = [e for n in counts for e in _enumerate_all(min_digits, max_digits, op_set, n, shape)]
        rng.shuffle(expressions)
        chosen = expressions[:needed]
    else:
        # sparse: each draw is new with probability ≥ 1/2, so ~2·needed draws
        seen: Set[str] = set()
        chosen = []
        while len(chosen) < needed:
            n = rng.choice(counts) if len(counts) > 1 else counts[0]  # no extra draw: arithmetic sets stay as they were
            operands = [_draw_operand(rng, min_digits, max_digits) for _ in range(n)]
            operators = list(shape) or [rng.choice(op_set) for _ in range(n - 1)]
            expression = "".join(f"{v}{op}" for v, op in zip(operands, operators)) + str(operands[-1])
            if expression not in seen:
                seen.add(expression)
                chosen.append(expression)
    def make(expression: str, split: str) -> Problem:
        if task == "calc_tools":
            return make_calc_problem(expression, split)
        if task.startswith("sum"):
            return make_sum_problem(expression, split, tool=task == "sum_tool")
        return (make_chain_problem if task == "chain" else make_arithmetic_problem)(expression, split)

    eval_problems = [make(e, "eval") for e in chosen[:num_eval]]
    train_problems = [make(e, "train") for e in chosen[num_eval:]]
    return train_problems, eval_problems
