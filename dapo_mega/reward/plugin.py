"""Reward plugins: `algo.verifier=package.module:function`, a user's reward function.

    def score(response: str, ground_truth: str, metadata: dict) -> RewardResult

response: the model's response (with the task's answer prefix, as every verifier sees it);
ground_truth: the problem's reference answer; metadata: the problem's fields where the
caller passes them (`problem_metadata`: id, data_source, prompt), else {}. It returns a
`RewardResult`: `score`, a finite number, is the sample's correctness reward (in place of
the built-in verifiers' ±1; the overlong penalty is added to it); `correct`, a bool, is the
verdict accuracy is counted on; `components`, names to finite numbers, are the function's
own breakdown of `score`, kept in the ledger as `verifier/<name>`.

The module is imported by its path inside each verifier worker process (`VerifierPool`):
a plugin runs bounded by `algo.verifier_timeout_s` and is killed past it, like math-verify.
The worker's import path is the trainer's `sys.path`, so a module outside the package is
found through PYTHONPATH (`PYTHONPATH=examples/rewards dapo-mega train
algo.verifier=boxed_answer:score`). Its version in the ledger is the one it declares
(`__version__` or `VERSION` on the function, else on its module), or else the hash of its
module's source file (`code_version`). docs/rewards.md is the user's page.
"""

from __future__ import annotations

import importlib
import inspect
import math
import numbers
import re
from dataclasses import dataclass, field
from typing import Callable, Dict, Mapping, Optional

from dapo_mega.config import ConfigError
from dapo_mega.reward.types import VerifyResult, code_version

PLUGIN_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")
SIGNATURE = "(response: str, ground_truth: str, metadata: dict) -> dapo_mega.reward.RewardResult"
FIELD = "algo.verifier"
MAX_EXTRACTED_CHARS = 200


@dataclass(frozen=True)
class RewardResult:
    """What a reward plugin returns for one response.

    score: the correctness reward, a finite number (the built-in verifiers give ±1).
    correct: the verdict (accuracy, all-correct / all-wrong groups are counted on it).
    components: names to finite numbers, the plugin's breakdown of `score` (ledger:
        `reward_components["verifier/<name>"]`).
    extracted: the answer the plugin read, None if none (ledger: `extracted_answer`).
    """

    score: float
    correct: bool
    components: Mapping[str, float] = field(default_factory=dict)
    extracted: Optional[str] = None


def is_plugin_path(spec: str) -> bool:
    """`spec` has the form `package.module:function`."""
    return bool(PLUGIN_PATH.match(spec))


def problem_metadata(problem: object) -> Dict[str, str]:
    """The metadata dict a plugin is given for a problem (a `data.Problem` or alike)."""
    return {"id": str(getattr(problem, "id", "")), "data_source": str(getattr(problem, "data_source", "")),
            "prompt": str(getattr(problem, "prompt", ""))}


def _error(path: str, problem: str, fix: str) -> ConfigError:
    return ConfigError(f"{FIELD}: reward plugin {path!r} {problem}. Fix: {fix}")


_LOADED: Dict[str, Callable[..., object]] = {}


def load_plugin(path: str) -> Callable[..., object]:
    """The function `path` names, imported and checked against SIGNATURE (cached per process)."""
    if path in _LOADED:
        return _LOADED[path]
    if not is_plugin_path(path):
        raise _error(path, "is not an import path", "write it as package.module:function")
    module_name, attr = path.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise _error(path, f"cannot be imported ({exc})",
                     "put the folder holding it on PYTHONPATH (e.g. PYTHONPATH=examples/rewards) "
                     "or correct the module name") from None
    except Exception as exc:  # noqa: BLE001 - the user's module failed at import; say how
        raise _error(path, f"raised {type(exc).__name__} on import: {str(exc)[:200]}",
                     "make the module importable (python -c 'import " + module_name + "')") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise _error(path, f"not found: module {module_name} has no attribute {attr!r}",
                     "name a function the module defines")
    check_signature(path, fn)
    _LOADED[path] = fn
    return fn


def check_signature(path: str, fn: object) -> None:
    """`fn` is a plain callable that accepts (response, ground_truth, metadata)."""
    if not callable(fn) or inspect.isclass(fn):
        raise _error(path, f"is an object of type {type(fn).__name__}, not a function",
                     f"point at a function {SIGNATURE}")
    if inspect.iscoroutinefunction(fn):
        raise _error(path, "is async", f"make it a plain function {SIGNATURE}")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        raise _error(path, "has no signature Python can read", f"wrap it in a Python function {SIGNATURE}") from None
    try:
        signature.bind("response", "ground truth", {})
    except TypeError:
        raise _error(path, f"has the signature {signature}, which cannot be called with (response, "
                     f"ground_truth, metadata)", f"define it as {SIGNATURE}") from None


def plugin_version(path: str, fn: Callable[..., object]) -> str:
    """The declared `__version__` / `VERSION` of the function, else of its module; else the
    hash of the module's source file (see `code_version`)."""
    module = inspect.getmodule(fn)
    for owner in (fn, module):
        for name in ("__version__", "VERSION"):
            declared = getattr(owner, name, None)
            if declared is not None:
                return code_version(path, "", declared=str(declared))
    source = getattr(module, "__file__", None)
    if not source or not source.endswith(".py"):
        raise _error(path, "declares no version and has no .py source to hash",
                     "set __version__ = '1' in its module")
    return code_version(path, source)


def to_verify_result(path: str, value: object) -> VerifyResult:
    """A plugin's return value as a VerifyResult; TypeError naming the plugin if it is not a
    RewardResult with a finite score, a bool verdict and finite components."""
    if not isinstance(value, RewardResult):
        raise TypeError(f"reward plugin {path} returned {type(value).__name__}, not dapo_mega.reward.RewardResult")
    if not _finite(value.score):
        raise TypeError(f"reward plugin {path}: score {value.score!r} is not a finite number")
    if not isinstance(value.correct, bool):
        raise TypeError(f"reward plugin {path}: correct {value.correct!r} is not a bool")
    if not isinstance(value.components, Mapping):
        raise TypeError(f"reward plugin {path}: components is a {type(value.components).__name__}, not a dict")
    for name, part in value.components.items():
        if not isinstance(name, str) or not _finite(part):
            raise TypeError(f"reward plugin {path}: component {name!r}={part!r} is not a name and a finite number")
    if value.extracted is not None and not isinstance(value.extracted, str):
        raise TypeError(f"reward plugin {path}: extracted {value.extracted!r} is not a str or None")
    extracted = None if value.extracted is None else value.extracted[:MAX_EXTRACTED_CHARS]
    components = tuple(sorted((name, float(part)) for name, part in value.components.items()))
    return VerifyResult(correct=value.correct, reward=float(value.score), extracted=extracted, components=components)


def _finite(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class PluginVerifier:
    """A reward plugin as a `Verifier`: scored in the worker pool (never in the trainer's
    process), given the problem's metadata, its result checked on every call.

    It pickles as its path and version; unpickling (in a worker) imports the plugin, so a
    worker is ready only once the import is done. An import that fails there is raised
    again, with its message, by every `score` call (each response a verifier_error).
    """

    name: str
    version: str
    max_response_chars: Optional[int] = None  # the whole response: a plugin may score its length
    runs_in_process: bool = False
    takes_metadata: bool = True

    @classmethod
    def from_path(cls, path: str) -> "PluginVerifier":
        """Import and check `path`; ConfigError naming algo.verifier when it cannot be used."""
        return cls(name=path, version=plugin_version(path, load_plugin(path)))

    def score(self, response: str, ground_truth: str, metadata: Optional[Mapping[str, object]] = None) -> VerifyResult:
        fn = load_plugin(self.name)
        return to_verify_result(self.name, fn(response, ground_truth, dict(metadata or {})))

    def __reduce__(self):
        return (_rebuild, (self.name, self.version))


def _rebuild(name: str, version: str) -> PluginVerifier:
    try:
        load_plugin(name)
    except ConfigError:
        pass  # reported by score(), per response
    return PluginVerifier(name=name, version=version)
