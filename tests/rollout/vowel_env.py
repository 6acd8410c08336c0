"""A test environment for the tiny char-level model: a turn ends at a vowel (the random model
writes one every ~20 characters; `stops` sets other characters: digits for a warm-started
model, which answers in digits), the answer names the turn and how long it was. Loaded by
path (`tests/rollout/vowel_env.py:VowelEnv`), as a user's environment file is."""

from dataclasses import dataclass

from dapo_mega.environments.base import Environment, StepResult


@dataclass
class Seen:  # a dataclass in a file-loaded module: needs the module in sys.modules
    turn: int


class VowelEnv(Environment):
    stop = list("aeiou")

    def __init__(self, done_after: int = 3, reward: float = 0.0, stops: str = "aeiou"):
        self.done_after, self.reward = done_after, reward
        self.stop = list(stops)

    def reset(self, problem):
        self.seen = Seen(0)
        self.problem_id = problem.id

    def step(self, model_text: str) -> StepResult:
        self.seen.turn += 1
        kind = {"odd": 1} if len(model_text) % 2 else {}
        return StepResult(observation=f"<{self.seen.turn}:{len(model_text)}>", done=self.seen.turn >= self.done_after,
                          reward_parts={"env": self.reward} if self.reward else {}, tool_calls=1, tool_errors=kind,
                          tool_time_s=0.001)
