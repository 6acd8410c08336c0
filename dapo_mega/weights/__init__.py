"""Megatron ⇄ Hugging Face weights: one mapping, streaming, conversion, live sync.

    mapping.py   the name/shape table and pure tensor transforms (fused QKV, gate/up,
                 TP split/merge, vocab padding)
    stream.py    iter_megatron_to_hf / load_hf_into_megatron over the parallel layout
    hf_io.py     lazy safetensors reader (sharded or single) and sharded writer + index
    convert.py   import / export / verify (tools/convert_checkpoint.py), and
                 export_learner_to_hf for the trainer's start-up HF export
    spawn.py     run a conversion in N local gloo processes
    sync.py      live weight sync to the rollout engines (the formats and checksums on the
                 wire: dapo_mega/wire/)

Submodules import torch/megatron lazily; importing this package is cheap.
"""
