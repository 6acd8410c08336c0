"""Shared test settings: CPU only, offline, quiet."""

import os

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Tests mirror the package in subfolders; the shared helpers (dist_helpers, slurm_cluster)
# live here, beside this file.
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true",
                     help="also run the tests marked slow (whole runs killed and resumed, Slurm jobs, the quick "
                          "ablation ladder, TP 2 / PP 2 learners with SGLang): the README's test command and CI do")


import pytest  # noqa: E402
from helpers.parallel import (  # noqa: E402
    CpuTurns,
    is_xdist_worker,
    longest_units_first,
    recorded_seconds,
    ungrouped,
    unit_of,
)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """Without --slow (or a -m of the caller's own, or tests named by id), the tests marked
    slow are deselected. Every test gets its xdist group (its file, or `slurm`), and the
    groups are ordered longest first (helpers/parallel.py)."""
    if not (config.getoption("--slow") or config.getoption("markexpr") or any("::" in a for a in config.args)):
        slow = [item for item in items if item.get_closest_marker("slow") is not None]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if item.get_closest_marker("slow") is None]
    if is_xdist_worker(config):
        for item in items:
            item.add_marker(pytest.mark.xdist_group(unit_of(item)))
        items[:] = longest_units_first(items, recorded_seconds())


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """On the xdist controller: every test must carry its group, or the two-worker rules do not hold."""
    lost = ungrouped(ids) if node.config.getvalue("dist") == "loadgroup" else []
    if lost:
        pytest.exit(f"xdist's --dist loadgroup did not group {len(lost)} tests (e.g. {lost[0]}): pytest "
                    f"{pytest.__version__} with this pytest-xdist loses the group names, so units and the Slurm "
                    "tests would spread over both workers. Install the dev extra's pytest (pip install -e "
                    "'.[dev]' -c constraints-cpu.txt) or run with -n 0", returncode=4)


CPU_TURNS = CpuTurns()
"""This worker's turns at the suite's CPU lock."""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under xdist, each test (with its fixtures' setup and teardown) holds the CPU lock:
    shared, or alone for `@pytest.mark.exclusive` (kept for the worker's next test when that
    one is exclusive too)."""
    if not is_xdist_worker(item.config):
        yield
        return
    exclusive = item.get_closest_marker("exclusive") is not None
    with CPU_TURNS.turn(exclusive, nextitem is not None and nextitem.get_closest_marker("exclusive") is not None):
        yield


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """tiny_models(seed): a tiny HF checkpoint (config, char tokenizer, random weights) of
    that seed, built once per session, for the tests that only read it (serve it, train
    from it, convert it elsewhere)."""
    from dapo_mega.models.tiny import build_tiny_model_dir

    built = {}

    def get(seed: int = 7):
        if seed not in built:
            built[seed] = build_tiny_model_dir(tmp_path_factory.mktemp(f"tiny_model_seed{seed}"), seed=seed)
        return built[seed]
    return get


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_models):
    """The tiny checkpoint of seed 7, for the tests that only need some model."""
    return tiny_models(7)


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """The local two-node Slurm cluster (tests/slurm_cluster.py), started once for every test
    that submits jobs; where it cannot run the test skips saying why (fails under CI)."""
    from slurm_cluster import start_or_skip

    cluster = start_or_skip(tmp_path_factory.mktemp("slurm"))
    yield cluster
    cluster.stop()
