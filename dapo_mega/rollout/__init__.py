"""Rollout: the engine fleet (`fleet`, `engine_process`: the one place engines are started,
attached to, health-checked, killed and restarted), the embedded CPU engine (the `embedded`
package), the rollout manager (`manager`, `dispatch`, `dynamic_sampling`) and its typed samples
(`samples`). The ledger and the rollout metrics are records (`dapo_mega.records`).
"""
