"""Which ``Host`` names the server answers to (DNS-rebinding defence).

A web page can make a browser send requests to a local server, and with DNS rebinding a
page of ``evil.example`` that resolves to 127.0.0.1 even reads the answers. The browser
then sends ``Host: evil.example``: a server bound to loopback answers only loopback
names (``localhost``, ``*.localhost``, 127.0.0.0/8, ``::1``) plus ``--allowed-hosts``. A
server bound to another address is reached under whatever names its network gives it:
every name is accepted unless ``--allowed-hosts`` lists them. Entries: ``name``,
``.suffix`` (the name and its subdomains), or ``*`` (any).
"""
from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    host = host.lower().rstrip(".")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """``Host`` header -> the name without port: ``[::1]:8080`` -> ``::1``."""
    h = header.strip().lower()
    if h.startswith("["):   # "[addr]" or "[addr]:port", nothing else after the bracket
        end = h.find("]")
        if end < 0:
            return h[1:]
        if not (h[end + 1:] == "" or (h[end + 1] == ":" and h[end + 2:].isdigit())):
            return h            # text after the address: compared whole (never loopback)
        return h[1:end]
    if h.count(":") == 1:
        h = h.split(":", 1)[0]
    return h.rstrip(".")


class HostPolicy:
    def __init__(self, bind: str, allowed: tuple[str, ...] = ()):
        self.allowed = tuple(a.strip().lower().rstrip(".") for a in allowed if a.strip())
        self.any = "*" in self.allowed or (not is_loopback(bind) and not self.allowed)
        self.bind = host_name(bind)

    def _listed(self, name: str) -> bool:
        return any(name == a or (a.startswith(".") and (name == a[1:] or name.endswith(a))) for a in self.allowed)

    def allows(self, header: str | None) -> bool:
        if self.any or header is None:  # HTTP/1.0 clients may omit it; browsers never do
            return True
        name = host_name(header)
        return is_loopback(name) or name == self.bind or self._listed(name)
