#!/bin/bash
# Submit N jobs of one run, each starting after the previous one ends (any state), so a
# long run proceeds through wall-time-limited jobs; each job resumes from the latest
# checkpoint of the run directory.
#   slurm/chain.sh N SCRIPT [sbatch options] -- [Hydra overrides]
set -euo pipefail
(( $# >= 2 )) || { echo "usage: $0 N SCRIPT [sbatch options] -- [overrides]" >&2; exit 2; }
count=$1 script=$2; shift 2
sbatch_opts=()
while (( $# )) && [[ $1 != -- ]]; do sbatch_opts+=("$1"); shift; done
(( $# )) && shift
prev=""
for ((i = 1; i <= count; i++)); do
    dep=()
    [[ -n $prev ]] && dep=(--dependency="afterany:$prev")
    prev=$(sbatch --parsable "${dep[@]}" "${sbatch_opts[@]}" "$script" "$@")
    prev=${prev%%;*}
    echo "submitted job $prev ($i/$count)"
done
