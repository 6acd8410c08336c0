"""How the learner ranks of `dapo-mega train` come to exist.

Three ways: `cluster.num_learner_processes > 1` on one machine (torchrun started here, each
rank runs `python -m dapo_mega.trainer --config RUN_DIR/config.yaml`); Slurm (srun starts one
task per GPU and `dapo_mega.launch` sets RANK / WORLD_SIZE / MASTER_*); or a single process
started by hand, which gets an env:// rendezvous of its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Optional

from dapo_mega import log
from dapo_mega.config import DapoConfig, validate_config
from dapo_mega.distributed import learner_process_env
from dapo_mega.run_files.identity import CONFIG_FILE, RUN_ID_ENV, settle_run_dir

logger = log.get(__name__)


def maybe_spawn_learners(cfg: DapoConfig) -> Optional[int]:
    """Start `cluster.num_learner_processes` ranks with torchrun when not already a rank.

    Returns their exit code, or None when this process should train itself (one learner,
    or already launched by torchrun / srun).
    """
    n = cfg.cluster.num_learner_processes
    if n <= 1 or "RANK" in os.environ:
        return None
    validate_config(cfg, world_size=n)
    identity = settle_run_dir(cfg)  # a refused resume stops here; the ranks inherit the run's id
    if identity.changes:
        logger.info(identity.start_line(cfg.run_dir))
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
            "-m", "dapo_mega.trainer", "--config", str(cfg.run_dir / CONFIG_FILE)]
    env = {**learner_process_env(os.environ), RUN_ID_ENV: identity.run_id}  # torchrun passes them on
    return subprocess.call(argv, env=env)


def init_world_env() -> int:
    """A single process started by hand: make env:// work. Returns the world size.

    MASTER_PORT 0: the only rank hosts the store on a port the OS gives it as it binds (a port
    found free first can be taken by another process before the bind: EADDRINUSE, seen in CI).
    """
    if "RANK" not in os.environ:
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"})
    return int(os.environ["WORLD_SIZE"])
