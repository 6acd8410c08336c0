"""A reward written for slime's `--custom-rm-path` (per sample: `async def (args, sample)`),
loaded unchanged: it imports nothing from dapo-mega.

    PYTHONPATH=examples/rewards dapo-mega train algo.verifier=slime_custom_rm:custom_rm

dapo-mega gives it `sample.prompt` (the problem text), `sample.response`, `sample.label` (the
ground truth) and `sample.metadata`; `args` holds nothing (slime's command-line namespace has
no equivalent here). It returns a float, +1 when the last `Answer:` line equals the label.
"""

import re

_ANSWER_LINE = re.compile(r"Answer\s*:\s*([^\n]*)", re.IGNORECASE)


async def custom_rm(args, sample):
    lines = _ANSWER_LINE.findall(sample.response)
    answer = lines[-1].replace(" ", "").strip() if lines else None
    return 1.0 if answer == str(sample.label).replace(" ", "").strip() else -1.0
