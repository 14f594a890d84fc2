"""Host-name policy (DNS rebinding): parsing odd Host headers and the allow rules."""
import pytest

from dflash_server.server.hosts import HostPolicy, host_name, is_loopback


@pytest.mark.parametrize("header, name", [("localhost:8080", "localhost"), ("[::1]:80", "::1"), ("[::1", "::1"),
                                          ("Example.COM.", "example.com"), ("::1", "::1"), ("", ""),
                                          ("127.0.0.1:99999", "127.0.0.1")])
def test_host_name(header, name):
    assert host_name(header) == name


def test_loopback_policy():
    p = HostPolicy("127.0.0.1")
    for ok in ("localhost", "localhost:1", "127.0.0.1", "127.8.9.10:80", "[::1]:8080", "a.b.localhost", None):
        assert p.allows(ok), ok
    for bad in ("", " ", "evil.example", "localhost.evil.example", "127.0.0.1.evil.example", "0x7f000001",
                "[::ffff:10.0.0.1]", "10.0.0.1", "\x00", "é.example"):
        assert not p.allows(bad), bad
    assert HostPolicy("::1").allows("localhost") and not HostPolicy("localhost").allows("evil.example")


def test_widened_and_open_policies():
    p = HostPolicy("127.0.0.1", ("box.lan", " .corp.example ", ""))
    assert p.allows("box.lan") and p.allows("a.b.corp.example") and p.allows("corp.example")
    assert not p.allows("xcorp.example") and not p.allows("lan")
    assert HostPolicy("127.0.0.1", ("*",)).allows("anything")
    assert HostPolicy("0.0.0.0").allows("anything")
    lan = HostPolicy("192.168.1.5", ("box.lan",))
    assert lan.allows("box.lan") and lan.allows("192.168.1.5:8080") and lan.allows("localhost")
    assert not lan.allows("evil.example")
    assert is_loopback("127.0.0.1") and not is_loopback("0.0.0.0") and not is_loopback("::")
