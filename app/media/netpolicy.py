"""Where http(s) media may come from: pure checks, no I/O.

A server that fetches URLs for strangers is a proxy into its own network (SSRF): Ray's dashboard on
127.0.0.1:8265, a cloud's metadata service on 169.254.169.254, anything on 10/8. So by default only
*public* addresses are reachable, judged on the address a name resolves to (never on the spelling of
the URL: `2130706433`, `127.1`, `localtest.me` and `[::ffff:127.0.0.1]` all reach 127.0.0.1).
IPv6 forms that carry an IPv4 address inside (IPv4-mapped, 6to4, NAT64) are judged by that address.
The check runs where the socket is opened (app/media/http_fetch.py), so the address checked is the
address connected to.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

_NAT64 = (ipaddress.ip_network("64:ff9b::/96"),)  # the well-known prefix: IPv4 in the last 32 bits
# The local-use prefix 64:ff9b:1::/48 (RFC 8215) is in _SPECIAL: a network's own NAT64 may map it to
# private IPv4 space, and at /48 the IPv4 address is not in the last 32 bits (RFC 6052)
# IANA's special-purpose ranges that are not globally reachable, listed here as well as asked of
# `ipaddress`, whose tables differ between Python releases (3.11.7 calls 192.0.0.192, Oracle Cloud's
# metadata service, global).
_SPECIAL = tuple(ipaddress.ip_network(n) for n in (
    "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12", "192.0.0.0/24",
    "192.0.2.0/24", "192.88.99.0/24", "192.168.0.0/16", "198.18.0.0/15", "198.51.100.0/24", "203.0.113.0/24",
    "224.0.0.0/4", "240.0.0.0/4",
    "::/127", "64:ff9b:1::/48", "100::/64", "2001::/23", "2001:db8::/32", "3fff::/20", "5f00::/16", "fc00::/7", "fe80::/10",
    "fec0::/10", "ff00::/8"))


class ForbiddenAddress(Exception):
    """A media URL's host is not reachable under the policy. Its text never names the resolved
    address, so the error cannot be used to map the server's internal DNS."""


def _embedded_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if any(ip in net for net in _NAT64):
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def is_public(ip: IPAddress) -> bool:
    """True only for a globally routable unicast address (IPv4 or IPv6)."""
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.teredo is not None:  # a tunnel whose far end is not this address
            return False
        inner = _embedded_ipv4(ip)
        if inner is not None:
            return is_public(inner)
        if ip.scope_id:
            return False
    if any(ip in net for net in _SPECIAL if net.version == ip.version):
        return False
    return ip.is_global and not (ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_multicast
                                 or ip.is_reserved or ip.is_unspecified)


def parse_endpoint(entry: str) -> tuple[IPNetwork, int | None]:
    """'10.0.0.5:9000', '10.1.0.0/16', '[fd00::1]:8080', 'fd00::/8' -> (network, port or None)."""
    text, port = entry.strip(), None
    try:
        if text.startswith("["):
            host, _, rest = text[1:].partition("]")
            if rest:
                if not rest.startswith(":"):
                    raise ValueError
                port = int(rest[1:])
        elif text.count(":") == 1:
            host, port_text = text.split(":")
            port = int(port_text)
        else:
            host = text
        net = ipaddress.ip_network(host, strict=False)
    except ValueError:
        raise ValueError(f"allowed_private_endpoints entry {entry!r}: expected an address or network, "
                         "optionally with :port ('10.0.0.5:9000', '10.1.0.0/16', '[fd00::1]:8080')") from None
    if port is not None and not 0 < port < 65536:
        raise ValueError(f"allowed_private_endpoints entry {entry!r}: port out of range")
    return net, port


def normalise_host(host: str) -> str:
    """Lower-case ASCII (IDNA) form without a trailing dot, as hosts are compared."""
    host = host.strip().rstrip(".").lower()
    try:
        return host.encode("idna").decode("ascii") if not host.isascii() else host
    except UnicodeError:
        return host


@dataclass(frozen=True)
class FetchPolicy:
    """What an http(s) fetch may reach. Hashable: one pooled client per policy and process."""

    allowed_domains: tuple[str, ...] = ()
    allow_private_networks: bool = False
    private_endpoints: tuple[tuple[IPNetwork, int | None], ...] = ()
    max_redirects: int = 3

    @classmethod
    def from_config(cls, cfg) -> FetchPolicy:
        """From a MediaConfig."""
        return cls(tuple(normalise_host(d) for d in cfg.allowed_domains), cfg.allow_private_networks,
                   tuple(parse_endpoint(e) for e in cfg.allowed_private_endpoints), cfg.max_redirects)

    def check_host(self, host: str) -> None:
        """The domain allowlist, checked on every hop's URL before anything is resolved."""
        if not self.allowed_domains:
            return
        h = normalise_host(host)
        for d in self.allowed_domains:
            if h == d or (d.startswith("*.") and h.endswith(d[1:])):
                return
        raise ForbiddenAddress(f"media host {host!r} is not in the server's allowed domains")

    def address_allowed(self, ip: IPAddress, port: int) -> bool:
        if self.allow_private_networks or is_public(ip):
            return True
        return any(ip in net and (p is None or p == port) for net, p in self.private_endpoints)

    def check_addresses(self, host: str, addresses: list[str], port: int) -> list[str]:
        """The addresses `host` resolved to, in order, if every one is allowed. One forbidden answer
        refuses the host: a name that mixes public and private answers is an attack, not an accident."""
        if not addresses:
            raise ForbiddenAddress(f"media host {host!r} resolved to no address")
        for a in addresses:
            try:
                ip = ipaddress.ip_address(a)
            except ValueError:
                raise ForbiddenAddress(f"media host {host!r} resolved to an unusable address") from None
            if not self.address_allowed(ip, port):
                raise ForbiddenAddress(f"media host {host!r} is not a public address; the server does not "
                                       "fetch from loopback, private, link-local, multicast or reserved networks")
        return list(dict.fromkeys(addresses))
