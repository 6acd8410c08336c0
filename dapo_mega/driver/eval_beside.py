"""The held-out evaluation beside the next step (`eval.overlap`: beside; auto when disaggregated).

Inline, every `trainer.eval_interval` steps the loop stops while avg@k is generated (at 32B:
30 problems x 32 samples of up to 20k tokens), and disaggregated engines had just sat idle
through the learner's update. Beside, the driver starts the evaluation right after the eval
step's weight sync, in a thread, against the engines that now serve that step's weights, and
the loop goes on: the next step's rollout shares the engines with it, and its training runs
while the engines finish it. The next weight sync waits for it first (`finish`, a hand-over
the other ranks wait at, as for an inline evaluation), so every evaluated sample comes from
the weights of the step it is recorded under; only that wait is on the critical path
(`time/eval_s`). The eval step's metrics row is written when the evaluation ends (the next
step, before its sync; at the last step, at once), so its `eval/*` figures land with the step
they evaluated; a run stopped by a signal or its wall-time limit does not wait for it and
writes that row without them, saying so.

The thread does only the generation and scoring (its own RolloutManager and event loop,
`evaluate.evaluate_set`; verifiers run in worker processes), on the run's engine book, so an
engine it finds dead is lost to the training rounds at once (the book is locked). The
prompts are encoded before it starts, in the driver's thread, and everything else that touches
the run's state (result files, console lines) happens in `finish`, in the driver's thread.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Callable, List, Optional, Sequence

if TYPE_CHECKING:
    from dapo_mega.config import DapoConfig
    from dapo_mega.data.build import EvalSet
    from dapo_mega.engines.book import EngineBook
    from dapo_mega.engines.sglang.client import PromptInput
    from dapo_mega.evaluate import EvalResult
    from dapo_mega.reward import Verifier
    from dapo_mega.rollout.samples import PromptEncoding, PromptItem


class EncodedPrompts:
    """One set's problems, each encoded now (in the caller's thread: a fast tokenizer is not to
    be shared with a thread that encodes at the same time); a `PromptEncoding`."""

    def __init__(self, eval_set: "EvalSet", encoding: "PromptEncoding"):
        self.inputs = {p.id: encoding.encode(p) for p in eval_set.problems}
        self.encoding = encoding

    def encode(self, problem: "PromptItem") -> "PromptInput":
        return self.inputs[problem.id]

    def encode_text(self, text: str) -> List[int]:
        """An environment's answer (multi-turn samples): the run's encoder, under its lock."""
        return self.encoding.encode_text(text)

    def tool_message(self, texts: Sequence[str], after: Optional[int] = None) -> str:
        return self.encoding.tool_message(texts, after)


class EvalBeside:
    """One evaluation of every held-out set at `step`, running in a daemon thread."""

    def __init__(self, step: int, run: Callable[[], List["EvalResult"]]):
        self.step = step
        self.seconds: Optional[float] = None
        """How long the evaluation itself took (set when it ends)."""
        self._results: Optional[List["EvalResult"]] = None
        self._error: Optional[BaseException] = None
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._run, args=(run,), name=f"eval-beside-step-{step}", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, step: int, book: "EngineBook", eval_sets: Sequence["EvalSet"], cfg: "DapoConfig",
              encoding: "PromptEncoding", verifier: "Verifier", run_id: str) -> "EvalBeside":
        from dapo_mega.evaluate import evaluate_set

        jobs = [(s, EncodedPrompts(s, encoding)) for s in eval_sets]
        return cls(step, lambda: [evaluate_set(book, s, cfg, encoded, verifier, run_id=run_id)
                                  for s, encoded in jobs])

    def _run(self, run: Callable[[], List["EvalResult"]]) -> None:
        try:
            self._results = run()
        except BaseException as exc:  # noqa: BLE001 - raised again in the driver's thread by `join`
            self._error = exc
        finally:
            self.seconds = time.monotonic() - self._started

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def join(self) -> List["EvalResult"]:
        """The results, once the evaluation has ended; its error, raised here, if it failed."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return list(self._results or [])

