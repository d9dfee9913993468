"""What the test modules share (tests/ is on sys.path under pytest, so `from support.probes import free_port`).

- `bench`: a bench/ script loaded as a module, for tests of its helpers.
- `probes`: a free loopback port, waiting for a condition, a Prometheus scrape.
- `tiny_models`: the tiny-model specs the tests use; `conftest.py` builds each once per session.
- `broker`: an in-process broker on free loopback ports that can be stopped and restarted on the same ports.
- `control_plane`: an in-process control plane only (registry + gRPC server + heartbeat monitor) and its clients.
- `daemons`: a `primerl-*` child process started with a ready file and stopped by whoever started it.
- `inference`: HTTP and weight-update helpers for tests that talk to a running `primerl-infer`.
- `proc_tree`: the process tree read from /proc (what a test started, and whether it is gone).
- `run_dirs`: run directories of `primerl rl` runs as they look at their end (finished, stopped, failed, killed).
- `rl_configs`: whole-run config files in each shape, written into a test's directory, and loading them.
- `weight_plane`: the broker's weight plane alone on loopback, its clients, and small updates to send.
- `weight_updates`: tiny updates put straight into a broker's weight fan-out (a policy version, no sockets).
- `policy_updates`: FULL, DELTA and LORA updates of real tensors for the inference side (`PolicyUpdater`).
- `trainer_runs`: a `primerl-trainer` fed by a test: synthetic samples, their batches, its command line and outputs.
- `numerics`: float32 tolerances of runs that differ in summation order (AdamW weights, RL losses), and the
  machine description that numerics failures and the report header print.
"""
