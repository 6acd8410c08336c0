"""What a run is, kept in its directory: its id, its config, and the changes a resume made.

    <run_dir>/run.json              {"run_id", "run_name", "created_at"}: written once, when the
                                    run starts fresh, and read by every resume of it; each start
                                    adds what it found of its host (`add_to_run_file`: the
                                    environment's sandbox isolation, as `environment`)
    <run_dir>/config.yaml           the resolved config the run trains with now
    <run_dir>/config_history.jsonl  one line per field a resume changed: run_id, step (the first
                                    step trained with the new value), field, old, new, and
                                    shapes_training (whether the field is guarded, below)
    <run_dir>/config.<run_id>.yaml  an earlier run's config.yaml, kept when a fresh run (no
                                    checkpoint, or trainer.resume=false) replaces it

The run id (`<run_name>-<UTC time>-<6 hex>`) is what no other run has: ablation runs share
names (`seed1`, ...) and a rerun reuses one. It goes into every ledger row, the metrics, the
start line and the evaluation files.

One change at a time (the seeds): a curve that rises after a resume proves nothing if the
resume also changed the verifier. `settle_run_dir` compares the config of a resume with the
run's config.yaml before anything is built; a change to a field that shapes the data or the
update (`GUARDED_FIELDS`) stops the start with a ConfigError naming every such field and its
two values, unless `trainer.allow_changes` names it. An allowed change (and any change to an
unguarded field: total_steps, timeouts, logging) is appended to the history, then config.yaml
is rewritten; a refused resume writes nothing. `compare_configs` is the rule, a pure function.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, TypedDict

from dapo_mega.config import ConfigError, DapoConfig, from_yaml, to_yaml
from dapo_mega.run_files.checkpoints import read_trainer_state, resume_checkpoint, write_text_atomic

RUN_FILE = "run.json"
CONFIG_FILE = "config.yaml"
HISTORY_FILE = "config_history.jsonl"
RUN_ID_ENV = "DAPO_MEGA_RUN_ID"
"""The run id a parent process settled, for the learner ranks it spawns (`maybe_spawn_learners`)."""
ABSENT = "<absent>"
"""The value of a field one of the two configs lacks (a config.yaml written by older code)."""

GUARDED_FIELDS = (
    "algo",                   # objective, sampling (temperature, top-p, lengths), reward shaping, verifier, optimizer
    "data",                   # data paths, templates, dedup, shuffle, the synthetic task
    "model",                  # the model and its shape
    "trainer.seed",           # sampling and data order
    "cluster.max_staleness",  # how off-policy the update is
    "rollout.backend",        # the generator
    "rollout.dtype",          # the generator's numerics
    "rollout.model_path",
    "megatron.params_dtype",  # the learner's numerics
    "megatron.fp8",
)
"""Fields (or groups: a name covers every field under it) that shape the data or the update.
Parallel layout, engine counts, timeouts, intervals, logging and paths of the run directory
do not: a resume may change them freely (the change is still recorded)."""

ConfigTree = Dict[str, Any]
"""A resolved config as nested plain dicts (what config.yaml holds): a group is a dict, a
field's value a YAML scalar or list."""


@dataclass(frozen=True)
class ConfigChange:
    """One field whose value a resume changes."""

    field: str
    """Dotted name, e.g. algo.verifier."""
    old: object
    """The value in the run's config.yaml (ABSENT when it has none)."""
    new: object
    """The value of this start's config."""
    shapes_training: bool
    """The field is guarded (`GUARDED_FIELDS`): it needs trainer.allow_changes."""

    def describe(self) -> str:
        return f"{self.field} {json.dumps(self.old)} -> {json.dumps(self.new)}"


class ConfigHistoryRow(TypedDict):
    """One line of config_history.jsonl (`_append_history`): a field a resume changed, from
    `step` (the first step trained with the new value) on, and when."""

    run_id: str
    step: int
    field: str
    old: object
    new: object
    shapes_training: bool
    time: str


class ConfigChangeRefused(ConfigError):
    """A resume changes guarded fields that trainer.allow_changes does not name."""


def save_config(cfg: DapoConfig, run_dir: Path) -> Path:
    """Write the resolved config into the run directory (atomically) as `config.yaml`."""
    run_dir.mkdir(parents=True, exist_ok=True)
    return write_text_atomic(run_dir / "config.yaml", to_yaml(cfg))


def _covers(name: str, path: str) -> bool:
    """`name` is the field `path` or a group above it (`algo` covers `algo.verifier`)."""
    return path == name or path.startswith(name + ".")


def is_guarded(path: str) -> bool:
    return any(_covers(g, path) for g in GUARDED_FIELDS)


def flatten_config(tree: ConfigTree, prefix: str = "") -> Dict[str, object]:
    """{"algo": {"lr": 1}} -> {"algo.lr": 1}; lists are values, not groups."""
    out: Dict[str, object] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten_config(value, name + "."))
        else:
            out[name] = value
    return out


def compare_configs(old: ConfigTree, new: ConfigTree, allowed: Sequence[str] = ()) -> List[ConfigChange]:
    """Every field whose value differs between the run's resolved config `old` and this
    start's `new` (nested dicts), in field order. Raises ConfigChangeRefused naming each
    guarded change that `allowed` (dotted fields or groups) does not cover, with both values;
    ConfigError when an allowed name is no field of the config."""
    flat_old, flat_new = flatten_config(old), flatten_config(new)
    unknown = [a for a in allowed if not any(_covers(a, path) for path in {**flat_old, **flat_new})]
    if unknown:
        raise ConfigError(f"trainer.allow_changes: {', '.join(unknown)} is no config field. Fix: name fields as "
                          "`dapo-mega train --help` lists them, e.g. trainer.allow_changes=[algo.verifier]")
    changes = [ConfigChange(path, flat_old.get(path, ABSENT), flat_new.get(path, ABSENT), is_guarded(path))
               for path in list(flat_new) + [p for p in flat_old if p not in flat_new]
               if flat_old.get(path, ABSENT) != flat_new.get(path, ABSENT)]
    refused = [c for c in changes if c.shapes_training and not any(_covers(a, c.field) for a in allowed)]
    if refused:
        names = ",".join(c.field for c in refused)
        raise ConfigChangeRefused(
            f"{', '.join(c.field for c in refused)}: this resume changes what shapes the data or the update, "
            f"so its curves would no longer compare with the steps before: "
            f"{'; '.join(c.describe() for c in refused)}. Fix: resume with the run's own values (its config.yaml), "
            f"start a new run (another trainer.run_name), or allow the change by name: "
            f"trainer.allow_changes=[{names}] (it is then kept in {HISTORY_FILE})")
    return changes


def new_run_id(run_name: str, now: Optional[float] = None) -> str:
    """`<run_name>-<YYYYmmddTHHMMSSZ>-<6 hex>`: sortable by start time, unique by the random part."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() if now is None else now))
    return f"{run_name}-{stamp}-{secrets.token_hex(3)}"


def config_dict(cfg: DapoConfig) -> ConfigTree:
    """The resolved config as nested plain dicts (what config.yaml holds)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)  # type: ignore[return-value]


def read_saved_config(run_dir: Path) -> Optional[ConfigTree]:
    """The run's config.yaml as nested dicts (None without one). Read through the current
    schema (fields added since get their defaults); a file the schema no longer parses (a
    field since removed) is read as plain YAML, so its fields still compare."""
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        return None
    text = path.read_text()
    try:
        return config_dict(from_yaml(text))
    except Exception:  # omegaconf's errors for a key the schema lacks or a value of another type
        from omegaconf import OmegaConf

        return OmegaConf.to_container(OmegaConf.create(text), resolve=True)  # type: ignore[return-value]


def read_run_id(run_dir: Path) -> Optional[str]:
    """The id in `<run_dir>/run.json`, or None."""
    try:
        return json.loads((Path(run_dir) / RUN_FILE).read_text())["run_id"]
    except (OSError, ValueError, KeyError):
        return None


def run_id_of_path(path: os.PathLike) -> str:
    """The run id of a run directory, its checkpoints directory or one of its checkpoints
    ('' for a model outside a run, e.g. an HF directory)."""
    path = Path(path)
    for candidate in (path, *list(path.parents)[:2]):
        run_id = read_run_id(candidate)
        if run_id:
            return run_id
    return ""


def read_config_history(run_dir: Path, run_id: Optional[str] = None) -> List[ConfigHistoryRow]:
    """The lines of `<run_dir>/config_history.jsonl` (of `run_id` only, when given; a torn
    last line is skipped)."""
    path = Path(run_dir) / HISTORY_FILE
    rows: List[ConfigHistoryRow] = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return [r for r in rows if run_id is None or r.get("run_id") == run_id]


def history_of_current_run(run_dir: Path) -> List[ConfigHistoryRow]:
    """The history lines of the run whose id run.json holds (none without run.json)."""
    run_id = read_run_id(run_dir)
    return read_config_history(run_dir, run_id) if run_id else []


@dataclass
class RunIdentity:
    """Who a start is: the run's id and name, and whether it resumes (with what changes)."""

    run_id: str
    run_name: str
    resumed: bool = False
    resume_step: int = 0
    """The checkpoint's step when resumed."""
    changes: List[ConfigChange] = field(default_factory=list)
    """What this resume changed (empty on a fresh start)."""

    def start_line(self, run_dir: Path) -> str:
        """`[trainer] run <id> ...`: the line the run prints its identity with."""
        how = f"resumed at step {self.resume_step}" if self.resumed else "fresh"
        line = f"[trainer] run {self.run_id} (trainer.run_name={self.run_name}, {run_dir}, {how})"
        if self.changes:
            line += f"; config changes from step {self.resume_step + 1}: " + "; ".join(
                c.describe() + (" (allowed)" if c.shapes_training else "") for c in self.changes)
        return line


def _append_history(run_dir: Path, identity: RunIdentity) -> None:
    lines = [json.dumps({"run_id": identity.run_id, "step": identity.resume_step + 1, **asdict(c),
                         "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
             for c in identity.changes]
    with open(Path(run_dir) / HISTORY_FILE, "a") as f:
        f.write("".join(line + "\n" for line in lines))
        f.flush()
        os.fsync(f.fileno())


def _write_run_file(run_dir: Path, identity: RunIdentity) -> None:
    write_text_atomic(Path(run_dir) / RUN_FILE, json.dumps(
        {"run_id": identity.run_id, "run_name": identity.run_name,
         "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=1) + "\n")


def add_to_run_file(run_dir: Path, **facts: object) -> None:
    """Set `facts` (JSON values) in `<run_dir>/run.json`, keeping what it holds (the driver, at
    each start: what this host gives the run, e.g. `environment`, the sandbox's isolation)."""
    path = Path(run_dir) / RUN_FILE
    try:
        held = json.loads(path.read_text())
    except (OSError, ValueError):
        held = {}
    write_text_atomic(path, json.dumps({**held, **facts}, indent=1) + "\n")


def _start_fresh(cfg: DapoConfig, write: bool, inherited_run_id: Optional[str]) -> RunIdentity:
    run_dir = cfg.run_dir
    previous = read_run_id(run_dir)
    same = inherited_run_id is not None and previous == inherited_run_id  # a rank of the run its parent settled
    identity = RunIdentity(run_id=previous if same else new_run_id(cfg.trainer.run_name), run_name=cfg.trainer.run_name)
    if write and not same:
        old_config = run_dir / CONFIG_FILE
        if old_config.is_file() and previous:  # nothing already written is lost
            os.replace(old_config, run_dir / f"config.{previous}.yaml")
        _write_run_file(run_dir, identity)
    if write:
        save_config(cfg, run_dir)
    return identity


def settle_run_dir(cfg: DapoConfig, write: bool = True, inherited_run_id: Optional[str] = None) -> RunIdentity:
    """The identity of this start of `cfg.run_dir`, before anything is built.

    A resume (trainer.resume and a complete checkpoint) keeps the run's id and compares this
    config with the run's config.yaml (`compare_configs`: a refused change raises
    ConfigChangeRefused and nothing is written). A fresh start makes a new id. With `write`
    (the driver rank, or the parent that spawns the ranks) run.json, the history and
    config.yaml are written; without it, this only checks. `inherited_run_id` is the id the
    parent of a spawned rank settled (RUN_ID_ENV)."""
    run_dir = cfg.run_dir
    checkpoint = resume_checkpoint(run_dir, cfg.trainer.resume, cfg.trainer.resume_step)
    if write:
        run_dir.mkdir(parents=True, exist_ok=True)
    if checkpoint is None:
        return _start_fresh(cfg, write, inherited_run_id)
    saved = read_saved_config(run_dir)
    changes = [] if saved is None else compare_configs(saved, config_dict(cfg), cfg.trainer.allow_changes)
    run_id = read_run_id(run_dir)
    identity = RunIdentity(run_id=run_id or new_run_id(cfg.trainer.run_name), run_name=cfg.trainer.run_name,
                           resumed=True, resume_step=int(read_trainer_state(checkpoint).get("step", 0)),
                           changes=changes)
    if write:
        if run_id is None:  # a run directory from before run ids: it gets one now, kept from here on
            _write_run_file(run_dir, identity)
        if changes:
            _append_history(run_dir, identity)
        if changes or saved is None:
            save_config(cfg, run_dir)
    return identity
