"""Mutation check: the tests behind the README's claims fail when the code they guard breaks.

For each mutation in tools/mutations.toml (a file, one exact piece of its code, its
replacement, the tests that must fail), this copies the project's tracked files into a
scratch directory once, runs the union of the named tests there unmutated (they must pass:
otherwise a failure proves nothing), then applies each mutation alone and runs its tests.
A mutation is `caught` when its tests fail, `missed` when they pass, `stale` when its code
is no longer in the file (the list must follow the code). Exit 0 only when every mutation
is caught.

    python tools/mutation_check.py [--only NAME,...] [--no-baseline] [--list tools/mutations.toml]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Sequence

REPO = Path(__file__).resolve().parents[1]
DEFAULT_LIST = REPO / "tools" / "mutations.toml"
TEST_TIMEOUT_S = 900
"""Bound on one pytest run (a mutation that hangs a test counts as caught only by failing)."""


@dataclass(frozen=True)
class Mutation:
    name: str
    claim: str
    file: str
    old: str
    new: str
    tests: tuple

    @classmethod
    def from_dict(cls, d: Dict) -> "Mutation":
        missing = {"name", "claim", "file", "old", "new", "tests"} - set(d)
        if missing:
            raise ValueError(f"mutation {d.get('name', '?')}: missing {sorted(missing)}")
        return cls(d["name"], d["claim"], d["file"], d["old"], d["new"], tuple(d["tests"]))


def load_mutations(path: Path) -> List[Mutation]:
    mutations = [Mutation.from_dict(d) for d in tomllib.loads(path.read_text())["mutation"]]
    names = [m.name for m in mutations]
    if len(set(names)) != len(names):
        raise ValueError(f"{path}: duplicate mutation names in {names}")
    return mutations


def copy_project(dest: Path) -> None:
    """The tracked files (and untracked, not ignored ones) of the checkout, into `dest`."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=REPO,
                            check=True, capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = REPO / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def run_tests(root: Path, tests: Sequence[str]) -> subprocess.CompletedProcess:
    """pytest on `tests` in the copy, importing the copy's package (PYTHONPATH first, and
    the check below makes sure)."""
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    probe = subprocess.run([sys.executable, "-c", "import dapo_mega; print(dapo_mega.__file__)"], cwd=root, env=env,
                           capture_output=True, text=True, check=True).stdout.strip()
    if not Path(probe).resolve().is_relative_to(root.resolve()):
        raise RuntimeError(f"the copy at {root} imports dapo_mega from {probe}: mutations would not be tested")
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests], cwd=root,
                          env=env, capture_output=True, text=True, timeout=TEST_TIMEOUT_S)


def apply(root: Path, m: Mutation) -> str:
    """Apply `m` in the copy; returns the original text (or raises LookupError: stale)."""
    path = root / m.file
    text = path.read_text()
    if text.count(m.old) != 1:
        raise LookupError(f"{m.file}: the mutated code occurs {text.count(m.old)} times (must be once)")
    path.write_text(text.replace(m.old, m.new))
    return text


def check(mutations: Sequence[Mutation], baseline: bool = True) -> Dict[str, str]:
    """{name: caught | missed | stale: why}; raises when the unmutated tests fail (not run
    without `baseline`: where the same tests run unmutated elsewhere, as in CI)."""
    results: Dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="dapo_mutations_") as tmp:
        root = Path(tmp)
        copy_project(root)
        union = sorted({t for m in mutations for t in m.tests})
        t0 = time.monotonic()
        base = run_tests(root, union) if baseline else None
        if base is not None and base.returncode != 0:
            raise RuntimeError(f"the tests fail unmutated (exit {base.returncode}); fix them first:\n"
                               + base.stdout[-3000:] + base.stderr[-2000:])
        if base is not None:
            print(f"unmutated: {len(union)} test targets pass ({time.monotonic() - t0:.0f} s)", flush=True)
        for m in mutations:
            t0 = time.monotonic()
            try:
                original = apply(root, m)
            except LookupError as exc:
                results[m.name] = f"stale: {exc}"
            else:
                try:
                    out = run_tests(root, m.tests)
                    results[m.name] = "caught" if out.returncode != 0 else "missed"
                except subprocess.TimeoutExpired:
                    results[m.name] = "caught (timed out)"
                finally:
                    (root / m.file).write_text(original)
            print(f"{m.name:28s} {results[m.name]:10s} {time.monotonic() - t0:5.0f} s  {m.claim}", flush=True)
    return results


def main(argv: Sequence[str] = ()) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--list", type=Path, default=DEFAULT_LIST)
    ap.add_argument("--only", default="", help="comma-separated mutation names")
    ap.add_argument("--no-baseline", action="store_true",
                    help="skip the unmutated run of the tests (when they run unmutated elsewhere, e.g. CI)")
    args = ap.parse_args(list(argv))
    mutations = load_mutations(args.list)
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - {m.name for m in mutations}
        if unknown:
            ap.error(f"--only: no mutation named {sorted(unknown)} in {args.list}")
        mutations = [m for m in mutations if m.name in wanted]
    results = check(mutations, baseline=not args.no_baseline)
    bad = {k: v for k, v in results.items() if not v.startswith("caught")}
    print(f"{len(results) - len(bad)} of {len(results)} mutations caught" + (f"; not caught: {bad}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
