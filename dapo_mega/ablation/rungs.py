"""The ablation config (`configs/ablation/`) and the runs it expands to.

An ablation is a base (train overrides every run gets) and an ordered list of named rungs,
each a set of train overrides:

    mode: ladder   rung i = base + rungs[0] + ... + rungs[i]     (the paper's Table 1)
    mode: sweep    rung i = base + rungs[i]                       (one factor at a time)

Each rung runs once per seed (`trainer.seed`). A run's overrides, in order (a later value
of the same key wins, see `merge_overrides`):

    ablation.base, ablation.quick_overrides (quick only), the user's train overrides,
    the rung's overrides, then the run's own: trainer.seed, trainer.output_dir,
    trainer.run_name and, with a shared warm start, model.megatron_path + sft_warmup_steps=0

so the technique a rung tests always wins over a user's override of the same field.

Directory of an ablation: `<trainer.output_dir>/<ablation.name>[_quick]/` with
`plan.json` (this expansion), `warm_start/` (the shared supervised warm start, a run of
0 RL steps), `runs/<NN>_<rung>/seed<S>/` (ordinary run directories), `logs/`, and the
results (`ablation.md`, `ablation.json`, `ablation.png`).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from dapo_mega.config import hydra_value
from dapo_mega.run_files.checkpoints import write_text_atomic

ABLATION_GROUP = "ablation"
DEFAULT_ABLATION = "dapo_ladder"
PLAN_FILE = "plan.json"
WARM_START_DIR = "warm_start"
AblationMode = ("ladder", "sweep")


@dataclass
class RungConfig:
    name: str = ""
    """Row label in the table, e.g. "+clip_higher" (ladder) or "-dynamic_sampling" (sweep)."""
    overrides: List[str] = field(default_factory=list)
    """Hydra overrides of `dapo-mega train` this rung adds (e.g. algo.clip_ratio_high=0.28)."""


@dataclass
class AblationConfig:
    name: str = "ablation"
    """Directory of the ablation under trainer.output_dir (`_quick` is appended in quick mode)."""
    mode: str = "ladder"
    """ladder: each rung adds its overrides to the previous rung's; sweep: each rung adds its
    overrides to the base alone. Consecutive rungs (ladder) or each rung and the first
    (sweep) are compared with Welch's interval."""
    base: List[str] = field(default_factory=list)
    """Train overrides of every run (the ladder's starting point, e.g. naive GRPO)."""
    rungs: List[RungConfig] = field(default_factory=list)
    """The ordered rungs; the first usually has no overrides (the base itself)."""
    seeds: List[int] = field(default_factory=lambda: [1, 2, 3])
    """trainer.seed of each run of a rung (rollout sampling and data order)."""
    quick: bool = False
    """A reduced ablation that runs in minutes: quick_rungs, quick_seeds, quick_overrides."""
    quick_rungs: List[str] = field(default_factory=list)
    """Quick mode: the rungs kept (names; empty: all). A ladder still accumulates the
    overrides of the rungs left out, so a kept rung means the same as in the full ladder."""
    quick_seeds: List[int] = field(default_factory=lambda: [1, 2])
    """Quick mode: seeds (at least two, for an interval)."""
    quick_overrides: List[str] = field(default_factory=list)
    """Quick mode: train overrides that shorten every run (steps, evaluation size)."""
    target: Optional[float] = None
    """Held-out avg@k a run must reach for the "steps to target" column (null: column empty)."""
    level: float = 0.95
    """Confidence level of the intervals."""
    shared_warm_start: bool = True
    """With trainer.sft_warmup_steps > 0: one supervised warm start (a run of 0 RL steps)
    that every run starts from (model.megatron_path), as the paper's runs start from one
    base model; false: each run does its own warm start."""
    slurm: bool = False
    """Run as a Slurm job array (`--slurm` does the same) instead of locally one by one."""
    sbatch_script: str = "colocated.sbatch"
    """Topology file under slurm/ that each array task runs (its #SBATCH lines are copied
    into the array script; the runs' overrides come from a task file, never the script)."""
    sbatch_args: List[str] = field(default_factory=list)
    """Extra sbatch options of the array and warm-start jobs (e.g. --nodes=2, --mem=4000)."""
    max_parallel: int = 0
    """Slurm: at most this many array tasks at once (sbatch --array=...%N; 0 = no limit)."""
    run_timeout_s: float = 0.0
    """Local: a run taking longer is killed and reported failed (0 = no limit)."""

    def validate(self) -> None:
        from dapo_mega.config import ConfigError

        if self.mode not in AblationMode:
            raise ConfigError(f"ablation.mode: unknown {self.mode!r}. Fix: use ladder or sweep")
        if not self.rungs:
            raise ConfigError("ablation.rungs: empty. Fix: pick an ablation, e.g. +ablation=dapo_ladder")
        names = [r.name for r in self.rungs]
        if len(set(names)) != len(names) or not all(names):
            raise ConfigError(f"ablation.rungs: names must be unique and non-empty, got {names}. Fix: rename them")
        unknown = set(self.quick_rungs) - set(names)
        if unknown:
            raise ConfigError(f"ablation.quick_rungs: {sorted(unknown)} are not rungs ({names}). Fix: use rung names")
        if not self.active_seeds():
            raise ConfigError("ablation.seeds: empty. Fix: give at least one seed, two or more for intervals")
        if len(set(self.active_seeds())) != len(self.active_seeds()):
            raise ConfigError(f"ablation.seeds: repeated seeds {self.active_seeds()}. Fix: make them distinct")
        if not 0.0 < self.level < 1.0:
            raise ConfigError(f"ablation.level: must be in (0, 1), got {self.level}. Fix: use 0.95")

    def active_seeds(self) -> List[int]:
        return list(self.quick_seeds if self.quick else self.seeds)

    def directory_name(self) -> str:
        return f"{self.name}_quick" if self.quick else self.name


@dataclass
class AblationRoot:
    """Schema of `configs/ablate.yaml`: the ablation config under the key `ablation`."""

    ablation: AblationConfig = field(default_factory=AblationConfig)


@dataclass
class PlannedRun:
    """One training run of the ablation: a rung at a seed."""

    rung: str
    rung_index: int
    seed: int
    run_dir: str
    overrides: List[str]
    """The complete `dapo-mega train` overrides of the run."""


@dataclass
class AblationPlan:
    """What `plan.json` holds: the config, the rungs in table order and every run."""

    directory: str
    config: Dict[str, Any]
    rungs: List[str]
    runs: List[PlannedRun]
    warm_start: Optional[PlannedRun] = None
    train_overrides: List[str] = field(default_factory=list)

    def runs_of(self, rung: str) -> List[PlannedRun]:
        return [r for r in self.runs if r.rung == rung]

    def save(self) -> Path:
        path = Path(self.directory) / PLAN_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        return write_text_atomic(path, json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, directory: Path | str) -> "AblationPlan":
        d = json.loads((Path(directory) / PLAN_FILE).read_text())
        warm = PlannedRun(**d["warm_start"]) if d.get("warm_start") else None
        return cls(directory=d["directory"], config=d["config"], rungs=list(d["rungs"]),
                   runs=[PlannedRun(**r) for r in d["runs"]], warm_start=warm,
                   train_overrides=list(d.get("train_overrides", [])))


# --------------------------------------------------------------------------- composition
def split_arguments(args: List[str]) -> tuple:
    """(ablation overrides, train overrides): `+ablation=X`, `ablation=X` and `ablation.*`
    go to the ablation config; everything else is a `dapo-mega train` override."""
    ablation, train = [], []
    for arg in args:
        key = arg.lstrip("+~")
        if key == ABLATION_GROUP or key.startswith(ABLATION_GROUP + "=") or key.startswith(ABLATION_GROUP + "."):
            ablation.append(arg)
        else:
            train.append(arg)
    return ablation, train


def load_ablation_config(overrides: List[str]) -> AblationConfig:
    """Compose `configs/ablate.yaml` + the ablation group; `ablation=X` and `+ablation=X`
    both select X (default dapo_ladder). A bad key or value raises ConfigError."""
    from hydra.core.config_store import ConfigStore

    from dapo_mega.config import compose_config

    ConfigStore.instance().store(name="ablate_schema", node=AblationRoot)
    chosen = [o for o in overrides if o.lstrip("+").startswith(ABLATION_GROUP + "=")]
    rest = [o for o in overrides if o not in chosen]
    group = chosen[-1].split("=", 1)[1] if chosen else DEFAULT_ABLATION
    obj = compose_config("ablate", [f"+{ABLATION_GROUP}={group}", *rest])
    assert isinstance(obj, AblationRoot)
    obj.ablation.validate()
    return obj.ablation


def override_key(override: str) -> str:
    """The key an override sets: `+algo.lr=1` -> `algo.lr`, `algo=grpo` -> `algo`."""
    return override.split("=", 1)[0].lstrip("+~")


def merge_overrides(*groups: List[str]) -> List[str]:
    """Concatenate override lists; a later value of the same key replaces the earlier one
    (Hydra rejects two values of one key), in the position of the first."""
    merged: Dict[str, str] = {}
    for group in groups:
        for override in group:
            merged[override_key(override)] = override  # an existing key keeps its place
    return list(merged.values())


def rung_overrides(cfg: AblationConfig, index: int) -> List[str]:
    """The overrides that make rung `index` from the base (ladder: all rungs up to it)."""
    if cfg.mode == "ladder":
        return [o for rung in cfg.rungs[:index + 1] for o in rung.overrides]
    return list(cfg.rungs[index].overrides)


def slug(name: str) -> str:
    """A directory-safe form of a rung name: "+clip_higher" -> "clip_higher"."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "rung"


def build_plan(cfg: AblationConfig, train_overrides: List[str], output_dir: Path | str,
               sft_warmup_steps: int) -> AblationPlan:
    """Every run of the ablation (and the shared warm start when there is one)."""
    directory = (Path(output_dir) / cfg.directory_name()).resolve()
    common = merge_overrides(cfg.base, cfg.quick_overrides if cfg.quick else [], train_overrides)
    warm: Optional[PlannedRun] = None
    extra: List[str] = []
    if cfg.shared_warm_start and sft_warmup_steps > 0:
        warm_dir = directory / WARM_START_DIR
        warm = PlannedRun(rung="warm_start", rung_index=-1, seed=cfg.active_seeds()[0], run_dir=str(warm_dir),
                          overrides=merge_overrides(common, [
                              "trainer.total_steps=0", f"trainer.seed={cfg.active_seeds()[0]}",
                              f"trainer.output_dir={hydra_value(str(directory))}",
                              f"trainer.run_name={WARM_START_DIR}", "trainer.eval_interval=0"]))
        extra = [f"model.megatron_path={hydra_value(str(warm_dir))}", "trainer.sft_warmup_steps=0"]
    kept = set(cfg.quick_rungs) if cfg.quick and cfg.quick_rungs else {r.name for r in cfg.rungs}
    runs: List[PlannedRun] = []
    rungs: List[str] = []
    for index, rung in enumerate(cfg.rungs):
        if rung.name not in kept:
            continue
        rungs.append(rung.name)
        rung_dir = directory / "runs" / f"{index:02d}_{slug(rung.name)}"
        for seed in cfg.active_seeds():
            own = [f"trainer.seed={seed}", f"trainer.output_dir={hydra_value(str(rung_dir))}",
                   f"trainer.run_name=seed{seed}", *extra]
            runs.append(PlannedRun(rung=rung.name, rung_index=index, seed=seed, run_dir=str(rung_dir / f"seed{seed}"),
                                   overrides=merge_overrides(common, rung_overrides(cfg, index), own)))
    return AblationPlan(directory=str(directory), config=asdict(cfg), rungs=rungs, runs=runs, warm_start=warm,
                        train_overrides=list(train_overrides))
