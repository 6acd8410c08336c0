#!/bin/bash
# The tiny CPU experiment on a CPU Slurm cluster (the local two-node one of
# tests/slurm_cluster.py): 3 steps, seconds each; the second job of the chain finds the run
# complete. Its --hf-model is a tiny model directory
# (dapo_mega.models.tiny.build_tiny_model_dir), random weights: pass --
# trainer.sft_warmup_steps=0 (or trainer.sft_on_pretrained=true), and --learners-per-node 1
# --sbatch-opt=--mem=4000 on the test cluster.
# Topology of this reproduction only; the recipe is configs/experiment/tiny_cpu_slurm.yaml.
#   launch/tiny_cpu_slurm.sh --hf-model DIR --dapo-math FILE --aime FILE --output-dir DIR \
#       [--partition P --account A --container IMAGE --mounts SRC:DST] [--dry-run | --wait] [-- overrides]
# Options given here are defaults: later ones win (--nodes, --chain, --time, ...). launch/README.md
# lists every option and the stages.
exec "${PYTHON:-python}" "$(dirname "$0")/pipeline.py" --experiment tiny_cpu_slurm --nodes 2 --chain 2 --time 30 "$@"
