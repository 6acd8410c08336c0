"""SGLang's wire: pinned API tables (`api`), where an engine is (`endpoint`: URL, API key,
timeout), the HTTP client (`client`), engine / router command lines (`commands`) and what an
engine's `GET /server_info` says (`server_info`).

Nothing here imports sglang; the GPU engine is a separate process started from argv.
"""
