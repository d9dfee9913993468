"""Which host a daemon binds and which one it tells others to dial: the rules every role shares.

A daemon binds ``host`` (an interface of its machine, or a wildcard: ``0.0.0.0``, ``::``) and advertises the address
its peers should dial. The two differ behind NAT (set ``advertise_host``) or with a wildcard bind, where the
advertised host is derived so that it works across machines, never loopback by assumption:

- the broker hands out its ZeroMQ endpoints at registration. With a wildcard bind and no ``advertise_host`` they
  carry the wildcard, and each worker replaces it with the host it dialed the broker's gRPC server at
  (``dialable_endpoint``): the address that reached the broker from that worker's machine reaches its other
  ports too. The broker needs to know nothing about its own addresses.
- an inference worker registers the URL of its HTTP server. With a wildcard bind and no ``advertise_host`` it
  registers the address of its interface that routes to the broker (``route_to``: a UDP "connect", no packet
  sent), the address the broker's other peers most likely share a network with; the host name when there is
  no such route (no network, a name that does not resolve).

``check_advertise_host`` refuses what cannot be dialed (a wildcard, a scheme, a port) with the setting's name.
"""

from __future__ import annotations

import ipaddress
import socket

WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "[::]", ""})
"""Bind hosts that mean every interface: never an address to dial."""


def is_wildcard_host(host: str) -> bool:
    return host.strip() in WILDCARD_HOSTS


def check_advertise_host(host: str, setting: str) -> str:
    """``host`` as a host that peers can dial; ``ValueError`` naming ``setting`` otherwise."""
    host = host.strip()
    fix = f"set {setting} to an IP address or DNS name of this machine that the other machines can reach"
    if is_wildcard_host(host):
        raise ValueError(f"{setting} = {host!r} is a wildcard, which nobody can dial: {fix}")
    if "://" in host or "/" in host or any(c.isspace() for c in host):
        raise ValueError(f"{setting} = {host!r} is not a host (no scheme, path or spaces): {fix}")
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if ":" in bare:
        try:
            ipaddress.IPv6Address(bare)
        except ValueError:
            raise ValueError(f"{setting} = {host!r} is not a host (give the port apart): {fix}") from None
    return host


def url_host(host: str) -> str:
    """``host`` as it goes into a URL or a ZeroMQ endpoint (IPv6 addresses in brackets)."""
    host = host.strip()
    if ":" in host and not host.startswith("["):
        return f"[{host}]"
    return host


def split_host_port(address: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port``) -> (host without brackets, port); ``ValueError`` when malformed."""
    host, sep, port = address.strip().rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"{address!r} is not host:port")
    return host.strip("[]"), int(port)


def dialable_endpoint(endpoint: str, dialed_address: str) -> str:
    """A ZeroMQ endpoint ``tcp://HOST:PORT`` handed out by the broker, with a wildcard HOST replaced by the host of
    ``dialed_address`` (the ``host:port`` this worker reached the broker's gRPC server at). Other endpoints are
    returned as they are."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    host, sep, port = endpoint[len("tcp://") :].rpartition(":")
    if not sep or not is_wildcard_host(host):
        return endpoint
    dialed_host, _ = split_host_port(dialed_address)
    return f"tcp://{url_host(dialed_host)}:{port}"


def route_to(peer_address: str) -> str | None:
    """The address of this machine's interface that routes to ``peer_address`` (``host:port``), found with a
    UDP socket's ``connect`` (no packet is sent); None when there is no route or the name does not resolve."""
    try:
        host, port = split_host_port(peer_address)
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except (ValueError, OSError):
        return None
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.connect(sockaddr)
                local = probe.getsockname()[0]
        except OSError:
            continue
        if local and not is_wildcard_host(local):
            return local
    return None


def advertised_host(bind_host: str, advertise_host: str | None, *, peer_address: str | None = None) -> str:
    """The host others dial to reach a server bound to ``bind_host``: ``advertise_host`` when set; ``bind_host``
    when it is concrete; for a wildcard bind, the address routing to ``peer_address`` (``route_to``), else this
    machine's host name."""
    if advertise_host:
        return advertise_host
    if not is_wildcard_host(bind_host):
        return bind_host
    local = route_to(peer_address) if peer_address else None
    return local or socket.gethostname()


__all__ = [
    "WILDCARD_HOSTS",
    "advertised_host",
    "check_advertise_host",
    "dialable_endpoint",
    "is_wildcard_host",
    "route_to",
    "split_host_port",
    "url_host",
]
