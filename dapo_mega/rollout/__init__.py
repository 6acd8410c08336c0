"""Rollout: the engine fleet (`fleet`, `engine_process`: the one place engines are started,
attached to, health-checked, killed and restarted), the embedded CPU engine (the `embedded`
package), the rollout manager (`manager`) and its typed samples (`samples`), the ledger
(`ledger`) and rollout metrics (`metrics`).
"""
