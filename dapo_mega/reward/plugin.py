"""Reward plugins: `algo.verifier=package.module:function` (or `path/to/file.py[:function]`),
a user's reward function, written for dapo-mega, for verl or for slime.

Three calling conventions, told apart by the function's parameter names:

    dapo-mega   score(response, ground_truth, metadata)
    verl        compute_score(data_source, solution_str, ground_truth, extra_info=None)
                (any function with a `solution_str` parameter, or only `**kwargs`; called by
                keyword, as verl's reward managers call it)
    verl batch  compute_score(data_sources, solution_strs, ground_truths, extra_infos)
                (verl's BatchRewardManager form: lists in, a list out; called here with one
                response at a time, in the worker pool like the others)
    slime       async def custom_rm(args, sample)   (`--custom-rm-path`, per sample)

Each may return a float, a dict with `score` (verl's form) or a `RewardResult`
(returns.py says how each reads). A function may be `async` (slime's always is): the
worker awaits it. The module is imported by its path inside each verifier worker process
(`VerifierPool`): a plugin runs bounded by `algo.verifier_timeout_s` and is killed past it.
A dotted path is imported from the trainer's `sys.path` (its folder on PYTHONPATH); a file
path, as verl's `custom_reward_function.path` takes, is loaded from that file, relative to
the working directory, its function `compute_score` when none is named (verl's default).
Its version in the ledger is the one it declares (`__version__` or `VERSION` on the function,
else on its module), or else the hash of its module's source file (`code_version`).
docs/rewards.md is the user's page.
"""

from __future__ import annotations

import asyncio
import inspect
from dataclasses import dataclass, field
from typing import Callable, Dict, Mapping, Optional, Tuple

from dapo_mega.config import ConfigError
from dapo_mega.plugins import is_plugin_path, load_plugin_object, plugin_error
from dapo_mega.reward.returns import MAX_EXTRACTED_CHARS, RewardResult, to_verify_result
from dapo_mega.reward.types import VerifyResult, code_version

VERL_DEFAULT_FUNCTION = "compute_score"
"""The function a file path without `:function` names (verl's `custom_reward_function.name` default)."""
SIGNATURE = "(response: str, ground_truth: str, metadata: dict) -> float | dict | dapo_mega.reward.RewardResult"
SIGNATURES = (f"{SIGNATURE}, verl's (data_source, solution_str, ground_truth, extra_info=None) "
              "or slime's (args, sample)")
FIELD = "algo.verifier"
LABEL = f"{FIELD}: reward plugin"

NATIVE, VERL, VERL_BATCH, SLIME = "dapo_mega", "verl", "verl_batch", "slime"
"""The calling conventions `calling_convention` tells apart."""

__all__ = ["MAX_EXTRACTED_CHARS", "PluginVerifier", "RewardResult", "calling_convention", "is_plugin_path",
           "load_plugin", "problem_metadata", "to_verify_result"]


def problem_metadata(problem: object) -> Dict[str, object]:
    """The metadata dict a plugin is given for a problem (a `data.Problem` or alike): id,
    data_source, prompt, and `extra_info` (the row's, whole) where the row had one."""
    out: Dict[str, object] = {"id": str(getattr(problem, "id", "")),
                              "data_source": str(getattr(problem, "data_source", "")),
                              "prompt": str(getattr(problem, "prompt", ""))}
    extra = getattr(problem, "extra_info", None)
    if extra:
        out["extra_info"] = dict(extra)
    return out


def _error(path: str, problem: str, fix: str) -> ConfigError:
    return plugin_error(LABEL, path, problem, fix)


_LOADED: Dict[str, Tuple[Callable[..., object], str]] = {}


def load_plugin(path: str) -> Tuple[Callable[..., object], str]:
    """The function `path` names and its calling convention, imported (`plugins.load_plugin_object`;
    a file path without `:function` names verl's `compute_score`) and checked (cached per process)."""
    if path not in _LOADED:
        fn = load_plugin_object(path, LABEL, default_name=VERL_DEFAULT_FUNCTION, what="function")
        _LOADED[path] = (fn, calling_convention(path, fn))
    return _LOADED[path]


def calling_convention(path: str, fn: object) -> str:
    """NATIVE, VERL or SLIME: how `fn` is called, from its parameter names; ConfigError when
    it fits none of them (or is slime's batch form, which dapo-mega does not call)."""
    if not callable(fn) or inspect.isclass(fn):
        raise _error(path, f"is an object of type {type(fn).__name__}, not a function", f"point at a function {SIGNATURE}")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        raise _error(path, "has no signature Python can read", f"wrap it in a Python function {SIGNATURE}") from None
    names = [p.name for p in signature.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    keywords_only = not names and any(p.kind == p.VAR_KEYWORD for p in signature.parameters.values())
    if "solution_strs" in signature.parameters:  # verl's BatchRewardManager form
        try:
            signature.bind(data_sources=[], solution_strs=[], ground_truths=[], extra_infos=[])
        except TypeError:
            raise _error(path, f"has verl's batch solution_strs but the signature {signature}, which verl's "
                         "BatchRewardManager call (data_sources=, solution_strs=, ground_truths=, extra_infos=) "
                         "cannot bind", "define it as (data_sources, solution_strs, ground_truths, extra_infos), "
                         "or write the per-sample form (data_source, solution_str, ground_truth, "
                         "extra_info=None)") from None
        return VERL_BATCH
    if "solution_str" in signature.parameters or keywords_only:  # verl calls by keyword
        try:
            signature.bind(data_source="", solution_str="", ground_truth="", extra_info={})
        except TypeError:
            raise _error(path, f"has verl's solution_str but the signature {signature}, which verl's keyword call "
                         "(data_source=, solution_str=, ground_truth=, extra_info=) cannot bind",
                         "define it as (data_source, solution_str, ground_truth, extra_info=None)") from None
        return VERL
    if names[:2] == ["args", "samples"]:
        raise _error(path, "is slime's --group-rm batch form (args, samples), which dapo-mega does not call",
                     "write slime's per-sample form (args, sample), or serve it (algo.verifier=http://...)")
    if names[:2] == ["args", "sample"]:
        return SLIME
    try:
        signature.bind("response", "ground truth", {})
    except TypeError:
        raise _error(path, f"has the signature {signature}, which cannot be called with (response, "
                     f"ground_truth, metadata)", f"define it as {SIGNATURES}") from None
    return NATIVE


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


def verl_extra_info(metadata: Mapping[str, object]) -> Dict[str, object]:
    """verl's `extra_info` for a problem: the row's own extra_info, every field as stored, over
    the metadata (id, data_source, prompt) and `index` (the problem id where the row gave none)."""
    info: Dict[str, object] = {k: v for k, v in metadata.items() if k != "extra_info"}
    if "id" in info:
        info.setdefault("index", info["id"])
    info.update(metadata.get("extra_info") or {})
    return info


class _SlimeArgs:
    """What a slime reward gets as `args`: slime's argparse namespace has no equivalent here."""

    def __getattr__(self, name: str):
        raise AttributeError(f"dapo-mega passes a slime reward no arguments (args.{name}); "
                             "read the setting from a module constant or the environment")


@dataclass(frozen=True)
class SlimeSample:
    """The fields of slime's `Sample` a per-sample reward gets: prompt (the problem text),
    response, label (the ground truth), metadata (problem_metadata). Other fields (tokens,
    status, rollout_log_probs, ...) raise AttributeError saying so."""

    prompt: str
    response: str
    label: str
    metadata: Dict[str, object] = field(default_factory=dict)

    def __getattr__(self, name: str):
        raise AttributeError(f"dapo-mega gives a slime reward the Sample fields prompt, response, label and metadata, "
                             f"not {name!r}")


def check_reward_kwargs(path: str, fn: Callable[..., object], kwargs: Mapping[str, object]) -> None:
    """Each of `algo.reward_kwargs` is a keyword parameter of `fn`, or `fn` takes **kwargs."""
    if not kwargs:
        return
    parameters = inspect.signature(fn).parameters
    if any(p.kind == p.VAR_KEYWORD for p in parameters.values()):
        return
    unknown = sorted(k for k in kwargs if k not in parameters or parameters[k].kind == inspect.Parameter.POSITIONAL_ONLY)
    if unknown:
        raise ConfigError(f"algo.reward_kwargs: {unknown} are not parameters of {path} {inspect.signature(fn)}. Fix: "
                          "add them to the function (with defaults), or drop them from algo.reward_kwargs")


def call_plugin(fn: Callable[..., object], convention: str, response: str, ground_truth: str,
                metadata: Mapping[str, object], kwargs: Optional[Mapping[str, object]] = None) -> object:
    """`fn` called as its convention wants (with `kwargs`, algo.reward_kwargs), awaited when it
    is async; what it returned."""
    kwargs = dict(kwargs or {})
    if convention == VERL:
        value = fn(data_source=metadata.get("data_source", ""), solution_str=response, ground_truth=ground_truth,
                   extra_info=verl_extra_info(metadata), **kwargs)
    elif convention == VERL_BATCH:
        values = fn(data_sources=[metadata.get("data_source", "")], solution_strs=[response],
                    ground_truths=[ground_truth], extra_infos=[verl_extra_info(metadata)], **kwargs)
        if inspect.isawaitable(values):
            values = asyncio.run(_awaited(values))
        if not isinstance(values, (list, tuple)) or len(values) != 1:
            raise TypeError(f"verl batch reward returned {type(values).__name__} for one response; it must return "
                            "a list with one result per response (or write the per-sample form)")
        return values[0]
    elif convention == SLIME:
        value = fn(_SlimeArgs(), SlimeSample(prompt=str(metadata.get("prompt", "")), response=response,
                                             label=ground_truth, metadata=dict(metadata)), **kwargs)
    else:
        value = fn(response, ground_truth, dict(metadata), **kwargs)
    if inspect.isawaitable(value):
        value = asyncio.run(_awaited(value))  # in a worker's main thread, where no loop runs
    return value


async def _awaited(awaitable):
    return await awaitable


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
    kwargs: Tuple[Tuple[str, object], ...] = ()
    """algo.reward_kwargs, given to every call."""

    @classmethod
    def from_path(cls, path: str, kwargs: Optional[Mapping[str, object]] = None) -> "PluginVerifier":
        """Import and check `path` (and that it takes `kwargs`); ConfigError naming the field
        when it cannot be used."""
        fn = load_plugin(path)[0]
        check_reward_kwargs(path, fn, kwargs or {})
        return cls(name=path, version=plugin_version(path, fn), kwargs=tuple(sorted((kwargs or {}).items())))

    def score(self, response: str, ground_truth: str, metadata: Optional[Mapping[str, object]] = None) -> VerifyResult:
        fn, convention = load_plugin(self.name)
        return to_verify_result(f"reward plugin {self.name}",
                                call_plugin(fn, convention, response, ground_truth, metadata or {}, dict(self.kwargs)))

    def __reduce__(self):
        return (_rebuild, (self.name, self.version, self.kwargs))


def _rebuild(name: str, version: str, kwargs: Tuple[Tuple[str, object], ...] = ()) -> PluginVerifier:
    try:
        load_plugin(name)
    except ConfigError:
        pass  # reported by score(), per response
    return PluginVerifier(name=name, version=version, kwargs=kwargs)
