"""`dapo-mega train` with its weight sync broken on purpose: the defects the weight checks
(dapo_mega/driver/weight_probe.py) must catch.

    python tests/helpers/broken_sync.py FAULT [train overrides...]

FAULT (each patches the learner process's `WeightSyncer`, shared-memory CPU sync of the
colocated default; nothing in the package knows about it):
    skip_bucket    the first bucket of every sync never reaches the engines (buckets of 64 KiB)
    wrong_dtype    the MLP down projections travel as bf16 bytes declared float16
    stale_engine   the last engine is left out of every sync (it keeps its start-up weights)
    stale_weights  the last engine gets only the last bucket of each sync (buckets of 64 KiB),
                   which carries the weight version: it reports the new version and keeps the
                   previous weights of every other tensor
"""

from __future__ import annotations

import sys

import torch

from dapo_mega.weights import sync

FAULTS = ("skip_bucket", "wrong_dtype", "stale_engine", "stale_weights")
SMALL_BUCKET_BYTES = 64 << 10


def _skip_first_bucket() -> None:
    original = sync.iter_buckets

    def iter_buckets(named_tensors, bucket_bytes):
        for k, (bucket, is_last) in enumerate(original(named_tensors, SMALL_BUCKET_BYTES)):
            if k == 0 and not is_last:  # the last bucket carries the weight version: keep it
                continue
            yield bucket, is_last

    sync.iter_buckets = iter_buckets


def _wrong_dtype() -> None:
    original = sync.WeightSyncer.sync

    def broken(self, named_tensors, weight_version, *args, **kwargs):
        def stream():
            for name, tensor in named_tensors:
                if name.endswith("mlp.down_proj.weight"):
                    tensor = tensor.to(torch.bfloat16).view(torch.float16)  # same bytes, the wrong type
                yield name, tensor
        return original(self, stream(), weight_version, *args, **kwargs)

    sync.WeightSyncer.sync = broken


def _stale_engine() -> None:
    original = sync.WeightSyncer.sync

    def broken(self, *args, **kwargs):
        clients = self.clients
        self.clients = clients[:-1]
        try:
            return original(self, *args, **kwargs)
        finally:
            self.clients = clients

    sync.WeightSyncer.sync = broken


def _stale_weights() -> None:
    original_buckets, original_send = sync.iter_buckets, sync.WeightSyncer._send_bucket_colocated
    sync.iter_buckets = lambda named_tensors, bucket_bytes: original_buckets(named_tensors, SMALL_BUCKET_BYTES)

    def send(self, bucket, version):
        clients = self.clients
        if version is None and len(clients) > 1:  # not the version's bucket: the last engine misses it
            self.clients = clients[:-1]
        try:
            return original_send(self, bucket, version)
        finally:
            self.clients = clients

    sync.WeightSyncer._send_bucket_colocated = send


def main(argv: list) -> int:
    fault, overrides = argv[0], argv[1:]
    {"skip_bucket": _skip_first_bucket, "wrong_dtype": _wrong_dtype, "stale_engine": _stale_engine,
     "stale_weights": _stale_weights}[fault]()
    from dapo_mega.cli import main as cli_main

    return cli_main(["train", *overrides])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
