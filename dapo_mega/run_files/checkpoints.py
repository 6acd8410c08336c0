"""The checkpoints of a run directory as files: step directories, `latest`, atomic commit, keep-K.

What is *in* a checkpoint (Megatron's sharded model and optimizer state, RNG states) is
written by `dapo_mega/backends/megatron/checkpoint.py`; this module only knows the
directory protocol, so the launcher, tools and tests can find and prune checkpoints
without importing torch or Megatron.

Layout of a run directory:

    <run_dir>/checkpoints/
        step_000040/                  a complete checkpoint (only complete ones have this name)
            model_optim/              the distributed checkpoint (its metadata.json marks it done)
            rng/rank_00000.pt         per-rank RNG states
            dapo_mega_model.json      model shape + HF config (so export can rebuild the model)
            trainer_state.json        step, policy_version, data cursor, dynamic-sampling
                                      carry-over, wandb run id, … (whatever the trainer passes)
        step_000045.tmp-1234/         a save in progress or interrupted: always ignored
        latest                        text file "step_000045", replaced last

Atomicity (a crash at any point leaves the previous checkpoint usable):
1. `begin_step_dir` creates `step_<N>.tmp-<pid>/`; every rank writes its part into it;
2. `commit_step_dir` writes the small JSON files, fsyncs files and directories, renames the
   tmp directory to `step_<N>/` (atomic on POSIX), then replaces `latest` (tmp file +
   fsync + os.replace); `prune_checkpoints` then deletes all but the newest `keep_last_k`.
An error before the rename leaves only a tmp directory, which is never read and is
removed by the next prune. `find_latest_checkpoint` trusts `latest` only if it names a
complete checkpoint, else takes the highest complete `step_<N>`.

Hugging Face exports of the running learner (`trainer.hf_export_interval`) follow the same
protocol in their own folder, with their own keep-K (`trainer.hf_export_keep`):

    <run_dir>/hf/
        step_000040/                  complete: shards + model.safetensors.index.json,
                                      config.json, generation_config.json, tokenizer files
        step_000045.tmp-1234/         an export in progress or interrupted: never complete
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence

CHECKPOINTS_DIR = "checkpoints"
LATEST_FILE = "latest"
MODEL_OPTIM_DIR = "model_optim"
TRAINER_STATE_FILE = "trainer_state.json"
MODEL_META_FILE = "dapo_mega_model.json"
RNG_DIR = "rng"
BRANCHED_FILE = "restarted_from"
"""Under checkpoints/: the step a `trainer.resume_step` restart went back to (a later start
with the same setting goes on from the latest checkpoint instead of going back again)."""
FORMAT_VERSION = 1
HF_EXPORTS_DIR = "hf"
HF_INDEX_FILE = "model.safetensors.index.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_PARTIAL_STEP_DIR = re.compile(r"^step_\d+\.(tmp|old)-\d+$")


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written; the previous one and `latest` are intact."""


class CheckpointNotFoundError(FileNotFoundError):
    """No complete checkpoint where one was expected."""


class HFExportError(RuntimeError):
    """An HF export could not be written; the earlier exports and the checkpoints are intact."""


# --------------------------------------------------------------------------- finding


def checkpoints_root(run_dir: Path | str) -> Path:
    """`<run_dir>/checkpoints` (or `run_dir` itself when it already is a checkpoints dir)."""
    run_dir = Path(run_dir)
    if run_dir.name == CHECKPOINTS_DIR or (run_dir / LATEST_FILE).is_file():
        return run_dir
    return run_dir / CHECKPOINTS_DIR


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def is_complete_checkpoint(path: Path | str) -> bool:
    """A `step_<N>` directory with its trainer state and a finished distributed checkpoint."""
    path = Path(path)
    return (bool(_STEP_DIR.match(path.name)) and path.is_dir() and (path / TRAINER_STATE_FILE).is_file()
            and (path / MODEL_OPTIM_DIR / "metadata.json").is_file())


def list_complete_checkpoints(run_dir: Path | str) -> List[Path]:
    """Complete checkpoints of a run, oldest step first (tmp and partial dirs skipped)."""
    root = checkpoints_root(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if is_complete_checkpoint(p)]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def find_latest_checkpoint(run_dir: Path | str) -> Optional[Path]:
    """The checkpoint to resume from, or None.

    `latest` is followed when it names a complete checkpoint; a dangling or corrupt
    `latest` (crash between rename and pointer update, a deleted dir) falls back to the
    highest complete `step_<N>`. Interrupted `*.tmp-*` directories are never chosen.
    """
    root = checkpoints_root(run_dir)
    pointer = root / LATEST_FILE
    if pointer.is_file():
        name = pointer.read_text().strip()
        if name and "/" not in name and is_complete_checkpoint(root / name):
            return root / name
    complete = list_complete_checkpoints(root)
    return complete[-1] if complete else None


def resume_checkpoint(run_dir: Path | str, resume: bool = True, step: int = 0) -> Optional[Path]:
    """The checkpoint a start resumes from: none without `resume`; the latest complete one,
    or with `step` > 0 (`trainer.resume_step`) exactly step_<step>, refused (naming the
    complete ones) when it is not there."""
    if not resume:
        return None
    branched = checkpoints_root(run_dir) / BRANCHED_FILE
    if step <= 0 or (branched.is_file() and branched.read_text().strip() == str(step)):
        return find_latest_checkpoint(run_dir)  # a restart from `step` already happened: go on from there
    named = checkpoints_root(run_dir) / step_dir_name(step)
    if not is_complete_checkpoint(named):
        have = [int(_STEP_DIR.match(p.name).group(1)) for p in list_complete_checkpoints(run_dir)]
        raise CheckpointNotFoundError(f"trainer.resume_step={step}: no complete checkpoint {named}; the run has "
                                      f"steps {have or 'none'}. Fix: name one of them, or 0 for the latest")
    return named


def set_aside_after(run_dir: Path | str, step: int, label: str) -> Optional[Path]:
    """A restart from an earlier step (`trainer.resume_step`) keeps what the later steps wrote:
    their checkpoints, HF exports, ledger shards and eval files, and metrics.jsonl as it was, move to
    `<run_dir>/set_aside/<label>/` (the same relative paths), so that the new steps cannot
    overwrite them. Returns that directory, or None when there was nothing after `step`."""
    run_dir = Path(run_dir)
    later = [p for p in list_complete_checkpoints(run_dir) if int(_STEP_DIR.match(p.name).group(1)) > step]
    later += [p for p in list_complete_hf_exports(run_dir) if hf_export_step(p) > step]
    for sub in ("ledger", "eval"):
        later += [p for p in sorted((run_dir / sub).glob("step_*")) if int(p.name.split("_")[1].split(".")[0]) > step]
    if not later:
        return None
    dest = run_dir / "set_aside" / label
    for path in later:
        target = dest / path.relative_to(run_dir)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, target)
    if (run_dir / "metrics.jsonl").exists():
        shutil.copy2(run_dir / "metrics.jsonl", dest / "metrics.jsonl")
    write_text_atomic(checkpoints_root(run_dir) / LATEST_FILE, step_dir_name(step) + "\n")
    write_text_atomic(checkpoints_root(run_dir) / BRANCHED_FILE, f"{step}\n")
    return dest


def resolve_checkpoint_dir(path: Path | str) -> Path:
    """A step dir as given, or the latest complete checkpoint of a run / checkpoints dir."""
    path = Path(path)
    if is_complete_checkpoint(path):
        return path
    if path.is_file() and path.name == LATEST_FILE:
        path = path.parent
    found = find_latest_checkpoint(path)
    if found is None:
        raise CheckpointNotFoundError(f"no complete checkpoint under {path} (looked for "
                                      f"{checkpoints_root(path)}/step_<N>/ with {TRAINER_STATE_FILE})")
    return found


def read_trainer_state(step_dir: Path | str) -> Dict[str, Any]:
    """The trainer_state.json of a complete checkpoint."""
    return json.loads((Path(step_dir) / TRAINER_STATE_FILE).read_text())


def encode_trainer_state(trainer_state: Mapping[str, object], step: int, **extra: object) -> str:
    """trainer_state.json text: the trainer's dict + step, format version, save time and `extra`.

    Raises TypeError when the state is not JSON-serialisable (call it before writing anything).
    """
    return json.dumps({**trainer_state, "step": step, "format_version": FORMAT_VERSION, "saved_at": time.time(),
                       **extra}, indent=2, sort_keys=True)


# --------------------------------------------------------------------------- writing


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (so a rename inside it is durable)."""
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for fn in filenames:
            fsync_path(Path(dirpath) / fn)
        fsync_path(Path(dirpath))


@contextmanager
def atomic_path(path: Path | str, durable: bool = True) -> Iterator[Path]:
    """Yield `<path>.tmp-<pid>-<thread>` for a writer that needs a path (pyarrow, savefig, ...);
    on a clean exit os.replace it onto `path`: readers see the old file or the new one, never
    half. `durable` fsyncs the file before the rename and the directory after it (skip it only
    where a crash loses nothing, e.g. tmpfs). On an error the temp file is removed and the old
    `path` is left as it was. The one temp-then-rename of a file in the package."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        yield tmp
        if durable:
            fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_path(path.parent)


def write_bytes_atomic(path: Path | str, data: bytes, durable: bool = True) -> Path:
    """Replace `path` with `data` whole (`atomic_path`). Returns `path`."""
    with atomic_path(path, durable) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def write_text_atomic(path: Path | str, text: str, durable: bool = True) -> Path:
    """Replace `path` with `text` (UTF-8) whole (`atomic_path`). Returns `path`."""
    return write_bytes_atomic(path, text.encode("utf-8"), durable)


def begin_step_dir(run_dir: Path | str, step: int, subdirs: Sequence[str] = (MODEL_OPTIM_DIR, RNG_DIR)) -> Path:
    """Create (afresh) `checkpoints/step_<N>.tmp-<pid>/` with `subdirs`; one rank calls it."""
    return _fresh_tmp_dir(checkpoints_root(run_dir), step, subdirs)


def _fresh_tmp_dir(root: Path, step: int, subdirs: Sequence[str] = ()) -> Path:
    """`root/step_<N>.tmp-<pid>/` (with `subdirs`), emptied when it exists."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"{step_dir_name(step)}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    for sub in subdirs:
        (tmp / sub).mkdir(parents=True)
    return tmp


def commit_step_dir(tmp: Path | str, files: Dict[str, str]) -> Path:
    """Write `files` (name -> text) into `tmp`, make it durable, rename it to `step_<N>`,
    point `latest` at it. Returns the final directory. One rank calls it.

    Re-saving a step that exists (after resuming from an older one) swaps the directories
    with one rename each; the older copy is deleted afterwards.
    """
    tmp = Path(tmp)
    for name, text in files.items():
        (tmp / name).write_text(text)
    final = _rename_into_place(tmp)
    write_text_atomic(final.parent / LATEST_FILE, final.name + "\n")
    return final


def _rename_into_place(tmp: Path) -> Path:
    """fsync `step_<N>.tmp-<pid>/` and rename it to `step_<N>/` (an existing one is swapped
    out with one rename and deleted afterwards). Returns the final directory."""
    root = tmp.parent
    final = root / tmp.name.split(".tmp-")[0]
    fsync_tree(tmp)
    if final.exists():
        old = root / f"{final.name}.old-{os.getpid()}"
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    fsync_path(root)
    return final


def prune_checkpoints(run_dir: Path | str, keep_last_k: int, keep_every: int = 0) -> List[Path]:
    """Delete all but the newest `keep_last_k` complete checkpoints, and stale tmp dirs;
    with `keep_every` > 0 (`trainer.keep_every`) every step that is a multiple of it is kept
    too (checkpoints to compare later). The checkpoint `latest` points to is never deleted.
    Returns what was deleted.
    """
    root = checkpoints_root(run_dir)
    complete = list_complete_checkpoints(root)
    latest = find_latest_checkpoint(root)

    def kept_forever(p: Path) -> bool:
        return keep_every > 0 and int(_STEP_DIR.match(p.name).group(1)) % keep_every == 0

    doomed = [p for p in complete[: max(len(complete) - keep_last_k, 0)] if p != latest and not kept_forever(p)]
    doomed += [p for p in root.iterdir() if p.is_dir() and (".tmp-" in p.name or ".old-" in p.name)]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


# --------------------------------------------------------------------------- HF exports


def hf_exports_root(run_dir: Path | str) -> Path:
    """`<run_dir>/hf`, where the running learner's HF exports go."""
    return Path(run_dir) / HF_EXPORTS_DIR


def is_complete_hf_export(path: Path | str) -> bool:
    """A `step_<N>` directory with its index and config.json (only a finished export is
    renamed to that name; `.tmp-` directories never are)."""
    path = Path(path)
    return (bool(_STEP_DIR.match(path.name)) and path.is_dir() and (path / HF_INDEX_FILE).is_file()
            and (path / "config.json").is_file())


def hf_export_step(path: Path | str) -> int:
    """The step of a `step_<N>` directory."""
    return int(_STEP_DIR.match(Path(path).name).group(1))


def list_complete_hf_exports(run_dir: Path | str) -> List[Path]:
    """Complete HF exports of a run, oldest step first."""
    root = hf_exports_root(run_dir)
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if is_complete_hf_export(p)), key=hf_export_step)


def begin_hf_export_dir(run_dir: Path | str, step: int) -> Path:
    """Create (afresh) `hf/step_<N>.tmp-<pid>/`; one rank calls it."""
    return _fresh_tmp_dir(hf_exports_root(run_dir), step)


def commit_hf_export_dir(tmp: Path | str) -> Path:
    """Make a finished export durable and rename it to `hf/step_<N>/`; one rank calls it."""
    return _rename_into_place(Path(tmp))


def prune_hf_exports(run_dir: Path | str, keep: int) -> List[Path]:
    """Delete all but the newest `keep` complete HF exports, and interrupted `.tmp-` /
    `.old-` directories of `step_<N>` exports; nothing else under `hf/` is touched. Returns
    what was deleted."""
    root = hf_exports_root(run_dir)
    if not root.is_dir():
        return []
    complete = list_complete_hf_exports(run_dir)
    doomed = complete[: max(len(complete) - keep, 0)]
    doomed += [p for p in root.iterdir() if p.is_dir() and _PARTIAL_STEP_DIR.match(p.name)]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def directory_bytes(path: Path | str) -> int:
    """Bytes of the files under `path`."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def describe_save_error(error: BaseException, free_bytes: int) -> str:
    """Say "disk full" when it is, even when the writer lost the errno: torch's zip writer
    reports a short write as "enforce fail ... unexpected pos", megatron wraps it again."""
    cause: Optional[BaseException] = error
    for _ in range(20):  # the exception chain, bounded
        if cause is None:
            break
        if isinstance(cause, OSError) and cause.errno == errno.ENOSPC:
            return f"disk full (ENOSPC, {free_bytes} bytes free)"
        cause = cause.__cause__ or cause.__context__
    if free_bytes < (1 << 20):
        return f"disk full (ENOSPC: {free_bytes} bytes free when the write failed): {error!r}"
    return repr(error)
