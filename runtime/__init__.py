"""Shared infrastructure of every role and command; imports neither torch nor vLLM, and nothing of primerl outside
this package (``tests/test_layering.py`` holds it).

- addresses and wire: ``addresses`` (which host a daemon binds and which it advertises), ``wire_security``
  (TLS and CURVE credentials read from files);
- threads and advice: ``periodic`` (a thread that runs one callable every interval), ``advice`` (what to add
  when one role waits on another); ``terminal``: the commands' console through ``rich``;
- config: ``config_base`` (the pydantic base every role config extends), ``config_common`` (sections several
  roles share: logging, broker client, W&B, Prometheus), ``config_loader`` (``@ file.toml`` and overrides in,
  TOML out);
- logging: ``log_setup`` (structlog, one set-up);
- metrics: ``metrics_sink`` (writes ``metrics.jsonl``, W&B, Prometheus rows), ``run_metrics`` (the one reader of
  ``metrics.jsonl``), ``run_files`` (the run directory's file names tools read), ``run_outcome`` (how a
  `primerl rl` run ended: ``run_end.json``, written by the launcher, read back by `primerl status` and the
  dashboard), ``prometheus`` (the exporter), ``meters`` (throughput over a sliding window);
- sockets: ``zmq_sockets`` (ROUTER/DEALER factories with the limits set before bind/connect);
- files: ``durable_files`` (crash-safe atomic writes);
- processes: ``cpu_budget`` (each role's thread budget), ``parent_death`` (children that die with their parent),
  ``process_ids`` (whether a pid is alive: leftovers of dead daemons);
- start-up: ``findings`` (what a preflight check found), ``start_gate`` (the orchestrator waits for `primerl rl`'s
  preflight; its environments' report), ``tokenizer_files`` (a model directory's tokenizer without transformers).

Byte units (``MiB``) live in ``primerl.proto.units``, beside the wire code that needs them.
"""
