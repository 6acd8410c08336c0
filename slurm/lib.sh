# Shared functions of slurm/colocated.sbatch and slurm/disaggregated.sbatch.
# Sourced by the batch script (runs on the first node of the allocation, outside any
# container); everything heavy runs in srun steps.

# The address other nodes reach NODE at: its Slurm NodeAddr (falls back to the name).
node_addr() {
    local addr
    addr=$(scontrol show node "$1" -o 2>/dev/null | sed -n 's/.*NodeAddr=\([^ ]*\).*/\1/p')
    echo "${addr:-$1}"
}

# "n1=10.0.0.1,n2=10.0.0.2" for every node of the given node lists (engines advertise it).
node_addr_map() {
    local list host out=""
    for list in "$@"; do
        for host in $(scontrol show hostnames "$list"); do
            out+="${out:+,}${host}=$(node_addr "$host")"
        done
    done
    echo "$out"
}

# Pyxis/enroot flags for every srun when CONTAINER is set (MOUNTS: src:dst[,src:dst]).
container_args() {
    CONTAINER_ARGS=()
    if [[ -n "${CONTAINER:-}" ]]; then
        CONTAINER_ARGS+=(--container-image="$CONTAINER" --container-workdir="$REPO_DIR")
        [[ -n "${MOUNTS:-}" ]] && CONTAINER_ARGS+=(--container-mounts="$MOUNTS")
    fi
    return 0
}

# The last lines of a role's logs: the files that mention an error first, else rank 0.
show_role_error() {
    local role=$1 files
    files=$(grep -l -E 'Traceback|Error|error' "$LOG_DIR/$role"-*.log 2>/dev/null | head -n 4)
    [[ -z "$files" ]] && files=$(ls "$LOG_DIR/$role"-*.log 2>/dev/null | head -n 1)
    for f in $files; do
        echo "----- last lines of $f"
        tail -n 30 "$f"
    done
}

# Stop srun steps by the pid of their srun: SIGTERM (srun forwards it to every task),
# then SIGKILL after a grace period.
stop_steps() {
    local pid deadline
    for pid in "$@"; do kill -TERM "$pid" 2>/dev/null || true; done
    deadline=$((SECONDS + ${STOP_GRACE_S:-30}))
    for pid in "$@"; do
        while kill -0 "$pid" 2>/dev/null && (( SECONDS < deadline )); do sleep 1; done
        kill -KILL "$pid" 2>/dev/null || true
    done
    wait "$@" 2>/dev/null || true
}

# The learners' exit status after a stop signal: checkpointed, run again to resume
# (dapo_mega/driver/stop_signal.py EXIT_STOPPED).
EXIT_STOPPED=75

# catch_stop_signals (at the start of the batch script), then forward_stop_signals
# LEARNER_PID once the learner step runs: SIGUSR1 (Slurm's warning ahead of the time limit,
# `#SBATCH --signal=B:USR1@<s>`; or `scancel -s USR1 -b`) or SIGTERM to this batch script is
# passed to the learner step as SIGUSR1 (srun forwards it to every task): the trainer saves a
# checkpoint at the end of its step and exits EXIT_STOPPED. The engines are left running
# until then (the step may still need them). A second SIGTERM stops every role at once. A
# signal before the learners start is logged only: the trainer's wall-time limit (the job's
# time left) already stops it in time, and a trainer not yet started would die of it.
catch_stop_signals() {
    STOP_SIGNAL="" STOP_FORWARDED="" STOP_LEARNER_PID=""
    trap 'on_stop_signal USR1' USR1
    trap 'on_stop_signal TERM' TERM
}
forward_stop_signals() {
    STOP_LEARNER_PID=$1
}
on_stop_signal() {
    if [[ -z $STOP_LEARNER_PID ]]; then
        echo "dapo-mega: SIG$1 received before the learners started; their wall-time limit stops them in time"
        return 0
    fi
    if [[ $1 == TERM && -n $STOP_FORWARDED ]]; then
        STOP_SIGNAL=TERM-again
        return 0
    fi
    STOP_SIGNAL=$1 STOP_FORWARDED=$1
    echo "dapo-mega: SIG$1 received; the learners save a checkpoint at the end of their step and stop" \
         "(exit $EXIT_STOPPED: the next job of the chain resumes)"
    kill -USR1 "$STOP_LEARNER_PID" 2>/dev/null || true
}

# wait_roles learner PID engine PID ...: returns when the learner role ends. The learner
# ending with 0 is success (engines are then stopped); the learner ending with
# EXIT_STOPPED after a forwarded stop signal stops the engines and ends the job with
# EXIT_STOPPED; any role ending otherwise (an engine step ending at all, or the learner
# failing) stops the rest and fails the job with that role's status and the tail of its log.
wait_roles() {
    local -A role_of=()
    local pids=() done_pid rc role others
    while (( $# )); do role_of[$2]=$1; pids+=("$2"); shift 2; done
    while true; do
        unset done_pid
        set +e
        wait -n -p done_pid "${pids[@]}"
        rc=$?
        set -e
        [[ -n "${done_pid:-}" ]] && break
        if [[ -n "${STOP_SIGNAL:-}" && $STOP_SIGNAL != TERM-again ]]; then  # forwarded: wait for the checkpoint
            STOP_SIGNAL=""
            continue
        fi
        # interrupted by a signal (scancel, time limit, SIGTERM twice)
        echo "dapo-mega: batch script interrupted (status $rc); stopping all roles"
        stop_steps "${pids[@]}"
        exit "$rc"
    done
    role=${role_of[$done_pid]}
    others=()
    for pid in "${pids[@]}"; do [[ $pid != "$done_pid" ]] && others+=("$pid"); done
    if [[ $role == learner && $rc == 0 ]]; then
        echo "dapo-mega: learners finished; stopping the engines"
        STOP_GRACE_S=10 stop_steps "${others[@]}"
        return 0
    fi
    if [[ $role == learner && $rc == "$EXIT_STOPPED" ]]; then
        echo "dapo-mega: learners saved a checkpoint and stopped on a signal (${STOP_FORWARDED:-from Slurm});" \
             "stopping the engines; run again (the next job of the chain) to resume"
        STOP_GRACE_S=10 stop_steps "${others[@]}"
        exit "$EXIT_STOPPED"
    fi
    (( rc == 0 )) && rc=1  # engines never end on their own while the learners run
    echo "dapo-mega: role '$role' exited with status $rc; stopping the other roles and failing the job"
    show_role_error "$role"
    STOP_GRACE_S=20 stop_steps "${others[@]}"
    exit "$rc"
}
