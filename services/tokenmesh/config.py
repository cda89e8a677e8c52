"""Configuration: frozen dataclasses, one flag and one env var per field.

Each service's config is a frozen dataclass whose fields are declared with
:func:`setting`. :func:`add_arguments` turns the fields into ``--flag`` options
whose defaults come from ``TOKENMESH_<SERVICE>_<FIELD>`` when set, so flags win
over the environment, which wins over the built-in default. Validation lives in
each dataclass's ``__post_init__`` and raises :class:`ConfigError` with a
message saying what to change.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")

ENV_PREFIX = "TOKENMESH_"


class ConfigError(ValueError):
    """A setting is invalid; the message says which one and what is allowed."""


def setting(default: Any, help: str, *, parse: Callable[[str], Any] | None = None) -> Any:  # noqa: A002
    """Declare a config field with its help text (and a parser for str values)."""
    return dataclasses.field(default=default, metadata={"help": help, "parse": parse})


def not_a_setting(default_factory: Callable[[], Any]) -> Any:
    """Declare a config field that code sets but that has no flag or environment variable (document it in place)."""
    return dataclasses.field(default_factory=default_factory, metadata={"setting": False})


def settings(cls: type[Any]) -> tuple[dataclasses.Field[Any], ...]:
    """The fields of ``cls`` that are settings (a flag and a variable each): all but those of :func:`not_a_setting`."""
    return tuple(f for f in dataclasses.fields(cls) if f.metadata.get("setting", True))


def csv(value: str) -> tuple[str, ...]:
    """Parse a comma-separated list, dropping blanks."""
    return tuple(part.strip() for part in value.split(",") if part.strip())


TRUE_WORDS = ("true", "1", "yes", "on")
FALSE_WORDS = ("false", "0", "no", "off")


def parse_bool(value: str) -> bool:
    """A boolean from an environment value: one of :data:`TRUE_WORDS` or :data:`FALSE_WORDS`, in any case.

    Anything else raises ValueError naming the accepted words: a typo (``ture``) must stop the service at start,
    not read as false.
    """
    word = value.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ValueError(f"not a boolean: use one of {', '.join(TRUE_WORDS + FALSE_WORDS)} (any case)")


def env_name(service: str, field: str) -> str:
    """Environment variable that sets ``field`` of ``service``."""
    return f"{ENV_PREFIX}{service.upper()}_{field.upper()}"


def _parser_for(field: dataclasses.Field[Any]) -> Callable[[str], Any]:
    parse: Callable[[str], Any] | None = field.metadata.get("parse")
    if parse is not None:
        return parse
    default: object = field.default
    if isinstance(default, bool):
        return parse_bool
    if isinstance(default, int):
        return int
    if isinstance(default, float):
        return float
    return str


def add_arguments(parser: argparse.ArgumentParser, cls: type[Any], service: str) -> None:
    """Add one ``--flag`` per setting of ``cls``; env vars provide defaults."""
    for field in settings(cls):
        flag = "--" + field.name.replace("_", "-")
        env = env_name(service, field.name)
        parse = _parser_for(field)
        default = field.default
        if env in os.environ:
            try:
                default = parse(os.environ[env])
            except ValueError as exc:
                raise ConfigError(f"{env}={os.environ[env]!r} is not valid: {exc}") from exc
        shown = ",".join(default) if isinstance(default, tuple) else default
        help_text = f"{field.metadata['help']} (env {env}; default: {shown!r})"
        if isinstance(field.default, bool):
            parser.add_argument(
                flag, dest=field.name, default=default, help=help_text, action=argparse.BooleanOptionalAction
            )
        else:
            parser.add_argument(flag, dest=field.name, default=default, type=parse, help=help_text)


def from_namespace(cls: type[T], namespace: argparse.Namespace) -> T:
    """Build ``cls`` from parsed arguments (runs its validation)."""
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    return cls(**{k: v for k, v in vars(namespace).items() if k in names})


def check(condition: bool, message: str) -> None:
    """Raise ConfigError(message) unless condition holds."""
    if not condition:
        raise ConfigError(message)


@dataclass(frozen=True, kw_only=True)
class ServerSettings:
    """What router, worker and prober set alike about their gRPC server: address, ports, stop grace, ready file.

    Each service's config inherits these (with :class:`~tokenmesh.tls.TlsSettings`) and calls
    :meth:`check_server` from its ``__post_init__``; it redeclares ``port`` for its own default (a redeclared
    field keeps its place, so every service lists its settings in the same order).
    """

    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(0, "gRPC port; 0 picks a free one")
    health_port: int = setting(
        0,
        'also serve grpc.health.v1 alone (liveness, readiness, ""), plaintext, on this '
        "port, for kubelet probes (which present no client certificate); 0 = off",
    )
    metrics_port: int = setting(0, "serve Prometheus metrics on http://host:PORT/metrics; 0 = off")
    stop_grace_s: float = setting(
        1.0,
        "after the drain, how long calls still open (health watches and other "
        "long streams) may take before they are ended",
    )
    ready_file: str = setting(
        "", "write the server's address and pid (a worker's: also its Triton's url and pid) as JSON here once SERVING"
    )

    def check_server(self) -> None:
        """Validate the ports and the grace (ConfigError names the setting)."""
        check(0 <= self.port <= 65535, f"port must be 0..65535, got {self.port}")
        check(0 <= self.health_port <= 65535, f"health_port must be 0..65535, got {self.health_port}")
        check(0 <= self.metrics_port <= 65535, f"metrics_port must be 0..65535, got {self.metrics_port}")
        check(
            not self.health_port or self.health_port != self.port,
            f"health_port must differ from port ({self.port}); 0 turns it off",
        )
        check(self.stop_grace_s >= 0, f"stop_grace_s must be >= 0, got {self.stop_grace_s}")


_HOST_NAME = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?")
"""A DNS name or an IPv4 address: letters, digits, '-', '_' and '.' (not at either end)."""


def address_error(address: str) -> str:
    """Why address is not host:port with a port 1..65535 ('' when it is); an IPv6 host goes in brackets."""
    host, colon, port = address.rpartition(":")
    if not colon or not host:
        return "must be host:port"
    if not (port.isascii() and port.isdigit()):
        return f"port {port!r} must be 1..65535"
    if not 1 <= int(port) <= 65535:
        return f"port {int(port)} must be 1..65535"
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return f"host {host} is not an IPv6 address"
        return ""
    if ":" in host:
        return "an IPv6 host goes in brackets, e.g. [::1]:50061"
    if not _HOST_NAME.fullmatch(host):
        return f"host {host!r} is not a host name or IPv4 address"
    return ""


def check_discovery(interval_s: float, dns_server: str) -> None:
    """Validate the discovery settings router and prober share."""
    check(0 < interval_s <= 300, f"discovery_interval_s must be in (0, 300], got {interval_s}")
    if dns_server:
        problem = address_error(dns_server)
        check(
            not problem, f"discovery_dns_server {dns_server!r}: {problem} (an IP address and port, e.g. 10.96.0.10:53)"
        )
        host = dns_server.rpartition(":")[0].strip("[]")
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise ConfigError(
                f"discovery_dns_server {dns_server!r}: the host must be an IP address, not a name"
            ) from None
