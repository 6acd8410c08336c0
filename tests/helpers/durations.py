"""Write tests/durations.json (test file -> seconds) from a run's JUnit XML, for the order in
which the two-worker suite hands out its files (helpers/parallel.py).

    python -m pytest -q --slow -n 2 --junitxml=run.xml && (cd tests && python -m helpers.durations ../run.xml)

A JUnit test case's time is its setup, call and teardown, so a file's module fixtures count.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from typing import Dict

from helpers.parallel import DURATIONS


def file_seconds(junit_xml: str) -> Dict[str, float]:
    """Test file (relative to tests/) -> summed seconds of its test cases."""
    out: Dict[str, float] = defaultdict(float)
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        module = case.get("classname", "")
        # classname: tests.pkg.test_file[.Class]; the file is the part up to the test_ module
        parts = module.split(".")
        cut = next((i for i, p in enumerate(parts) if p.startswith("test_")), len(parts) - 1)
        path = "/".join(parts[1:cut + 1] if parts[0] == "tests" else parts[:cut + 1]) + ".py"
        out[path] += float(case.get("time", 0.0))
    return dict(out)


def main(argv) -> int:
    if len(argv) != 2:
        print("usage: python -m helpers.durations JUNIT_XML", file=sys.stderr)
        return 2
    seconds = {k: round(v, 1) for k, v in sorted(file_seconds(argv[1]).items())}
    DURATIONS.write_text(json.dumps(seconds, indent=1) + "\n")
    print(f"wrote {DURATIONS}: {len(seconds)} files, {sum(seconds.values()) / 60:.1f} min in all")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
