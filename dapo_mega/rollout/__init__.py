"""Rollout: the rollout manager (`manager`, with what every request is sent with: `settings`),
a round (`round`, its liveness watchdog `watchdog`, one chunk's request `request`, what it
produced `outcome`), multi-turn episodes (`turns`) and the agents' OpenAI-compatible endpoint
(`openai_endpoint`), `dynamic_sampling`, `batch_fill`, `partial`, its typed samples
(`samples`), the run's rollout source (`source`: a step's prompts drawn, generated, scored and
filtered into a RolloutBatch; its asynchronous variant) and the step's rollout metrics from its
ledger rows (`metrics`). The engines it talks to are started, attached to and watched in
`dapo_mega.engines`; the ledger itself is a record (`dapo_mega.records`).
"""
