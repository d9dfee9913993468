"""primerl's vLLM plugin: inert without its variable, sets the queue readers' busy loop with it."""

from __future__ import annotations

import importlib.metadata

import pytest

from primerl.inference import vllm_plugin

shm_broadcast = pytest.importorskip("vllm.distributed.device_communicators.shm_broadcast")


def busy_loop_default() -> float:
    return shm_broadcast.SpinCondition.__init__.__defaults__[-1]


@pytest.fixture
def restore_default():
    saved = shm_broadcast.SpinCondition.__init__.__defaults__
    yield
    shm_broadcast.SpinCondition.__init__.__defaults__ = saved


def test_registered_as_a_vllm_general_plugin():
    plugins = {e.name: e.value for e in importlib.metadata.entry_points(group="vllm.general_plugins")}
    assert plugins.get("primerl") == "primerl.inference.vllm_plugin:register"


def test_cpu_engines_get_a_short_busy_loop_by_default():
    from primerl.inference.engine import CPU_ENV_DEFAULTS

    assert float(CPU_ENV_DEFAULTS[vllm_plugin.BUSY_LOOP_ENV]) > 0  # 0 makes readers miss notifications


def test_without_the_variable_vllm_keeps_its_default(monkeypatch, restore_default):
    monkeypatch.delenv(vllm_plugin.BUSY_LOOP_ENV, raising=False)
    before = busy_loop_default()
    vllm_plugin.register()
    assert busy_loop_default() == before


def test_the_variable_sets_the_busy_loop_of_new_readers(monkeypatch, restore_default, tmp_path):
    import zmq

    monkeypatch.setenv(vllm_plugin.BUSY_LOOP_ENV, "0.05")
    vllm_plugin.register()
    assert busy_loop_default() == 0.05
    context = zmq.Context()
    address = f"ipc://{tmp_path}/notify"
    writer = shm_broadcast.SpinCondition(False, context, address)
    reader = shm_broadcast.SpinCondition(True, context, address)
    try:
        assert reader.busy_loop_s == 0.05
    finally:
        for condition in (reader, writer):
            for name in ("local_notify_socket", "read_cancel_socket", "write_cancel_socket"):
                socket = getattr(condition, name, None)
                if socket is not None:
                    socket.close(linger=0)
        context.term()


@pytest.mark.parametrize("value", ["soon", "-1", "nan"])
def test_a_bad_value_is_refused_with_a_warning_and_changes_nothing(monkeypatch, restore_default, caplog, value):
    monkeypatch.setenv(vllm_plugin.BUSY_LOOP_ENV, value)
    before = busy_loop_default()
    with caplog.at_level("WARNING", logger="primerl.inference.vllm_plugin"):
        vllm_plugin.register()
    assert busy_loop_default() == before
    assert vllm_plugin.BUSY_LOOP_ENV in caplog.text
