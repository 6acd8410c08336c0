"""SGLang's wire: pinned API tables (`api`), where an engine is (`endpoint`: URL, API key,
timeout), the HTTP client (`client`) and engine / router command lines (`commands`).

Nothing here imports sglang; the GPU engine is a separate process started from argv.
"""
