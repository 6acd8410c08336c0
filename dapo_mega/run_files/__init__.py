"""The run directory's files, read and written without torch or Megatron.

* `checkpoints`: checkpoint and HF-export directories (step_<N>, `latest`, atomic commit,
  keep-K), the trainer state file, and the one atomic write of a file (`atomic_path`,
  `write_text_atomic`) every other writer uses;
* `identity`: what a run is (run.json's id, config.yaml, config_history.jsonl) and the rule a
  resume's config changes pass.

What goes *into* a checkpoint is `dapo_mega/backends/megatron/checkpoint.py`; what a run
writes for a person to read is `dapo_mega/records/`.
"""
