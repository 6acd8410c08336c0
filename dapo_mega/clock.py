"""PLACEHOLDER (helper-3 replaces this file): the run's clock estimates."""

from __future__ import annotations


def resolve_health_timeout_s(cfg) -> float:
    """rollout.health_timeout_s, or the derived engine start bound when it is 0."""
    return float(cfg.rollout.health_timeout_s or 300.0)
