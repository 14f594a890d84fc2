"""Disk cache bookkeeping: budget accounting and age/hit-aware eviction (no tensors)."""
import pytest

from dflash_server.cache.disk_index import DiskEntry, DiskIndex


def test_budget_accounting_and_replace():
    idx = DiskIndex(100)
    idx.add(DiskEntry("a", (1,), 40, 0.0))
    idx.add(DiskEntry("b", (2,), 40, 0.0))
    assert idx.total_bytes == 80 and not idx.over_budget(20) and idx.over_budget(21)
    idx.add(DiskEntry("a", (1,), 10, 0.0))
    assert idx.total_bytes == 50
    idx.remove("b")
    assert idx.total_bytes == 10


def test_eviction_prefers_old_and_unused():
    idx = DiskIndex(100, half_life_s=100.0)
    now = 1000.0
    idx.add(DiskEntry("old", (1,), 40, now - 500))
    idx.add(DiskEntry("new", (2,), 40, now - 1))
    idx.add(DiskEntry("old_but_hot", (3,), 20, now - 500, hits=50))
    victims = idx.victims(incoming=40, now=now)
    assert [v.key for v in victims] == ["old"]
    # more room needed: the next least valuable goes too
    assert [v.key for v in idx.victims(incoming=80, now=now)] == ["old", "new"]


def test_keep_and_longest_match():
    idx = DiskIndex(10)
    idx.add(DiskEntry("k1", (1, 2), 8, 0.0))
    idx.add(DiskEntry("k2", (1, 2, 3, 4), 8, 0.0))
    assert [v.key for v in idx.victims(incoming=0, keep="k1")] == ["k2"]
    assert idx.longest_match((1, 2, 3, 4, 5), {2, 4}).key == "k2"
    assert idx.longest_match((1, 2, 3, 4, 5), {2}).key == "k1"
    assert idx.longest_match((9, 2, 3, 4, 5), {2, 4}) is None


def test_negative_budget_rejected():
    with pytest.raises(ValueError):
        DiskIndex(-1)
