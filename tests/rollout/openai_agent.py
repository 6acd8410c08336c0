"""A test agent written against the `openai` client package, as users write theirs: it runs its
own loop of `calls` text completions, each continuing the last with a line of its own (loaded by
path: `rollout.agent=tests/rollout/openai_agent.py:Continue`)."""

import openai

from dapo_mega.environments.agent import Agent


class Continue(Agent):
    def __init__(self, calls: int = 2, max_tokens: int = 6):
        self.calls, self.max_tokens = calls, max_tokens

    async def run(self, problem, base_url):
        client = openai.AsyncOpenAI(base_url=base_url, api_key="-", max_retries=0)
        text = problem.prompt
        try:
            for call in range(self.calls):
                reply = await client.completions.create(model="policy", prompt=text, max_tokens=self.max_tokens)
                text += reply.choices[0].text + ("\n=" if call + 1 < self.calls else "")
        finally:
            await client.close()
