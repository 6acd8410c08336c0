"""What travels between the learners and the engines, as both sides read it.

* `transport`: the formats a weight bucket takes (a flattened bucket over a process group,
  shared memory, CUDA IPC handles, SGLang's serialized tensors), their dtypes, and the
  weight-update group itself (init / destroy / abort);
* `checksum`: the digests an engine reports of the weights it holds and the learner computes
  of what it sent (SHA-256, or SGLang's CPU/GPU hash).

The learner's side (dapo_mega/weights/) and the engines' (dapo_mega/engines/embedded/) both
import it; it imports neither.
"""
