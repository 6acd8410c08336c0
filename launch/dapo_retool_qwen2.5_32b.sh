#!/bin/bash
# Qwen2.5-32B DAPO with the python tool (ReTool-style multi-turn), colocated on 16 nodes x 8 GPUs;
# the plan estimates ~23 min a step with the tools' time, ~117 h for 313 rollout steps: 7 jobs of
# 24 h. The sandbox requires full isolation on the driver's node (rollout.environment_kwargs.isolation;
# docs/multi_turn.md says what a node needs). Start from a tool-use SFT checkpoint (--hf-model).
# Topology of this reproduction only; the recipe is configs/experiment/dapo_retool_qwen2.5_32b.yaml,
# its twin configs/twin/.
#   launch/dapo_retool_qwen2.5_32b.sh --hf-model DIR --dapo-math FILE --aime FILE --output-dir DIR \
#       [--partition P --account A --container IMAGE --mounts SRC:DST] [--dry-run | --wait] [-- overrides]
exec "${PYTHON:-python}" "$(dirname "$0")/pipeline.py" --experiment dapo_retool_qwen2.5_32b --nodes 16 --chain 7 --time 24:00:00 "$@"
