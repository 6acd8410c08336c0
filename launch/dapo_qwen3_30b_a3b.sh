#!/bin/bash
# Qwen3-30B-A3B DAPO (mixture of experts, the 32B recipe at EP 8), colocated on 4 nodes x 8 GPUs;
# the plan estimates ~67 min a step, ~350 h for the recipe's 313 rollout steps: 19 jobs of 24 h
# (25% spare for dynamic-sampling rounds, evaluations, checkpoints and restarts).
# Topology of this reproduction only; the recipe is configs/experiment/dapo_qwen3_30b_a3b.yaml,
# its twin (the same switches at tiny size, on the local Slurm cluster) configs/twin/.
#   launch/dapo_qwen3_30b_a3b.sh --hf-model DIR --dapo-math FILE --aime FILE --output-dir DIR \
#       [--partition P --account A --container IMAGE --mounts SRC:DST] [--dry-run | --wait] [-- overrides]
# Options given here are defaults: later ones win (--nodes, --chain, --time, ...). launch/README.md
# lists every option and the stages.
exec "${PYTHON:-python}" "$(dirname "$0")/pipeline.py" --experiment dapo_qwen3_30b_a3b --nodes 4 --chain 19 --time 24:00:00 "$@"
