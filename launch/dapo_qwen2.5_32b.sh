#!/bin/bash
# Qwen2.5-32B DAPO, colocated on 16 nodes x 8 GPUs; the plan estimates ~22 min a step, ~117 h
# for the recipe's 313 rollout steps: 7 jobs of 24 h = 168 h (~40% spare for dynamic-sampling
# rounds, evaluations, checkpoints and restarts).
# Topology of this reproduction only; the recipe is configs/experiment/dapo_qwen2.5_32b.yaml.
#   launch/dapo_qwen2.5_32b.sh --hf-model DIR --dapo-math FILE --aime FILE --output-dir DIR \
#       [--partition P --account A --container IMAGE --mounts SRC:DST] [--dry-run | --wait] [-- overrides]
# Options given here are defaults: later ones win (--nodes, --chain, --time, ...). launch/README.md
# lists every option and the stages.
exec "${PYTHON:-python}" "$(dirname "$0")/pipeline.py" --experiment dapo_qwen2.5_32b --nodes 16 --chain 7 --time 24:00:00 "$@"
