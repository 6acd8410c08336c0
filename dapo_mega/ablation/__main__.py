"""Helpers the Slurm jobs of `dapo-mega ablate --slurm` run.

    python -m dapo_mega.ablation task-args TASKS.json INDEX   one override per line (array task)
    python -m dapo_mega.ablation report ABLATION_DIR          write ablation.md / .json / .png
"""

from __future__ import annotations

import sys
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) == 3 and argv[0] == "task-args":
        from dapo_mega.ablation.runner import task_arguments

        print("\n".join(task_arguments(argv[1], int(argv[2]))))
        return 0
    if len(argv) == 2 and argv[0] == "report":
        from dapo_mega.ablation.report import write_report
        from dapo_mega.ablation.rungs import AblationPlan

        md, _ = write_report(AblationPlan.load(argv[1]))
        print(md.read_text())
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
