"""The sandbox as a service on other nodes (issue #47 item 5), as peers send model-written code
to SandboxFusion-style services instead of running it beside the driver:

    dapo-mega sandbox serve --host 0.0.0.0 --port 8090 --max-concurrent 64 [--wall-s 10 ...]
    dapo-mega train rollout.environment=python +rollout.environment_kwargs.url=http://node7:8090

`serve` runs the same `Sandbox` (its isolation, limits and slots) behind HTTP: `POST /run`
`{"code": ...}` answers the `SandboxResult` as JSON, `GET /health` the sandbox's report. The
python tool with `url` sends each run there (`RemoteSandbox`); the limits are the service's. A
service that cannot be reached or fails answers the run as `sandbox_error` with the reason in
the text the model reads (counted in `rollout/tool_errors/sandbox_error`): the episode goes on
without its output, the run is not stopped. Not built yet: a pool of warm interpreters (each
run is a fresh isolated interpreter, as on the driver) and the recipe's Slurm step that starts it.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, fields
from typing import Any, Dict, List, Optional

from dapo_mega.environments.sandbox import Sandbox, SandboxLimits, SandboxResult

__all__ = ["RemoteSandbox", "main", "serve"]

READY = "dapo-mega sandbox: serving on"
"""The line `serve` prints once it listens (then the URL)."""


def serve(sandbox: Sandbox, host: str = "127.0.0.1", port: int = 0) -> None:
    """Serve `sandbox` until interrupted; prints READY and the URL once listening."""
    from aiohttp import web

    runs = ThreadPoolExecutor(sandbox.max_concurrent, thread_name_prefix="dapo-mega-sandbox")

    async def run(request: web.Request) -> web.Response:
        body = await request.json()
        if not isinstance(body, dict) or not isinstance(body.get("code"), str):
            return web.json_response({"error": 'POST {"code": "..."}'}, status=400)
        result = await asyncio.get_running_loop().run_in_executor(runs, sandbox.run, body["code"])
        return web.json_response(asdict(result))

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"ok": True, **sandbox.report()})

    async def main_() -> None:
        app = web.Application()
        app.router.add_post("/run", run)
        app.router.add_get("/health", health)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        print(f"{READY} http://{host}:{bound}", flush=True)
        await asyncio.Event().wait()

    try:
        asyncio.run(main_())
    finally:
        runs.shutdown(wait=False, cancel_futures=True)


class RemoteSandbox:
    """A `Sandbox` at `url` (`serve`): `run(code)` as the local one, over HTTP (a thread of the
    round's tools blocks on it); `timeout_s` bounds a run's answer (the service's wall limit plus
    its start and transfer)."""

    def __init__(self, url: str, limits: SandboxLimits, timeout_s: Optional[float] = None):
        self.url, self.limits = url.rstrip("/"), limits
        self.timeout_s = timeout_s or limits.wall_s + 30.0

    def run(self, code: str) -> SandboxResult:
        request = urllib.request.Request(self.url + "/run", data=json.dumps({"code": code}).encode(),
                                         headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
                data = json.loads(reply.read())
            known = {f.name for f in fields(SandboxResult)}
            return SandboxResult(**{k: v for k, v in data.items() if k in known})
        except (urllib.error.URLError, OSError, ValueError, TypeError) as exc:
            reason = getattr(exc, "reason", exc)
            return SandboxResult(status="sandbox_error", exit_code=None, stdout="", wall_s=0.0,
                                 stderr=f"the sandbox service at {self.url} failed: {reason}")

    def take_metrics(self) -> Dict[str, float]:
        return {}

    def report(self) -> Dict[str, Any]:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=10) as reply:
                return {"service": self.url, **json.loads(reply.read())}
        except (urllib.error.URLError, OSError, ValueError) as exc:
            return {"service": self.url, "unreachable": str(getattr(exc, "reason", exc))}


def main(argv: List[str]) -> int:
    """`dapo-mega sandbox serve [--host H] [--port P] [--max-concurrent N] [--isolation LEVEL]
    [--wall-s S] [--cpu-s S] [--memory-mb M] [--output-bytes B] [--processes N] [--threads N]`."""
    import argparse

    from dapo_mega.environments.sandbox import LEVELS

    parser = argparse.ArgumentParser(prog="dapo-mega sandbox serve", description=main.__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--max-concurrent", type=int, default=32)
    parser.add_argument("--isolation", choices=LEVELS, default="none")
    defaults = SandboxLimits()
    for name in ("wall_s", "cpu_s", "memory_mb", "output_bytes", "processes", "threads"):
        parser.add_argument("--" + name.replace("_", "-"), type=type(getattr(defaults, name)),
                            default=getattr(defaults, name))
    args = parser.parse_args(argv)
    limits = SandboxLimits(**{name: getattr(args, name) for name in (
        "wall_s", "cpu_s", "memory_mb", "output_bytes", "processes", "threads")})
    serve(Sandbox(limits, args.max_concurrent, isolation=args.isolation), args.host, args.port)
    return 0
