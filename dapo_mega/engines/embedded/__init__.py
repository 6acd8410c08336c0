"""The embedded CPU engine: the project's own SGLang-compatible HTTP server over a
transformers model, started as `python -m dapo_mega.engines.embedded.server` with
sglang.launch_server's flags (the fleet starts it exactly as it starts SGLang).

* `server.py`: the aiohttp app, its info and generation endpoints, and the command line.
* `control.py`: pause / continue, cache and memory, weight-update groups, sessions and updates.
* `validation.py`: request bodies checked against SGLang 0.5.23's structs, limits and messages.
* `engine.py`: `GenerationEngine`, the queue and the generation thread (continuous batching,
  pause modes, abort).
* `model_runner.py`: `ModelRunner`, the HF model's forward with a KV cache and its weights.
* `flat_weights.py`: the weights laid out flat, flattened buckets received in place.
* `kv_cache.py`: merging and trimming transformers' KV caches for continuous batching.
* `sampling.py`: SGLang's sampler (temperature, top-k, top-p, min-p) and the sequence record.

Nothing here is imported by the fleet or the trainer: they reach the engine over HTTP.
"""
