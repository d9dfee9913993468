"""Hosts are addresses (issue 17): what a daemon binds and what it tells others to dial.

- the rules (``primerl.runtime.addresses``): bad advertise hosts are refused naming the setting, a wildcard
  endpoint is dialed where the broker was reached, a wildcard HTTP bind advertises the interface that routes to
  the broker;
- a real broker bound to 0.0.0.0: with ``advertise_host`` it hands out that host; without, each worker gets the
  host it dialed (127.0.0.2 and 127.0.0.3 here: distinct loopback addresses stand for two machines), and a
  rollout batch goes through the endpoint it got.
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from primerl.client.control import ControlClient
from primerl.configs.broker import BrokerConfig
from primerl.configs.inference import InferenceConfig
from primerl.inference.server import ServerAddress
from primerl.runtime.addresses import (
    advertised_host,
    check_advertise_host,
    dialable_endpoint,
    route_to,
    split_host_port,
)
from primerl.runtime.config_common import BrokerClientConfig

TOKEN = "hosts-token"


@pytest.mark.parametrize("bad", ["0.0.0.0", "::", "http://host", "host:8000", "a b"])
def test_an_advertise_host_that_cannot_be_dialed_is_refused_naming_the_setting(bad):
    with pytest.raises(ValueError, match="advertise_host"):
        check_advertise_host(bad, "broker.advertise_host")
    with pytest.raises(ValidationError, match="broker.advertise_host"):
        BrokerConfig(host="0.0.0.0", run_token=TOKEN, advertise_host=bad)
    with pytest.raises(ValidationError, match="inference.server.advertise_host"):
        InferenceConfig.model_validate({"model": {"name": "m"}, "server": {"advertise_host": bad}})


def test_good_advertise_hosts_and_the_endpoint_host():
    assert check_advertise_host("10.0.0.7", "x") == "10.0.0.7"
    assert check_advertise_host("node-3.cluster", "x") == "node-3.cluster"
    assert check_advertise_host("fd00::1", "x") == "fd00::1"
    assert BrokerConfig(host="0.0.0.0", run_token=TOKEN, advertise_host="203.0.113.5").endpoint_host == "203.0.113.5"
    assert BrokerConfig(host="0.0.0.0", run_token=TOKEN).endpoint_host == "0.0.0.0"
    assert BrokerConfig(host="127.0.0.1").endpoint_host == "127.0.0.1"


def test_a_wildcard_endpoint_is_dialed_where_the_broker_was_reached():
    assert dialable_endpoint("tcp://0.0.0.0:5052", "10.1.2.3:50051") == "tcp://10.1.2.3:5052"
    assert dialable_endpoint("tcp://[::]:5052", "[fd00::2]:50051") == "tcp://[fd00::2]:5052"
    assert dialable_endpoint("tcp://broker.lan:5052", "10.1.2.3:50051") == "tcp://broker.lan:5052"
    assert dialable_endpoint("", "10.1.2.3:50051") == ""
    assert split_host_port("[::1]:80") == ("::1", 80)


def test_a_wildcard_http_bind_advertises_the_interface_that_routes_to_the_broker():
    assert advertised_host("10.0.0.4", None, peer_address="10.9.9.9:1") == "10.0.0.4"
    assert advertised_host("0.0.0.0", "infer-7.lan", peer_address="10.9.9.9:1") == "infer-7.lan"
    # loopback routes over loopback, from the address the peer is on
    assert route_to("127.0.0.5:50051") == "127.0.0.1"
    assert advertised_host("0.0.0.0", None, peer_address="127.0.0.5:50051") == "127.0.0.1"
    assert route_to("no-such-host.invalid:1") is None
    assert advertised_host("0.0.0.0", None, peer_address="no-such-host.invalid:1")  # the host name
    address = ServerAddress("0.0.0.0", 8000, "10.0.0.9")
    assert address.base_url == "http://127.0.0.1:8000" and address.advertised_url == "http://10.0.0.9:8000"
    assert ServerAddress("::", 8000, "fd00::9").advertised_url == "http://[fd00::9]:8000"
    assert ServerAddress("10.0.0.4", 8000).advertised_url == "http://10.0.0.4:8000"


def _register(address: str, name: str):
    client = ControlClient(BrokerClientConfig(address=address, run_token=TOKEN), "trainer", name)
    try:
        client.wait_ready(10)
        return client.register()
    finally:
        client.close()


def test_a_broker_bound_to_all_interfaces_hands_out_its_advertise_host(make_broker):
    broker = make_broker(host="0.0.0.0", run_token=TOKEN, advertise_host="127.0.0.2")
    ports = broker.endpoints
    registration = _register(f"127.0.0.3:{ports.grpc_port}", "t-advertised")
    assert registration.rollout_endpoint == f"tcp://127.0.0.2:{ports.rollout_port}"
    assert registration.weight_endpoint == f"tcp://127.0.0.2:{ports.weight_port}"


def test_without_advertise_host_each_worker_dials_the_host_it_reached_the_broker_at(make_broker):
    from support.trainer_runs import pack_batch, packed, samples

    from primerl.client.rollouts import RolloutConsumer, RolloutProducer

    broker = make_broker(host="0.0.0.0", run_token=TOKEN)
    ports = broker.endpoints
    for host in ("127.0.0.2", "127.0.0.3"):
        registration = _register(f"{host}:{ports.grpc_port}", f"t-{host}")
        assert registration.rollout_endpoint == f"tcp://{host}:{ports.rollout_port}"
        assert registration.weight_endpoint == f"tcp://{host}:{ports.weight_port}"
    # the endpoints handed out work: a batch goes in through one and out through the other
    with RolloutProducer(f"tcp://127.0.0.2:{ports.rollout_port}", auth_token=TOKEN) as producer:
        producer.send_batch(*pack_batch(1, 0, 0, 1, packed(samples(1))), timeout_s=20)
    with RolloutConsumer(
        f"tcp://127.0.0.3:{ports.rollout_port}", auth_token=TOKEN, worker_id="t-127.0.0.3", rank=0
    ) as consumer:
        batches = consumer.fetch_step(1, timeout_s=10)
    assert batches
