"""A reward served over HTTP: `algo.verifier=http://host:port/path` (an LLM judge, a
generative verifier, a sandbox: anything that grades behind a URL).

Protocol (docs/rewards.md is the user's page):

    GET  <scheme>://host:port/version
         -> {"version": "judge-v3", "max_batch_size": 64, "max_concurrency": 8}
            (or the version as plain text; both limits optional, defaults below)
    POST <the URL>  {"responses": [...], "ground_truths": [...], "metadata": [{...}, ...]}
         -> {"scores": [...], "version": "judge-v3"}     ("version" optional)

Each item of "scores" is what a reward plugin may return (returns.py): a number (correct
when > 0), a dict with "score" ("acc", "pred", numeric extras) or a RewardResult's fields as
a dict. `slime+http://host:port/path` speaks slime's `--rm-url` protocol instead: one POST
per response, {"prompt": ..., "response": ..., "label": ...} -> the reward (a number or a
dict with "score"). A reply header `X-Reward-Version` also sets the version.

Scoring runs in the caller's process on a private event loop: responses go out in batches
of `max_batch_size`, `max_concurrency` requests at once, each attempt bounded by
`algo.verifier_timeout_s` (connect, send, wait and read together), retried `RETRIES` times
after a connection error, a time-out, a 5xx or 429 reply. A batch whose attempts all fail is
scored as verifier_error for each of its responses (counted in VerifyStats like a worker's
time-outs and exceptions), never raised: an outage costs the step its rewards, not the run.
Network waits are the only work done here, so a cancelled wait is a hard bound; the
server's own work is its business.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple
from urllib.parse import urlsplit

from dapo_mega import log
from dapo_mega.aio import run_coroutine
from dapo_mega.config import ConfigError
from dapo_mega.reward.returns import to_verify_result
from dapo_mega.reward.types import VerifyResult, VerifyStats, verifier_error_result

logger = log.get(__name__)

SERVER_URL = re.compile(r"^(slime\+)?https?://[^/\s:]+(:\d+)?(/\S*)?$")
DEFAULT_BATCH_SIZE = 64
DEFAULT_CONCURRENCY = 8
RETRIES = 2
"""Retries of a failed request (so at most 3 attempts) before its responses are verifier errors."""
BACKOFF_S = (0.2, 1.0)
"""Sleep before retry 1, 2 (the last value again after that)."""
CONNECT_TIMEOUT_S = 10.0
"""Bound of the GET /version a server is reached with when the verifier is built."""
MAX_REPLY_BYTES = 64 << 20
VERSION_HEADER = "X-Reward-Version"
FIELD = "algo.verifier"


def is_server_url(spec: str) -> bool:
    """`spec` is a reward server's URL: http(s)://host[:port][/path], or slime+http(s)://..."""
    return bool(SERVER_URL.match(spec))


class _Failed(Exception):
    """A request that failed for good; `timed_out` says which counter it goes to."""

    def __init__(self, message: str, timed_out: bool = False):
        super().__init__(message)
        self.timed_out = timed_out


@dataclass
class HttpVerifier:
    """A reward server as a `Verifier`, scored a batch at a time (`score_batch`).

    name: the URL as `algo.verifier` gives it (the ledger's `verifier`).
    version: `<name>-<the server's version>`; the version a reply states replaces it, so
        ledger rows carry the version that graded them.
    url: where the POSTs go; protocol: "batch" (dapo-mega's) or "slime" (one per response).
    batch_size / concurrency: responses per POST, POSTs at once (the server's GET /version).
    """

    name: str
    version: str
    url: str
    protocol: str
    batch_size: int = DEFAULT_BATCH_SIZE
    concurrency: int = DEFAULT_CONCURRENCY
    max_response_chars: Optional[int] = None
    runs_in_process: bool = False
    takes_metadata: bool = True
    scores_batches: bool = True

    @classmethod
    def connect(cls, spec: str, timeout_s: float = CONNECT_TIMEOUT_S) -> "HttpVerifier":
        """The verifier of the server `spec` names, its version and limits read by GET /version;
        ConfigError naming algo.verifier when the server cannot be reached."""
        protocol = "slime" if spec.startswith("slime+") else "batch"
        url = spec[len("slime+"):] if protocol == "slime" else spec
        parts = urlsplit(url)
        version_url = f"{parts.scheme}://{parts.netloc}/version"
        try:
            status, body, headers = run_coroutine(_get(version_url, timeout_s))
        except _Failed as exc:
            raise ConfigError(f"{FIELD}: reward server {spec!r} did not answer GET {version_url} ({exc}). Fix: start "
                              "the server (docs/rewards.md says what it serves) or correct the URL") from None
        if status == 404 and protocol == "slime":
            logger.warning("reward server %s has no GET /version: its ledger rows say 'unversioned'", spec)
            return cls(name=spec, version=f"{spec}-unversioned", url=url, protocol=protocol)
        if status != 200:
            raise ConfigError(f"{FIELD}: reward server {spec!r} answered GET {version_url} with HTTP {status}. Fix: "
                              'serve {"version": "..."} there (docs/rewards.md)')
        version, limits = _read_version(spec, body, headers)
        return cls(name=spec, version=f"{spec}-{version}", url=url, protocol=protocol, **limits)

    def score(self, response: str, ground_truth: str, metadata: Optional[Mapping[str, object]] = None) -> VerifyResult:
        """One response (a batch of one); its failure is a verifier_error result, as in a batch."""
        return self.score_batch([response], [ground_truth], [metadata or {}], CONNECT_TIMEOUT_S, VerifyStats())[0]

    def score_batch(self, responses: Sequence[str], ground_truths: Sequence[str],
                    metadata: Sequence[Mapping[str, object]], timeout_s: float, stats: VerifyStats) -> List[VerifyResult]:
        """Every response's result, in order; failures counted in `stats` (num_timeouts,
        num_exceptions, num_retries), never raised."""
        items = list(zip(responses, ground_truths, (dict(m) for m in metadata)))
        return run_coroutine(self._score_all(items, timeout_s, stats))

    async def _score_all(self, items, timeout_s: float, stats: VerifyStats) -> List[VerifyResult]:
        import aiohttp

        size = 1 if self.protocol == "slime" else self.batch_size
        chunks = [items[i:i + size] for i in range(0, len(items), size)]
        gate = asyncio.Semaphore(self.concurrency)
        connector = aiohttp.TCPConnector(limit=self.concurrency)
        async with aiohttp.ClientSession(connector=connector) as session:
            scored = await asyncio.gather(*(self._score_chunk(session, gate, chunk, timeout_s, stats)
                                            for chunk in chunks))
        return [result for chunk in scored for result in chunk]

    async def _score_chunk(self, session, gate: asyncio.Semaphore, chunk, timeout_s: float,
                           stats: VerifyStats) -> List[VerifyResult]:
        source = f"reward server {self.name}"
        async with gate:
            try:
                values = await self._post(session, chunk, timeout_s, stats)
            except _Failed as exc:
                if exc.timed_out:
                    stats.num_timeouts += len(chunk)
                else:
                    stats.num_exceptions += len(chunk)
                return [verifier_error_result(f"{source}: {exc}")] * len(chunk)
        results = []
        for value in values:
            try:
                results.append(to_verify_result(source, value))
            except TypeError as exc:
                stats.num_exceptions += 1
                results.append(verifier_error_result(f"TypeError: {str(exc)[:300]}"))
        return results

    async def _post(self, session, chunk, timeout_s: float, stats: VerifyStats) -> List[object]:
        """The reply's values for `chunk`, after up to RETRIES retries; _Failed when none came."""
        if self.protocol == "slime":
            response, truth, meta = chunk[0]
            payload: Dict[str, object] = {"prompt": meta.get("prompt", ""), "response": response, "label": truth}
        else:
            payload = {"responses": [c[0] for c in chunk], "ground_truths": [c[1] for c in chunk],
                       "metadata": [c[2] for c in chunk]}
        failure = _Failed("no attempt made")
        for attempt in range(RETRIES + 1):
            if attempt:
                stats.num_retries += 1
                await asyncio.sleep(BACKOFF_S[min(attempt, len(BACKOFF_S)) - 1])
            try:
                status, body, headers = await asyncio.wait_for(_request(session, "POST", self.url, payload), timeout_s)
            except asyncio.TimeoutError:
                failure = _Failed(f"timeout after {timeout_s:g}s ({attempt + 1} attempts)", timed_out=True)
                continue
            except _Failed as exc:
                failure = _Failed(f"{exc} ({attempt + 1} attempts)")
                continue
            if status >= 500 or status == 429:
                failure = _Failed(f"HTTP {status}: {body[:200]!r} ({attempt + 1} attempts)")
                continue
            if status != 200:
                raise _Failed(f"HTTP {status}: {body[:200]!r} (not retried: the request itself was refused)")
            return self._values(body, headers, len(chunk))
        raise failure

    def _values(self, body: bytes, headers: Mapping[str, str], expected: int) -> List[object]:
        try:
            reply = json.loads(body)
        except ValueError:
            raise _Failed(f"reply is not JSON: {body[:200]!r}") from None
        version = headers.get(VERSION_HEADER)
        if self.protocol == "slime":
            values = [reply]
        elif not isinstance(reply, dict) or not isinstance(reply.get("scores"), list):
            raise _Failed(f'reply has no "scores" list: {body[:200]!r}')
        else:
            values, version = reply["scores"], reply.get("version", version)
        if len(values) != expected:
            raise _Failed(f"reply has {len(values)} scores for {expected} responses")
        if version is not None and f"{self.name}-{version}" != self.version:
            logger.warning("reward server %s now reports version %s (was %s)", self.name, version, self.version)
            self.version = f"{self.name}-{version}"
        return values


def _read_version(spec: str, body: bytes, headers: Mapping[str, str]) -> Tuple[str, Dict[str, int]]:
    """The server's version and limits from its GET /version reply (JSON, or plain text)."""
    try:
        reply = json.loads(body)
    except ValueError:
        reply = body.decode("utf-8", errors="replace").strip()
    if isinstance(reply, str):
        reply = {"version": reply}
    version = reply.get("version") if isinstance(reply, dict) else None
    version = version or headers.get(VERSION_HEADER)
    if not isinstance(version, (str, int, float)) or not str(version).strip():
        raise ConfigError(f"{FIELD}: reward server {spec!r} gave no version at GET /version (got {body[:200]!r}). "
                          'Fix: serve {"version": "<what decides its scores>"} there (docs/rewards.md)')
    limits = {}
    for key, field_name in (("max_batch_size", "batch_size"), ("max_concurrency", "concurrency")):
        value = reply.get(key)
        if value is not None:
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{FIELD}: reward server {spec!r}: {key} {value!r} at GET /version is not an integer "
                                  f">= 1. Fix: serve a positive integer, or leave it out (default "
                                  f"{DEFAULT_BATCH_SIZE if key == 'max_batch_size' else DEFAULT_CONCURRENCY})")
            limits[field_name] = value
    return str(version).strip(), limits


async def _request(session, method: str, url: str, payload: Optional[object]) -> Tuple[int, bytes, Dict[str, str]]:
    """(status, body, headers) of one request; _Failed on a connection error or an oversized body."""
    import aiohttp

    try:
        async with session.request(method, url, json=payload) as resp:
            body = bytearray()
            async for piece in resp.content.iter_chunked(1 << 16):
                body += piece
                if len(body) > MAX_REPLY_BYTES:
                    raise _Failed(f"reply over {MAX_REPLY_BYTES >> 20} MiB")
            return resp.status, bytes(body), dict(resp.headers)
    except aiohttp.ClientError as exc:
        raise _Failed(f"{type(exc).__name__}: {str(exc)[:200]}") from None


async def _get(url: str, timeout_s: float) -> Tuple[int, bytes, Dict[str, str]]:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        try:
            return await asyncio.wait_for(_request(session, "GET", url, None), timeout_s)
        except asyncio.TimeoutError:
            raise _Failed(f"timeout after {timeout_s:g}s") from None


