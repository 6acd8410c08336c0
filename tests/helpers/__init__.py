"""Helpers the tests share: running the trainer (training.py), fake checkpoints (checkpoints.py)."""
