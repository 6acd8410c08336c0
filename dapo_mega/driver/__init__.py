"""The driver's components: each owns one concept and hands the next a typed record.

    rollouts.py    RolloutSource: prompts -> encode -> generate -> score -> filter -> a
                   RolloutBatch of ScoredSamples; AsyncRollouts: the same source on its own
                   thread (disaggregated, max_staleness > 0)
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
    console.py     known library warnings off the console, recorded once in the run's log

`dapo_mega/session.py` wires them (process groups, learner, engines) and
`dapo_mega/trainer.py` is the loop over them.
"""
