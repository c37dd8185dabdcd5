"""Where notifications may go. A channel URL must be http(s) with a host and no `user:password@`; where it
leads is checked again when sending, after DNS, and the request goes to the very address that was checked,
so a name that later resolves to 169.254.169.254 cannot reach a cloud's metadata service.

`AMPWATCH_ALERT_URL_SCOPE` says which destinations are allowed (webhook and Slack URLs, SMTP hosts):
- `private` (default): public, private-network and loopback addresses: a self-hosted server notifies the
  chat or mail relay on its own network.
- `public`: public addresses only, for a server where people you do not fully trust can add channels.
- `loopback`: this machine only (an IP literal or `localhost`, never a DNS lookup): tests, fuzzing.

Link-local addresses (169.254.0.0/16, where cloud metadata lives, and fe80::/10), unspecified, multicast
and reserved addresses are refused in every scope.
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Any, cast
from urllib.parse import urlsplit, urlunsplit

SCOPES = ("private", "public", "loopback")
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


class TargetError(ValueError):
    """A destination a channel may not use (a permanent failure: the configuration must change)."""


def scope_of(settings: Any) -> str:
    """The configured scope; `private` when the setting is absent."""
    scope = str(getattr(settings, "alert_url_scope", "private") or "private").strip().lower()
    if scope not in SCOPES:
        raise TargetError(f"AMPWATCH_ALERT_URL_SCOPE must be one of {', '.join(SCOPES)}, not {scope!r}")
    return scope


def check_url(url: str) -> str:
    """The URL if it is http(s) with a host and no user info; a clear `TargetError` otherwise."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018  (raises on a port that is not a number in range)
    except ValueError as error:
        raise TargetError(f"not a valid URL: {error}") from error
    if parts.scheme not in ("http", "https"):
        raise TargetError("the URL must start with http:// or https://")
    if not parts.hostname:
        raise TargetError("the URL has no host")
    if "@" in parts.netloc:
        raise TargetError(
            "the URL must not contain a user name or password (user:password@host): put a token in the path or query"
        )
    return url


def check_host(host: str, scope: str) -> None:
    """What can be decided without DNS: an IP literal's address, and names in the loopback scope."""
    address = _literal(host)
    if address is not None:
        _check(address, host, scope)
    elif scope == "loopback" and not _is_localhost(host):
        raise TargetError(
            f"{host}: only this machine (127.0.0.1, ::1, localhost) is allowed (AMPWATCH_ALERT_URL_SCOPE=loopback)"
        )


def resolve(host: str, port: int, scope: str) -> str:
    """The checked address to connect to for `host`. Every address the name resolves to must be allowed.
    Raises `TargetError` (permanent) for a refused destination, `OSError` (temporary) when DNS fails."""
    check_host(host, scope)
    literal = _literal(host)
    if literal is not None:
        return str(literal)
    if scope == "loopback":
        return "127.0.0.1"  # `localhost`, without asking DNS
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    addresses = [ipaddress.ip_address(cast(str, info[4][0]).split("%")[0]) for info in infos]
    for address in addresses:
        _check(address, host, scope)
    if not addresses:
        raise OSError(f"{host} has no address")
    return str(addresses[0])


def mask_url(url: str) -> str:
    """A URL safe to show or log: scheme and host only. Webhook URLs carry their secret in the path (Slack's
    last segments, Telegram's first, ntfy's only one) or the query, so neither is shown; nor is user info."""
    parts = urlsplit(url)
    netloc = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, netloc, "/***" if parts.path.strip("/") or parts.query else "", "", ""))


def _check(address: Address, host: str, scope: str) -> None:
    inner = _embedded_ipv4(address) or address
    where = host if str(inner) == host else f"{host} ({inner})"
    if inner.is_link_local or inner in _METADATA:
        raise TargetError(f"{where} is a link-local or cloud metadata address: never allowed")
    if inner.is_loopback:
        if scope == "public":
            raise TargetError(f"{where} is this machine: not allowed with AMPWATCH_ALERT_URL_SCOPE=public")
        return
    if inner.is_unspecified or inner.is_multicast or inner.is_reserved:
        raise TargetError(f"{where} is not a host's address (unspecified, multicast or reserved)")
    if scope == "loopback":
        raise TargetError(f"{where}: only this machine is allowed (AMPWATCH_ALERT_URL_SCOPE=loopback)")
    if scope == "public" and not inner.is_global:
        raise TargetError(f"{where} is a private address: set AMPWATCH_ALERT_URL_SCOPE=private to allow it")


# Metadata services outside the link-local ranges (AWS's IPv6 endpoint, Alibaba Cloud, GCP's IPv6 endpoint).
_METADATA = {ipaddress.ip_address(a) for a in ("fd00:ec2::254", "100.100.100.200", "fd20:ce::254")}


_NAT64 = ipaddress.ip_network("64:ff9b::/96")  # a NAT64 gateway reaches the IPv4 address in the last 32 bits


def _embedded_ipv4(address: Address) -> ipaddress.IPv4Address | None:
    if isinstance(address, ipaddress.IPv6Address):
        if address in _NAT64:
            return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
        return address.ipv4_mapped or address.sixtofour
    return None


def _literal(host: str) -> Address | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def _is_localhost(host: str) -> bool:
    name = host.lower().rstrip(".")
    return name == "localhost" or name.endswith(".localhost")
