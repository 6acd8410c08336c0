"""The one loader of a user's code named in the config (issue #49 item 6): reward functions
(`algo.verifier`), environments (`rollout.environment`), tools and agents.

    load_plugin_object("my_pkg.rewards:score", "algo.verifier: reward plugin")
    load_plugin_object("envs/calc.py:Calculator", "rollout.environment")
    load_plugin_object("rewards.py", "algo.verifier: reward plugin", default_name="compute_score")

A path is `package.module:Name` (imported from `sys.path`: its folder on PYTHONPATH) or
`path/to/file.py:Name` (relative to the working directory; `:Name` may be left out where the
caller has a default, as verl's `custom_reward_function.path` does). A file is loaded once per
process under a name of its own, so two files both called reward.py do not meet in
`sys.modules`, and dataclasses and pickling find the module by that name. Whatever goes wrong is
one line: the config field (`label`), the path, what is wrong, and the fix.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import re
import sys
from types import ModuleType
from typing import Any, Optional, Tuple

from dapo_mega.config import ConfigError

__all__ = ["PLUGIN_PATH", "is_plugin_path", "load_plugin_object", "plugin_error"]

PLUGIN_PATH = re.compile(r"^(?:(?P<module>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):(?P<name>[A-Za-z_]\w*)|"
                         r"(?P<file>[^:]+\.py)(?::(?P<file_name>[A-Za-z_]\w*))?)$")


def is_plugin_path(path: str) -> bool:
    """`path` has one of the forms the loader reads (module docstring)."""
    return bool(PLUGIN_PATH.match(path or ""))


def plugin_error(label: str, path: str, problem: str, fix: str) -> ConfigError:
    """The one-line error of a plugin: `<label> '<path>' <problem>. Fix: <fix>`."""
    return ConfigError(f"{label} {path!r} {problem}. Fix: {fix}")


def load_plugin_object(path: str, label: str, default_name: Optional[str] = None, what: str = "class") -> Any:
    """The object `path` names; ConfigError (`plugin_error`) when the path has no such form, its
    module cannot be imported or raises on import, or it has no such name. `default_name` is
    the name of a file path given without one; `what` names the kind of object in the fix."""
    module, name = _module_of(path, label, default_name)
    if not hasattr(module, name):
        raise plugin_error(label, path, f"not found: module {module.__name__} has no attribute {name!r}",
                           f"name a {what} the module defines")
    return getattr(module, name)


def _module_of(path: str, label: str, default_name: Optional[str]) -> Tuple[ModuleType, str]:
    match = PLUGIN_PATH.match(path or "")
    if match and match["file"] and (match["file_name"] or default_name):
        return _import_file(path, match["file"], label), match["file_name"] or default_name
    if not match or match["file"]:
        return _not_a_path(path, label, default_name)
    module_name = match["module"]
    try:
        return importlib.import_module(module_name), match["name"]
    except ModuleNotFoundError as exc:
        raise plugin_error(label, path, f"cannot be imported ({exc})", "put the folder holding it on PYTHONPATH "
                           "(e.g. PYTHONPATH=examples/rewards) or correct the module name") from None
    except Exception as exc:  # noqa: BLE001 -- the user's module failed at import; say how
        raise plugin_error(label, path, f"raised {type(exc).__name__} on import: {str(exc)[:200]}",
                           f"make the module importable (python -c 'import {module_name}')") from None


def _not_a_path(path: str, label: str, default_name: Optional[str]) -> Tuple[ModuleType, str]:
    forms = "package.module:Name or path/to/file.py" + ("[:Name]" if default_name else ":Name")
    raise plugin_error(label, path, "is not an import path", f"write it as {forms}")


def _import_file(path: str, file: str, label: str) -> ModuleType:
    absolute = os.path.abspath(file)
    if not os.path.isfile(absolute):
        raise plugin_error(label, path, f"names the file {absolute}, which does not exist",
                           "give the file's path, absolute or relative to the directory the run starts in")
    stem = re.sub(r"\W", "_", os.path.basename(absolute)[:-3])
    name = f"_dapo_mega_plugin_{stem}_{hashlib.sha256(absolute.encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, absolute)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[name] = module  # dataclasses and pickling look the module up by name
    try:
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    except BaseException as exc:
        del sys.modules[name]
        if not isinstance(exc, Exception):
            raise
        raise plugin_error(label, path, f"raised {type(exc).__name__} on import: {str(exc)[:200]}",
                           f"make the file importable (python {absolute})") from None
    return module
