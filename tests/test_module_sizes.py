"""The house's size limits, read with `ast` (nothing imported): no module under
`dapo_mega/rollout/` or `dapo_mega/engines/` over 400 lines (the fleet and the embedded engine
moved from rollout/ to engines/, and the limit went with them), no function or method in
`dapo_mega/` over 100 lines. A failure names each offender with its length."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "dapo_mega"
MAX_ROLLOUT_MODULE_LINES = 400
MAX_FUNCTION_LINES = 100


def test_no_rollout_or_engine_module_is_over_400_lines():
    long = {str(p.relative_to(ROOT.parent)): n for folder in ("rollout", "engines")
            for p in sorted((ROOT / folder).rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_ROLLOUT_MODULE_LINES}
    assert not long, f"modules over {MAX_ROLLOUT_MODULE_LINES} lines: {long}"


def test_no_function_is_over_100_lines():
    long = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} {node.name} ({length} lines)")
    assert not long, "functions over 100 lines:\n" + "\n".join(long)
