"""What a run writes for a person to read, and reads back.

* `metrics`: `metrics.jsonl`, one row per step (read, cut back on resume);
* `console`: the fixed-format step line rank 0 prints;
* `curves`: `curves.png`, redrawn at most once a minute (`trainer.plot_interval_s`);
* `recorder`: `RunRecorder`, which writes the three above (and wandb) per step;
* `ledger`: the rollout ledger, one Parquet shard per step, one row per sample;
* `ledger_report`: the diagnostics read back from the ledger (`tools/ledger_report.py`).
* `resources`: `PhaseMeter`, the resource envelope of a step (each phase's seconds and peak
  memory: the `time/*` and `mem/*` keys of its metrics row).
"""
