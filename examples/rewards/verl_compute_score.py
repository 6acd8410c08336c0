"""A reward function file written for verl, as verl's documentation shows
(`custom_reward_function.path` / `.name`; docs/preparation/reward_function.rst): it imports
nothing from dapo-mega, and dapo-mega loads it unchanged.

    dapo-mega train algo.verifier=examples/rewards/verl_compute_score.py         # compute_score
    dapo-mega train algo.verifier=examples/rewards/verl_compute_score.py:exact_match_reward

`compute_score` returns verl's dict form, as verl's DAPO reward does: `score` (+1 / -1),
`acc` (the verdict), `pred` (the answer read), plus `format_ok` (1.0 when an answer line was
found), which dapo-mega keeps as the ledger component `verifier/format_ok`.
`exact_match_reward` is the plain-float form (correct when > 0).

The answer is the text after the response's last "Answer:" (the DAPO prompt asks for that
line; the CPU default's prompts end with "Answer:" and the verifier sees it), compared with
the ground truth once spaces, "$" and a trailing "." are removed.
"""

import re

_ANSWER_LINE = re.compile(r"Answer\s*:\s*([^\n]*)", re.IGNORECASE)


def _normalize(text):
    return text.replace("$", "").replace(" ", "").strip().rstrip(".")


def _last_answer(solution_str):
    lines = _ANSWER_LINE.findall(solution_str[-300:])
    return _normalize(lines[-1]) if lines else None


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    pred = _last_answer(solution_str)
    acc = pred is not None and pred == _normalize(str(ground_truth))
    return {"score": 1.0 if acc else -1.0, "acc": acc, "pred": pred, "format_ok": float(pred is not None)}


def exact_match_reward(data_source, solution_str, ground_truth, extra_info=None):
    pred = _last_answer(solution_str)
    return 1.0 if pred is not None and pred == _normalize(str(ground_truth)) else -1.0
