"""The driver's components: each owns one concept and hands the next a typed record.

    advantages.py  the advantage step: kept groups -> TrainSamples (glue over dapo_mega.algo)
    run_state.py   TrainerState and RunState: counters, resume and save of the trainer's
                   state, ledger shards, pruning of records after a resume
    roles.py       rank roles: DriverRole (global rank 0: data, rollouts, ledger, records,
                   evaluation) and LearnerRankRole (every other learner rank: does nothing,
                   or receives what the driver broadcasts), so call sites never test the rank
    policy_sync.py PolicySync: this rank's part in pushing weights to the engines (weight-
                   update group, shared memory, or the colocated CUDA-IPC hand-over), dead
                   engines dropped, engine memory released and resumed around a step
    learner_ranks.py  how learner ranks come to exist (torchrun here, Slurm, or by hand)
    known_warnings.py  known library warnings off the console, recorded once in the run's log
    eval_beside.py held-out evaluation beside the next step (eval.overlap)
    expert_handover.py  the routed-expert reports a step's DP ranks train on, shard by shard
    gate.py        DriverGate: where the other ranks wait on the driver (the store)
    stop_signal.py SIGUSR1 / SIGTERM: a clean stop with a checkpoint, exit 75
    weight_probe.py  whether the engines serve the learner's weights: the probe, the step's
                   mismatch and the checksums, checked against their limits

The rollout source they draw each step's batch from is the rollout wing's
(`dapo_mega/rollout/source.py`). `dapo_mega/session.py` wires them (process groups, learner, engines) and
`dapo_mega/trainer.py` is the loop over them.
"""
