"""SGLang backend: pinned API tables (`api`), where an engine is (`endpoint`: URL, API key,
timeout), the HTTP client (`client`) and engine / router command lines (`launch`).

Nothing here imports sglang; the GPU engine is a separate process started from argv.
"""
