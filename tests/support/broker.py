"""An in-process broker for tests: `BrokerService` on free loopback ports, stopped and started again on the same
ports (as after a crash), with a control client, a weight publisher and the inference worker it lists."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from primerl.broker.service import BrokerService
from primerl.client.control import ControlClient
from primerl.client.weight_publisher import WeightPublisher
from primerl.configs.broker import BrokerConfig
from primerl.proto.v1 import data_pb2
from primerl.runtime.config_common import BrokerClientConfig

RESTART_TIMEOUT_S = 10.0
"""How long a restart retries binding the old ports (the old sockets may linger for a moment)."""


class BrokerHarness:
    """A running `BrokerService` on 127.0.0.1 with ports chosen by the OS; `config` holds the bound ports."""

    def __init__(self, spool_dir: Path, stop_grace_s: float = 1.0, **config_fields: Any):
        self.config = BrokerConfig(
            **{
                "host": "127.0.0.1",
                "grpc_port": 0,
                "rollout_port": 0,
                "weight_port": 0,
                "spool_dir": spool_dir,
                **config_fields,
            }
        )
        self.stop_grace_s = stop_grace_s
        self.service = BrokerService(self.config)
        self.endpoints = self.service.start()
        self.config = self.config.model_copy(
            update={
                "grpc_port": self.endpoints.grpc_port,
                "rollout_port": self.endpoints.rollout_port,
                "weight_port": self.endpoints.weight_port,
            }
        )
        self.running = True

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.endpoints.grpc_port}"

    @property
    def rollout_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.endpoints.rollout_port}"

    @property
    def weight_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.endpoints.weight_port}"

    def stop(self) -> None:
        if self.running:
            self.service.stop(grace_s=self.stop_grace_s)
            self.running = False

    def restart(self) -> None:
        """A new broker (empty registry and weight store unless the spool keeps them) on the same ports."""
        self.stop()
        self.start()

    def start(self) -> None:
        """Start a new broker on the same ports after `stop()`."""
        deadline = time.monotonic() + RESTART_TIMEOUT_S
        while True:
            try:
                self.service = BrokerService(self.config)
                self.endpoints = self.service.start()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        self.running = True

    def client(self, role: str = "trainer", name: str = "test-observer", **config: Any) -> ControlClient:
        """A control client (not yet registered) with the broker's run token; `config`: more
        `BrokerClientConfig` fields."""
        client_config = BrokerClientConfig(address=self.grpc_address, run_token=self.config.run_token, **config)
        return ControlClient(client_config, role, name)

    def inference_worker(self) -> Any:
        """The one inference worker the broker lists, or None while there is not exactly one."""
        with self.client() as client:
            workers = client.list_workers(role="inference")
        return workers[0] if len(workers) == 1 else None

    def publish(
        self, header: data_pb2.WeightUpdateHeader, payload: bytes, timeout_s: float = 30.0
    ) -> data_pb2.WeightAck:
        """Publish one weight update as the trainer would and return the broker's acknowledgement."""
        with WeightPublisher(
            self.weight_endpoint, self.config.run_token, "trainer", self.service.chunk_bytes
        ) as publisher:
            return publisher.publish(header, payload, timeout_s=timeout_s)
