#!/bin/bash
# Qwen3-8B DAPO (the 32B recipe scaled down), colocated on 4 nodes x 8 GPUs; the plan
# estimates ~20 min a step, ~103 h for the recipe's 313 rollout steps (18 jobs of 24 h is
# more than it needs: the links after the last step exit at once).
# Topology of this reproduction only; the recipe is configs/experiment/dapo_qwen3_8b.yaml.
#   launch/dapo_qwen3_8b.sh --hf-model DIR --dapo-math FILE --aime FILE --output-dir DIR \
#       [--partition P --account A --container IMAGE --mounts SRC:DST] [--dry-run | --wait] [-- overrides]
# Options given here are defaults: later ones win (--nodes, --chain, --time, ...). launch/README.md
# lists every option and the stages.
exec "${PYTHON:-python}" "$(dirname "$0")/pipeline.py" --experiment dapo_qwen3_8b --nodes 4 --chain 18 --time 24:00:00 "$@"
