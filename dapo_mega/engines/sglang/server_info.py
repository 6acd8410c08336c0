"""What an engine says of how it was started: GET /server_info (SGLang 0.5.23 answers with its
server arguments, the embedded engine with its own), and the registry field the Slurm engines
role writes for the same fact, so learners that attach know what their engines report."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Optional

from dapo_mega.engines.sglang.api import SERVER_INFO_ROUTED_EXPERTS
from dapo_mega.engines.sglang.endpoint import EngineEndpoint

REGISTRY_ROUTED_EXPERTS = "routed_experts"
"""The field of an engine's registry record (`engine-<i>.json`, written by the engines role)
that says whether it was started with --enable-return-routed-experts."""

SERVER_INFO_TIMEOUT_S = 60.0
"""Bounds the /server_info request that asks an attached engine how it was started."""


def server_reports_routed_experts(endpoint: EngineEndpoint) -> Optional[bool]:
    """Whether the engine at `endpoint` was started with --enable-return-routed-experts, as its
    GET /server_info says (SGLang 0.5.23 answers with its server arguments, the embedded
    engine with its own: `SERVER_INFO_ROUTED_EXPERTS` among them; /get_server_info is the
    older name). None when it does not say or does not answer."""
    for path in ("/server_info", "/get_server_info"):
        request = urllib.request.Request(endpoint.url + path, headers=endpoint.headers())
        try:
            with urllib.request.urlopen(request, timeout=SERVER_INFO_TIMEOUT_S) as response:
                info = json.loads(response.read())
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                continue
            return None
        except (urllib.error.URLError, OSError, ValueError):
            return None
        value = info.get(SERVER_INFO_ROUTED_EXPERTS) if isinstance(info, dict) else None
        return None if value is None else bool(value)
    return None
