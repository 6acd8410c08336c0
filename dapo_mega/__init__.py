"""dapo-mega: DAPO reinforcement learning of LLMs with Megatron-core learners and SGLang
rollout engines. `import dapo_mega` needs neither a GPU nor Transformer Engine nor SGLang.
"""

__version__ = "0.1.0"
