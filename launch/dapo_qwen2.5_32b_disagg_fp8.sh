#!/bin/bash
# Qwen2.5-32B DAPO, disaggregated, FP8 learners: 8 learner nodes : 8 engine nodes, 11 jobs of
# 24 h, as the bf16 run (the plan estimates its step alike).
# Topology of this reproduction only; the recipe is configs/experiment/dapo_qwen2.5_32b_disagg_fp8.yaml.
#   launch/dapo_qwen2.5_32b_disagg_fp8.sh --hf-model DIR --dapo-math FILE --aime FILE --output-dir DIR \
#       [--partition P --account A --container IMAGE --mounts SRC:DST] [--dry-run | --wait] [-- overrides]
# Options given here are defaults: later ones win (--nodes, --chain, --time, ...). launch/README.md
# lists every option and the stages.
exec "${PYTHON:-python}" "$(dirname "$0")/pipeline.py" --experiment dapo_qwen2.5_32b_disagg_fp8 --nodes 8 --engine-nodes 8 --chain 11 --time 24:00:00 "$@"
