"""The filesystem hand-off of a FULL weight update (prime-rl's default transport), timed as bench part e needs it.

The trainer side writes the serving-dtype state dict (``hf_state_dict``: the tensors a FULL publish sends, cast
to the serving dtype where the model's differs) with ``safetensors.torch.save_file`` into a fresh directory,
then marks it with an empty ``STABLE`` file (prime-rl's "this step is complete" marker); the inference side
loads that directory into a running vLLM engine with
``collective_rpc("reload_weights", kwargs={"weights_path": dir})`` followed by ``reset_prefix_cache()``.

The engine is a ``vllm.LLM`` in a process of its own (spawned here), made by ``create_llm`` from the
``EngineOptions`` that ``primerl-infer`` derives from the same ``InferenceConfig`` (``inference.server.
engine_options``: dtype, max_model_len, LoRA, KV cache, worker extension; the engine core in its own process, as
in the daemon). It is not the daemon's engine itself: ``primerl-infer`` serves no route that could trigger a
reload from a path (its development-mode routes are removed), so the hand-off runs on a twin engine, started
after the daemon of the same model stopped (one ~1B model's worth of memory at a time).

``write_ms`` is from reading the model's parameters to the closed file and the marker (the page cache: the
directory lives on the work directory's disk and is removed after each load, untimed); ``load_ms`` is from the
command leaving this process to the engine's reply after the reload and the cache reset. Nothing is polled: a
real hand-off also waits for the reader to notice ``STABLE``, which is not counted here.
"""

from __future__ import annotations

import multiprocessing as mp
import shutil
import time
from pathlib import Path
from typing import Any

START_TIMEOUT_S = 600.0
LOAD_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 60.0
STABLE_MARKER = "STABLE"


def _engine_main(conn: Any, config_json: str, work_dir: str, log_path: str) -> None:
    """The engine process: builds the engine, answers "ready", then one reply per command (a path to load, or
    "check": one greedy token to show the engine still serves), until None. Its output goes to ``log_path``."""
    import os

    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    from primerl.configs.inference import InferenceConfig
    from primerl.inference.engine import create_llm, shutdown_llm
    from primerl.inference.server import engine_options

    config = InferenceConfig.model_validate_json(config_json)
    llm = create_llm(engine_options(config, work_dir))
    try:
        conn.send(("ready", None))
        while True:
            command = conn.recv()
            if command is None:
                return
            try:
                if command == "check":
                    from vllm import SamplingParams

                    out = llm.generate(["hello"], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
                    conn.send(("ok", len(out[0].outputs[0].token_ids)))
                    continue
                start = time.perf_counter()
                llm.collective_rpc("reload_weights", kwargs={"weights_path": command})
                llm.reset_prefix_cache()
                conn.send(("ok", (time.perf_counter() - start) * 1000.0))
            except Exception as exc:  # reported to the bench, which fails the run with it
                conn.send(("error", repr(exc)))
    finally:
        shutdown_llm(llm)


class FilesystemHandoff:
    """A twin engine of a ``primerl-infer`` daemon and the trainer-side writes of the hand-off."""

    def __init__(self, config: Any, work_dir: Path):
        """``config``: the daemon's ``InferenceConfig``; ``work_dir``: the engine's IPC files and the update
        directories."""
        self.work_dir = work_dir
        work_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = work_dir / "engine.log"
        context = mp.get_context("spawn")
        self._conn, child = context.Pipe()
        self.started_s = time.monotonic()
        self.process = context.Process(
            target=_engine_main, args=(child, config.model_dump_json(), str(work_dir), str(self.log_path)), daemon=False
        )  # the engine starts processes of its own
        self.process.start()
        child.close()
        self._expect("ready", START_TIMEOUT_S, "the filesystem hand-off engine to start")
        self.start_s = time.monotonic() - self.started_s

    def _expect(self, what: str, timeout_s: float, waiting_for: str) -> Any:
        deadline = time.monotonic() + timeout_s
        while not self._conn.poll(0.2):
            if not self.process.is_alive():
                raise RuntimeError(
                    f"the filesystem hand-off engine exited (code {self.process.exitcode}) while "
                    f"waiting for {waiting_for}:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout_s} s waiting for {waiting_for}")
        try:
            status, value = self._conn.recv()
        except EOFError:
            self.process.join(10)
            raise RuntimeError(
                f"the filesystem hand-off engine exited (code {self.process.exitcode}) while "
                f"waiting for {waiting_for}:\n{self.log_tail()}"
            ) from None
        if status == "error":
            raise RuntimeError(f"the filesystem hand-off engine failed ({waiting_for}): {value}\n{self.log_tail()}")
        assert status in (what, "ok"), (status, value)
        return value

    def write(self, model: Any, dtype: Any, version: int) -> tuple[Path, float, int]:
        """Write ``model``'s FULL tensors in ``dtype`` to a fresh directory; returns (directory, ms, file bytes)."""
        from safetensors.torch import save_file

        from primerl.trainer.hf_state_dict import SAFETENSORS_METADATA, hf_state_dict

        start = time.perf_counter()
        directory = self.work_dir / f"step_{version}"
        directory.mkdir()
        state = {}
        for name, tensor in hf_state_dict(model).items():
            tensor = tensor.detach()
            if tensor.is_floating_point() and tensor.dtype != dtype:
                tensor = tensor.to(dtype)
            state[name] = tensor.contiguous()
        path = directory / "model.safetensors"
        save_file(state, str(path), metadata=SAFETENSORS_METADATA)
        (directory / STABLE_MARKER).touch()
        elapsed_ms = (time.perf_counter() - start) * 1000.0
        return directory, elapsed_ms, path.stat().st_size

    def load(self, directory: Path) -> float:
        """Have the engine reload its weights from ``directory``; returns the ms until it answered."""
        start = time.perf_counter()
        self._conn.send(str(directory))
        self._expect("ok", LOAD_TIMEOUT_S, f"the engine to load {directory}")
        return (time.perf_counter() - start) * 1000.0

    def check_serves(self) -> None:
        """One greedy token after the reloads: the engine still serves."""
        self._conn.send("check")
        self._expect("ok", LOAD_TIMEOUT_S, "one token from the reloaded engine")

    def log_tail(self, num_chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return ""

    @staticmethod
    def remove(directory: Path) -> None:
        shutil.rmtree(directory, ignore_errors=True)

    def close(self) -> None:
        try:
            if self.process.is_alive():
                self._conn.send(None)
                self.process.join(STOP_TIMEOUT_S)
        except (BrokenPipeError, OSError):
            pass  # the engine is gone already; terminated below if not
        finally:
            if self.process.is_alive():
                self.process.terminate()
                self.process.join(10)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(10)
            self._conn.close()
