"""Engines: everything that starts, attaches to, watches and talks to an inference engine.

* `fleet`: `EngineFleet`, the one place engines are started, attached to (by URL or
  registry), health-checked, killed and restarted;
* `book`: `EngineBook`, the one record of which engines serve, are dead or rejoin (every
  round, the policy sync and the driver's progress counter read it);
* `process`: one engine process's operating-system plumbing (a /health probe, stopping a
  process, its log tail, the registry file it is announced in);
* `watch`: the Slurm engines role's watch, restarting an engine that exits at its port;
* `sglang/`: SGLang's wire: pinned API tables, an engine's endpoint, the HTTP client, the
  engine and router command lines and what `/server_info` says (nothing there imports sglang);
* `embedded/`: the embedded CPU engine, SGLang's HTTP API over a transformers model, started
  as `python -m dapo_mega.engines.embedded.server`.

What a generation round does with the engines (dispatch, liveness, dynamic sampling) is
`dapo_mega.rollout`.
"""
