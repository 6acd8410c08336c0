"""Rollout: the rollout manager (`manager`, with what every request is sent with: `settings`),
a round (`round`, its liveness watchdog `watchdog`, one chunk's request `request`, what it
produced `outcome`), multi-turn episodes (`turns`) and the agents' OpenAI-compatible endpoint
(`openai_endpoint`), `dynamic_sampling`, `batch_fill`, `partial`, and its typed samples
(`samples`). The engines it
talks to are started, attached to and watched in `dapo_mega.engines`; the ledger and the
rollout metrics are records (`dapo_mega.records`).
"""
