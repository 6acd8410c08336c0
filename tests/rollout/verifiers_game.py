"""A `verifiers` environment as its users write one (the classic API: `vf.MultiTurnEnv`,
`env_response`, a `vf.Rubric` of reward functions, `load_environment`), nothing of dapo-mega
in it: VerifiersAgent must run it unchanged. Each turn the environment answers the model with a
user message; the rubric rewards how many turns the episode had and whether it saw the answer."""

import verifiers as vf
from datasets import Dataset


class KeepGoing(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        return [{"role": "user", "content": f"turn {len(state['trajectory'])}: go on"}]


def turns_taken(state, **kwargs) -> float:
    return len(state["trajectory"]) / 10


def saw_the_answer(answer, state, **kwargs) -> float:
    return 1.0 if answer == "4" else 0.0


def load_environment(max_turns: int = 3, **kwargs):
    rubric = vf.Rubric(funcs=[turns_taken, saw_the_answer], weights=[1.0, 0.5])
    dataset = Dataset.from_list([{"question": "2+2=", "answer": "4"}])
    return KeepGoing(dataset=dataset, rubric=rubric, max_turns=max_turns, **kwargs)
