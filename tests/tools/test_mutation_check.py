"""The mutation check (tools/mutation_check.py): every mutation in tools/mutations.toml is
caught by the tests it names (slow lane), and its own rules (stale code, the copy imported)."""

import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"
sys.path.insert(0, str(TOOLS))
import mutation_check  # noqa: E402


def test_the_list_parses_and_each_mutation_applies_once_to_todays_code():
    mutations = mutation_check.load_mutations(mutation_check.DEFAULT_LIST)
    assert len(mutations) >= 10
    for m in mutations:
        text = (mutation_check.REPO / m.file).read_text()
        assert text.count(m.old) == 1, f"{m.name}: stale, its code is not in {m.file} exactly once"
        assert m.old != m.new and m.tests


def test_stale_code_and_duplicate_names_are_refused(tmp_path):
    (tmp_path / "f.py").write_text("x = 1\n")
    m = mutation_check.Mutation("m", "claim", "f.py", "y = 2", "y = 3", ("t",))
    with pytest.raises(LookupError, match="0 times"):
        mutation_check.apply(tmp_path, m)
    listed = tmp_path / "list.toml"
    entry = '[[mutation]]\nname = "a"\nclaim = "c"\nfile = "f.py"\nold = "x"\nnew = "y"\ntests = ["t"]\n'
    listed.write_text(entry + entry)
    with pytest.raises(ValueError, match="duplicate"):
        mutation_check.load_mutations(listed)


@pytest.mark.slow
def test_every_mutation_is_caught():
    """~3 min: each mutation alone in a copy of the project, its tests run there (the tests
    run unmutated in the everyday lane, so the baseline run is skipped here)."""
    out = subprocess.run([sys.executable, str(TOOLS / "mutation_check.py"), "--no-baseline"], capture_output=True,
                         text=True, timeout=1500)
    n = len(mutation_check.load_mutations(mutation_check.DEFAULT_LIST))
    assert out.returncode == 0 and f"{n} of {n} mutations caught" in out.stdout, out.stdout[-3000:] + out.stderr[-2000:]
