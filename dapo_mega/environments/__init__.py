"""What a multi-turn rollout talks to (issue #39): tools and environments, and the sandbox that
runs model-written code (`sandbox.py`)."""
