"""The Megatron learner. Before any of its modules imports megatron-core, a machine without
a GPU keeps megatron-core's fusions eager (`cpu_support.keep_fusions_eager`)."""

from dapo_mega.backends.megatron.cpu_support import keep_fusions_eager

keep_fusions_eager()
