"""Did a client address us (a base URL) or a host through us? What the addon's `request` hook
asks of every flow, from the connection's facts: the tunnels it saw opened and what a host name
resolves to."""

from __future__ import annotations

import asyncio
import ipaddress

from perpetuity_core.wire.route import PROVIDER_HOSTS

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class Addressing:
    def __init__(self) -> None:
        self.tunnels: set[str] = set()  # client connections that opened a CONNECT tunnel
        self._resolved: dict[str, frozenset[IPAddress | None]] = {}

    async def is_direct(self, client: str, sockname: tuple | None, host: str, pretty_host: str,
                        port: int) -> bool:
        """Only when the request names one of our own listen addresses (the address it reached
        us on, `sockname`) and came outside any CONNECT tunnel: comparing the port alone sent a
        token meant for another host on the same port (`POST http://jenkins.internal:8080/...`)
        to a provider."""
        if (pretty_host in PROVIDER_HOSTS or client in self.tunnels
                or not sockname or port != sockname[1]):
            return False
        ours = _address(sockname[0])
        if (literal := _address(host)) is not None:
            return literal == ours
        if host not in self._resolved:  # a name: what it resolves to (once per name)
            try:
                infos = await asyncio.get_running_loop().getaddrinfo(host, port)
            except OSError:
                infos = []
            if len(self._resolved) > 1024:
                self._resolved.clear()
            self._resolved[host] = frozenset(_address(str(i[4][0])) for i in infos)
        return ours in self._resolved[host]


def _address(host: str) -> IPAddress | None:
    """An IP literal as an address (IPv4-mapped IPv6 as IPv4), else None."""
    try:
        ip = ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        return None
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return mapped or ip
