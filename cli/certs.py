"""`primerl certs --out DIR --host H [--host H2 ...] [--clients N|NAME,NAME...]` (or `--add-clients NAMES` to an
existing DIR): the credentials of an encrypted, authenticated wire for one run, and the config lines that use them.

What it writes under DIR (secrets mode 0600, created so from the first byte; the rest 0644):

    ca.pem, ca.key                      the run's CA (keep ca.key off the worker machines)
    broker.pem, broker.key              the broker's gRPC server certificate: every --host as a subjectAltName
    clients/NAME.pem, clients/NAME.key  one client certificate per client (mutual TLS)
    curve/broker.key, .key_secret       the broker's CURVE key pair (ZeroMQ planes)
    curve/clients/NAME.key, .key_secret one CURVE key pair per client
    curve/authorized/NAME.key           the public keys the broker admits (broker.curve_authorized_keys_dir)

A client named ``status`` (one of the defaults) is `primerl status`'s: a certificate only (it speaks gRPC only).

A second run on the same DIR refuses to replace an existing CA (every certificate made from it would stop
verifying) unless --force is given. ``--add-clients`` signs more clients with the existing CA and puts their CURVE
public keys into curve/authorized/, which a running broker reads again at the next handshake.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import re
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

DEFAULT_CLIENTS = ("trainer", "orchestrator", "inference", "status")
ROLE_TABLES = {"trainer": "trainer.broker", "orchestrator": "orchestrator.broker", "inference": "inference.broker"}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


@dataclass(frozen=True)
class CertPaths:
    """Where ``make_certs`` put everything (absolute)."""

    out: Path
    clients: tuple[str, ...]

    @property
    def ca_cert(self) -> Path:
        return self.out / "ca.pem"

    @property
    def ca_key(self) -> Path:
        return self.out / "ca.key"

    @property
    def broker_cert(self) -> Path:
        return self.out / "broker.pem"

    @property
    def broker_key(self) -> Path:
        return self.out / "broker.key"

    def client_cert(self, name: str) -> Path:
        return self.out / "clients" / f"{name}.pem"

    def client_key(self, name: str) -> Path:
        return self.out / "clients" / f"{name}.key"

    @property
    def curve_broker_secret(self) -> Path:
        return self.out / "curve" / "broker.key_secret"

    @property
    def curve_broker_public(self) -> Path:
        return self.out / "curve" / "broker.key"

    def curve_client_secret(self, name: str) -> Path:
        return self.out / "curve" / "clients" / f"{name}.key_secret"

    def curve_client_public(self, name: str) -> Path:
        return self.out / "curve" / "clients" / f"{name}.key"

    @property
    def curve_authorized(self) -> Path:
        return self.out / "curve" / "authorized"

    def broker_settings(self) -> dict[str, str]:
        """The [broker] table's keys that turn everything on."""
        return {
            "tls_cert_path": str(self.broker_cert),
            "tls_key_path": str(self.broker_key),
            "tls_client_ca_path": str(self.ca_cert),
            "curve_secret_key_path": str(self.curve_broker_secret),
            "curve_authorized_keys_dir": str(self.curve_authorized),
        }

    def client_settings(self, name: str) -> dict[str, str]:
        """A role's [<role>.broker] table's keys for client ``name``."""
        return {
            "tls_ca_path": str(self.ca_cert),
            "tls_cert_path": str(self.client_cert(name)),
            "tls_key_path": str(self.client_key(name)),
            "curve_secret_key_path": str(self.curve_client_secret(name)),
            "curve_broker_key_path": str(self.curve_broker_public),
        }


class CertsError(ValueError):
    """The request cannot be done as asked; the message says what to change."""


def parse_clients(spec: str) -> tuple[str, ...]:
    """``3`` -> client-1..client-3; ``a,b`` -> those names."""
    spec = spec.strip()
    if spec.isdigit():
        count = int(spec)
        if not 1 <= count <= 1000:
            raise CertsError(f"--clients {spec}: give 1..1000 clients, or their names")
        return tuple(f"client-{index}" for index in range(1, count + 1))
    names = tuple(name.strip() for name in spec.split(",") if name.strip())
    bad = [name for name in names if not _NAME.match(name) or name == "broker"]
    if not names or bad:
        raise CertsError(
            f"--clients {spec!r}: names are letters, digits, '.', '_' and '-' (not 'broker'), comma "
            "separated, or a count"
        )
    if len(set(names)) != len(names):
        raise CertsError(f"--clients {spec!r} names a client twice")
    return names


def _san(host: str):
    from cryptography import x509

    try:
        return x509.IPAddress(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        return x509.DNSName(host)


@contextmanager
def _private_umask() -> Iterator[None]:
    previous = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(previous)


def _write(path: Path, data: bytes, *, secret: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    fd = os.open(path, flags, 0o600 if secret else 0o644)
    with os.fdopen(fd, "wb") as file:
        file.write(data)
    os.chmod(path, 0o600 if secret else 0o644)


def _key_pem(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _certificate(
    subject_cn: str,
    public_key,
    issuer_cn: str,
    issuer_key,
    *,
    days: int,
    ca: bool = False,
    sans: list | None = None,
    server: bool = False,
):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject_cn)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer_cn)]))
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None), critical=True)
    )
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
    else:
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def make_certs(
    out: str | Path,
    hosts: list[str],
    clients: tuple[str, ...] = DEFAULT_CLIENTS,
    *,
    force: bool = False,
    days: int = 365,
) -> CertPaths:
    """Write a CA, the broker's server certificate (``hosts`` as subjectAltNames), a certificate per client and the
    CURVE key pairs under ``out``; see the module docstring. Raises ``CertsError`` when a CA exists there already
    (unless ``force``) or the request is wrong."""
    import zmq.auth
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    if not hosts:
        raise CertsError("give at least one --host: the name or address the workers dial the broker by")
    if days < 1:
        raise CertsError(f"--days must be >= 1, got {days}")
    paths = CertPaths(Path(out).resolve(), tuple(clients))
    if not force and (paths.ca_cert.exists() or paths.ca_key.exists()):
        raise CertsError(
            f"{paths.ca_cert} exists already: replacing the CA would make every certificate it signed "
            "stop verifying. Use another --out directory, or pass --force to replace everything there"
        )
    with _private_umask():
        paths.out.mkdir(parents=True, exist_ok=True)
        if force:
            for sub in ("clients", "curve"):
                shutil.rmtree(paths.out / sub, ignore_errors=True)
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_cert = _certificate("primerl run CA", ca_key.public_key(), "primerl run CA", ca_key, days=days, ca=True)
        _write(paths.ca_key, _key_pem(ca_key), secret=True)
        _write(paths.ca_cert, ca_cert.public_bytes(serialization.Encoding.PEM), secret=False)

        broker_key = ec.generate_private_key(ec.SECP256R1())
        broker_cert = _certificate(
            hosts[0],
            broker_key.public_key(),
            "primerl run CA",
            ca_key,
            days=days,
            sans=[_san(host) for host in dict.fromkeys(hosts)],
            server=True,
        )
        _write(paths.broker_key, _key_pem(broker_key), secret=True)
        _write(paths.broker_cert, broker_cert.public_bytes(serialization.Encoding.PEM), secret=False)

        for directory in (
            paths.curve_broker_public.parent,
            paths.curve_client_public("x").parent,
            paths.curve_authorized,
        ):
            directory.mkdir(parents=True, exist_ok=True)
        zmq.auth.create_certificates(paths.curve_broker_public.parent, "broker")
        for name in clients:
            _make_client(paths, name, ca_key, days)
    _open_public_files(paths)
    return paths


def add_clients(out: str | Path, clients: tuple[str, ...], *, days: int = 365) -> CertPaths:
    """Credentials for more clients, signed by the CA already under ``out``; their CURVE public keys go into the
    authorized-keys directory, which a running broker reads again (no restart). Raises ``CertsError`` when there
    is no CA or a client of that name exists."""
    from cryptography.hazmat.primitives import serialization

    paths = CertPaths(Path(out).resolve(), tuple(clients))
    if not paths.ca_key.is_file():
        raise CertsError(f"no CA under {paths.out} (ca.key): make one first with `primerl certs --out {out} --host H`")
    taken = [name for name in clients if paths.client_cert(name).exists() or paths.curve_client_secret(name).exists()]
    if taken:
        raise CertsError(f"clients {', '.join(taken)} exist already under {paths.out}: choose other names")
    try:
        ca_key = serialization.load_pem_private_key(paths.ca_key.read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise CertsError(f"cannot read the CA key {paths.ca_key}: {exc}") from exc
    with _private_umask():
        for name in clients:
            _make_client(paths, name, ca_key, days)
    _open_public_files(paths)
    return paths


def _make_client(paths: CertPaths, name: str, ca_key, days: int) -> None:
    """A client certificate, and (except for `primerl status`) a CURVE key pair whose public key is authorized."""
    import zmq.auth
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    cert = _certificate(name, key.public_key(), "primerl run CA", ca_key, days=days)
    _write(paths.client_key(name), _key_pem(key), secret=True)
    _write(paths.client_cert(name), cert.public_bytes(serialization.Encoding.PEM), secret=False)
    if name == "status":  # `primerl status` speaks gRPC only
        return
    paths.curve_client_public(name).parent.mkdir(parents=True, exist_ok=True)
    zmq.auth.create_certificates(paths.curve_client_public(name).parent, name)
    paths.curve_authorized.mkdir(parents=True, exist_ok=True)
    staged = paths.curve_authorized / f".{name}.key.tmp"  # appears whole: a broker may read the directory now
    shutil.copyfile(paths.curve_client_public(name), staged)
    os.chmod(staged, 0o644)
    os.replace(staged, paths.curve_authorized / f"{name}.key")


def _open_public_files(paths: CertPaths) -> None:
    """Secrets stay 0600 (the umask made them so); public files and directories become readable."""
    client_keys_dir = paths.client_key("x").parent  # clients/NAME.key: PEM private keys
    for path in paths.out.rglob("*"):
        if path.is_dir():
            os.chmod(path, 0o755)
        elif not (
            path.suffix == ".key_secret"
            or path in (paths.ca_key, paths.broker_key)
            or (path.parent == client_keys_dir and path.suffix == ".key")
        ):
            os.chmod(path, 0o644)


def config_lines(paths: CertPaths, *, broker: bool = True) -> str:
    """The TOML tables (and the `primerl status` flags) that use what ``make_certs`` wrote."""
    lines = []
    if broker:
        lines += ["# the broker (primerl-broker, or [broker] of a `primerl rl` config)", "[broker]"]
        lines += [f'{key} = "{value}"' for key, value in paths.broker_settings().items()]
    for name in paths.clients:
        settings = paths.client_settings(name)
        if name == "status":
            lines += [
                "",
                "# primerl status (gRPC only: no CURVE keys needed)",
                f"#   primerl status --broker HOST:PORT --tls-ca {settings['tls_ca_path']} "
                f"--tls-cert {settings['tls_cert_path']} --tls-key {settings['tls_key_path']}",
            ]
            continue
        table = ROLE_TABLES.get(name, "<role>.broker")
        comment = f"# client {name!r}" + (
            "" if name in ROLE_TABLES else ": put in the [broker] table of the role it runs (e.g. [inference.broker])"
        )
        lines += ["", comment, f"[{table}]"] + [f'{key} = "{value}"' for key, value in settings.items()]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="primerl certs",
        description="Make the credentials of an encrypted, authenticated wire for one run: a CA, the broker's TLS "
        "certificate, client certificates (mutual TLS on gRPC) and CURVE key pairs (ZeroMQ planes); print the "
        "config lines that turn them on.",
    )
    parser.add_argument("--out", required=True, help="directory to write into (created)")
    parser.add_argument(
        "--host",
        action="append",
        default=[],
        dest="hosts",
        help="a name or IP address the workers dial the broker by (repeat for several)",
    )
    parser.add_argument(
        "--clients",
        default=",".join(DEFAULT_CLIENTS),
        help="a count (client-1..N) or comma-separated names (default: %(default)s)",
    )
    parser.add_argument("--days", type=int, default=365, help="validity of the certificates (default 365)")
    parser.add_argument("--force", action="store_true", help="replace an existing CA and everything made from it")
    parser.add_argument(
        "--add-clients",
        default=None,
        metavar="NAMES",
        help="add these clients (a count or names) to the CA already in --out; their CURVE keys are "
        "admitted by a running broker without a restart (--host is not needed)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.add_clients is not None:
            paths = add_clients(args.out, parse_clients(args.add_clients), days=args.days)
        else:
            paths = make_certs(args.out, args.hosts, parse_clients(args.clients), force=args.force, days=args.days)
    except CertsError as err:
        print(f"primerl certs: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"primerl certs: cannot write under {args.out}: {err}", file=sys.stderr)
        return 1
    print(
        f"# written under {paths.out} (keep ca.key off the worker machines; *.key_secret and *.key PEM files are "
        "owner-only)"
    )
    print(config_lines(paths, broker=args.add_clients is None))
    return 0
