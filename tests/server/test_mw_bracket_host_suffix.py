"""Hostile review (2026-11-27). host_name() cuts a bracketed Host at ']' and ignores what follows: ``[::1]evil.example``
counts as loopback and is served."""
import pytest

from dflash_server.server.hosts import HostPolicy


@pytest.mark.parametrize("host", ["[::1]evil.example", "[::1]evil.example:80", "[127.0.0.1]x"])
def test_junk_after_the_bracket_is_refused(host):
    assert not HostPolicy("127.0.0.1").allows(host)


def test_bracketed_loopback_with_port_is_served():
    assert HostPolicy("127.0.0.1").allows("[::1]:8080") and HostPolicy("127.0.0.1").allows("[::1]")
