"""Diagnostics of a run from its rollout ledger: group rates, lengths, truncation, verifier
exceptions, age buckets, reject reasons, and high-reward responses to read for exploits.

    python tools/ledger_report.py outputs/tiny_cpu [--steps A:B] [--out DIR]

It streams the shards of the steps asked for (`--steps 100:200`, both ends included; all
by default) one at a time, so a 32B run's ledger is read in bounded memory.

The logic lives in `dapo_mega/records/ledger_report.py` (importable, tested); this is its CLI.
"""

import sys

from dapo_mega.records.ledger_report import main

if __name__ == "__main__":
    sys.exit(main())
