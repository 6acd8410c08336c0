"""Megatron ⇄ Hugging Face weights: one mapping, streaming, conversion, live sync.

    mapping.py   the name/shape table and pure tensor transforms (fused QKV, gate/up,
                 TP split/merge, vocab padding)
    stream.py    iter_megatron_to_hf / load_hf_into_megatron over the parallel layout
    hf_io.py     lazy safetensors reader (sharded or single) and sharded writer + index
    convert.py   import / export (tools/convert_checkpoint.py), and export_learner_to_hf
                 for the trainer's start-up HF export
    verify.py    verify: a conversion held to transformers' logits
    spawn.py     N local ranks (gloo on CPUs, or GPUs) from a forkserver: conversion, verify,
                 tests and benchmarks
    sync.py      live weight sync to the rollout engines (the formats and checksums on the
                 wire: dapo_mega/wire/)
    handover.py  the colocated hand-over over CUDA IPC
    engine_memory.py  which colocated engines hold their memory (the driver's release /
                 resume ledger)

Megatron is imported lazily; importing this package itself is cheap.
"""
