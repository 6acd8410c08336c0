"""Verifier worker process: `python -m dapo_mega.reward.worker <read_fd> <write_fd>`.

Started and killed by `VerifierPool` (scoring.py). Protocol over two pipes, using
multiprocessing.connection framing:

    parent → child: pickled verifier (bytes), then tasks (index, response, ground_truth,
                    metadata), then None to stop
    child → parent: ("ready", None), then (index, (correct, reward, extracted, error, components))

A reward plugin (`algo.verifier=module:function`) is imported here, by its path, when its
verifier is unpickled: before "ready", so its import time is not charged to a task.

Runs the verifier in this process's main thread, so libraries relying on signal.alarm
work; the parent enforces the hard time bound by killing the process.
"""

from __future__ import annotations

import logging
import pickle
import sys
from multiprocessing.connection import Connection

from dapo_mega.reward.types import call_verifier


def serve(recv_conn: Connection, send_conn: Connection) -> None:
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    verifier = pickle.loads(recv_conn.recv_bytes())
    send_conn.send(("ready", None))
    while True:
        try:
            task = recv_conn.recv()
        except (EOFError, OSError):  # the parent went away
            return
        if task is None:
            return
        index, response, ground_truth, metadata = task
        try:
            result = call_verifier(verifier, response, ground_truth, metadata)
            reply = (index, (None if result.correct is None else bool(result.correct), float(result.reward), result.extracted, result.error,
                             tuple(result.components)))
        except BaseException as exc:  # noqa: BLE001 - any failure is a scored verifier_error
            reply = (index, (False, -1.0, None, f"verifier_error: {type(exc).__name__}: {str(exc)[:200]}", ()))
        send_conn.send(reply)


def main(argv: list) -> None:
    read_fd, write_fd = int(argv[1]), int(argv[2])
    serve(Connection(read_fd, writable=False), Connection(write_fd, readable=False))


if __name__ == "__main__":
    main(sys.argv)
