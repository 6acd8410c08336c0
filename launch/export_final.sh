#!/bin/bash
# The pipeline's export stage: the run's final checkpoint (step TOTAL_STEPS) -> an HF
# directory. Refuses, naming both steps, when the training chain ended before the run did
# (its latest checkpoint is short of the last step), so the final evaluation never scores
# an intermediate checkpoint as the result.
#   launch/export_final.sh RUN_DIR TOTAL_STEPS HF_OUT [convert_checkpoint.py export options]
set -euo pipefail
(( $# >= 3 )) || { echo "usage: $0 RUN_DIR TOTAL_STEPS HF_OUT [export options]" >&2; exit 2; }
run_dir=$1 total=$2 hf_out=$3; shift 3
want=$(printf 'step_%06d' "$total")
latest=$(cat "$run_dir/checkpoints/latest" 2>/dev/null || echo "none")
if [[ $latest != "$want" ]]; then
    echo "dapo-mega: run $run_dir is not complete: its latest checkpoint is '$latest', the last step's is $want;" \
         "the training chain ended early (see its logs). Fix: resume it with launch/pipeline.py ... --from train" >&2
    exit 1
fi
exec "${PYTHON:-python}" tools/convert_checkpoint.py export --megatron-path "$run_dir/checkpoints/$want" \
    --hf-path "$hf_out" "$@"
