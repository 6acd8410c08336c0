"""`run_files.checkpoints.atomic_path` is the one temp-then-rename of a file: whole or untouched, no leftovers.

The files are read back with the libraries that read them in a run (pyarrow, matplotlib's
PNG reader, json); a last test walks the package's source and names any other
`os.replace`/`os.rename` of a file, so a second copy of the concept cannot creep back.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from dapo_mega.run_files.checkpoints import atomic_path, write_bytes_atomic, write_text_atomic

PACKAGE = Path(__file__).resolve().parents[2] / "dapo_mega"

RENAMES_OF_OTHER_THINGS = {
    "run_files/checkpoints.py": "the owner, and step directories renamed into place",
    "weights/hf_io.py": "safetensors shards renamed to their final count",
    "models/tiny.py": "a built model directory",
    "run_files/identity.py": "an old config.yaml moved aside, not written",
}


def test_text_and_bytes_replace_whole_and_leave_nothing_else(tmp_path):
    path = tmp_path / "state.json"
    path.write_text("old")
    assert write_text_atomic(path, json.dumps({"step": 3, "name": "ß"})) == path
    assert json.loads(path.read_text(encoding="utf-8")) == {"step": 3, "name": "ß"}
    write_bytes_atomic(path, b"\x00\x01\xff", durable=False)
    assert path.read_bytes() == b"\x00\x01\xff"
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_an_error_mid_write_leaves_the_old_file_and_no_temp(tmp_path):
    path = tmp_path / "ablation.md"
    path.write_text("the old report")
    with pytest.raises(RuntimeError, match="disk full"):
        with atomic_path(path) as tmp:
            tmp.write_text("half of the new")
            raise RuntimeError("disk full")
    assert path.read_text() == "the old report"
    assert [p.name for p in tmp_path.iterdir()] == ["ablation.md"]


def test_writers_that_need_a_path_parquet_and_png(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.table({"step": [1, 2], "text": ["a", "b"]})
    with atomic_path(tmp_path / "step_000001.parquet") as tmp:
        pq.write_table(table, tmp)
    assert pq.read_table(tmp_path / "step_000001.parquet").equals(table)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1, 1))
    ax.plot([0, 1], [0, 1])
    with atomic_path(tmp_path / "curves.png", durable=False) as tmp:
        fig.savefig(tmp, dpi=20, format="png")  # the temp name ends in .tmp-*, not .png
    plt.close(fig)
    assert plt.imread(tmp_path / "curves.png").shape[:2] == (20, 20)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curves.png", "step_000001.parquet"]


def _renames(path: Path):
    """Lines of `os.replace(...)`, `os.rename(...)` and `<path>.replace/.rename(a)` calls."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            base = node.func.value
            is_os = isinstance(base, ast.Name) and base.id == "os" and node.func.attr in ("replace", "rename")
            # str.replace takes two arguments; Path.replace / Path.rename take one
            is_path = node.func.attr in ("replace", "rename") and len(node.args) == 1 and not node.keywords
            if is_os or is_path:
                yield node.lineno


def test_no_other_module_renames_a_temp_file_into_place():
    found = [f"dapo_mega/{path.relative_to(PACKAGE)}:{line}" for path in sorted(PACKAGE.rglob("*.py"))
             if str(path.relative_to(PACKAGE)) not in RENAMES_OF_OTHER_THINGS for line in _renames(path)]
    assert not found, ("write files through dapo_mega.run_files.checkpoints.atomic_path / write_text_atomic / "
                       f"write_bytes_atomic, not a rename of your own: {found}")
