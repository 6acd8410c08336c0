"""Where one engine listens and how to talk to it: URL, API key, request timeout.

Every piece of code that talks to an engine (the HTTP client, the rollout manager, the
weight syncer, evaluation, the fleet that starts engines) takes an `EngineEndpoint`, so
the key and the timeout travel with the URL instead of beside it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, Union

if TYPE_CHECKING:
    from dapo_mega.config import RolloutConfig

CONTROL_TIMEOUT_S = 600.0
"""Default bound on one control request (a 512 MiB weight bucket, a pause, a release)."""


@dataclass(frozen=True)
class EngineEndpoint:
    """One engine (SGLang or the embedded engine) as its clients see it."""

    url: str
    """http://host:port, without a trailing slash."""
    api_key: str = ""
    """Bearer token the engine requires (SGLang --api-key); empty: none."""
    timeout_s: float = 0.0
    """Hard bound on one /generate request's total time (rollout.request_timeout_s); 0 = none:
    a long answer is not a failure, the rollout manager's liveness probes find a hung engine."""
    control_timeout_s: float = CONTROL_TIMEOUT_S
    """Bounds one control request (pause, abort, weight-update group and bucket, release,
    resume, info): work whose size does not grow with the answers' length."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "url", self.url.rstrip("/"))

    def headers(self) -> Dict[str, str]:
        """HTTP headers every request to this engine carries."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


EngineAddress = Union[EngineEndpoint, str]
"""An endpoint, or a bare URL (no API key, the default timeout): what call sites may pass."""


def as_endpoint(engine: EngineAddress) -> EngineEndpoint:
    """`engine` as an `EngineEndpoint` (a bare URL gets no key and the default timeout)."""
    return engine if isinstance(engine, EngineEndpoint) else EngineEndpoint(str(engine))


def endpoint_of(url: str, rollout: "RolloutConfig") -> EngineEndpoint:
    """The endpoint of the engine at `url` with the run's API key and request timeout."""
    return EngineEndpoint(url, api_key=rollout.api_key, timeout_s=rollout.request_timeout_s)
