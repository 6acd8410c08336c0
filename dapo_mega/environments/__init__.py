"""What a multi-turn rollout talks to (issues #39, #47): the environment interface and its loader
(`base`), tools with JSON schemas and their call formats (`tool_calls`, the calculator tools
`calculator`), the python tool (`python_tool`), the sandbox that runs model-written code
(`sandbox`, `sandbox_boot`) and its HTTP service (`sandbox_service`), and agents that run their own
loop (`agent`; a verifiers environment as one, `verifiers_env`)."""
