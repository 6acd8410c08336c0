"""Rollout: the rollout manager (`manager`, `dispatch` with its liveness watchdog `liveness`,
`dynamic_sampling`, `batch_fill`, `partial`) and its typed samples (`samples`). The engines it
talks to are started, attached to and watched in `dapo_mega.engines`; the ledger and the
rollout metrics are records (`dapo_mega.records`).
"""
