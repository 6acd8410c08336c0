#!/bin/bash
# Qwen2.5-7B DAPO (the 32B recipe scaled down), colocated on 4 nodes x 8 GPUs; the plan
# estimates ~17 min a step, ~88 h for the recipe's 313 rollout steps: 5 jobs of 24 h.
# Topology of this reproduction only; the recipe is configs/experiment/dapo_qwen2.5_7b.yaml.
#   launch/dapo_qwen2.5_7b.sh --hf-model DIR --dapo-math FILE --aime FILE --output-dir DIR \
#       [--partition P --account A --container IMAGE --mounts SRC:DST] [--dry-run | --wait] [-- overrides]
# Options given here are defaults: later ones win (--nodes, --chain, --time, ...). launch/README.md
# lists every option and the stages.
exec "${PYTHON:-python}" "$(dirname "$0")/pipeline.py" --experiment dapo_qwen2.5_7b --nodes 4 --chain 5 --time 24:00:00 "$@"
