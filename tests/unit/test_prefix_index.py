"""Prefix-cache bookkeeping: lookup, LRU eviction, slot and byte budgets (no tensors)."""
import pytest

from dflash_server.cache.prefix_index import PrefixIndex, prefix_key


def add(idx, ids, nbytes=10):
    slot = idx.new_slot()
    return slot, idx.insert(ids, slot, nbytes)


def test_longest_boundary_prefix_wins_and_is_confirmed():
    idx = PrefixIndex(8)
    add(idx, (1, 2, 3))
    add(idx, (1, 2, 3, 4, 5))
    prompt = (1, 2, 3, 4, 5, 6, 7)
    assert idx.lookup(prompt, [3, 5, 7]).length == 5
    assert idx.lookup(prompt, [3]).length == 3
    assert idx.lookup((9, 9, 9, 9), [3]) is None
    assert idx.hits == 2 and idx.misses == 1 and idx.tokens_saved == 8


def test_hash_collision_is_not_a_hit():
    idx = PrefixIndex(4)
    slot, _ = add(idx, (1, 2))
    # forge an entry whose key claims other ids
    e = idx.entries[prefix_key((1, 2))]
    idx.entries[prefix_key((3, 4))] = type(e)(prefix_key((3, 4)), (1, 2), slot, 10)
    assert idx.lookup((3, 4, 5), [2]) is None


def test_lru_eviction_by_slots():
    idx = PrefixIndex(2)
    s1, _ = add(idx, (1,))
    s2, _ = add(idx, (2,))
    idx.lookup((1, 0), [1])  # touch (1,)
    s3, evicted = add(idx, (3,))
    assert [e.slot for e in evicted] == [s2]
    assert idx.contains((1,)) and idx.contains((3,)) and not idx.contains((2,))


def test_byte_budget_and_accounting():
    idx = PrefixIndex(10, max_bytes=100)
    add(idx, (1,), 40)
    add(idx, (2,), 40)
    _, evicted = add(idx, (3,), 40)
    assert len(evicted) == 1 and evicted[0].token_ids == (1,)
    assert idx.total_bytes == 80
    assert not idx.fits(101) and idx.fits(100)
    # replacing an entry releases its bytes and returns its slot to free
    _, evicted = add(idx, (2,), 10)
    assert [e.token_ids for e in evicted] == [(2,)] and idx.total_bytes == 50
    idx.remove(prefix_key((3,)))
    assert idx.total_bytes == 10 and len(idx.entries) == 1


def test_disabled_and_bad_limits():
    idx = PrefixIndex(0)
    assert not idx.enabled and not idx.fits(1)
    with pytest.raises(ValueError):
        PrefixIndex(-1)


def test_lookup_hashes_only_boundaries_an_entry_can_match(monkeypatch):
    """A prompt of thousands of end-of-turn ids has thousands of boundaries: hashing each
    prefix was quadratic (8000 tokens: 16M token hashes, ~6 s on the engine's thread)."""
    from dflash_server.cache import prefix_index

    hashed: list[int] = []
    orig = prefix_index.prefix_key
    monkeypatch.setattr(prefix_index, "prefix_key", lambda ids: hashed.append(len(ids)) or orig(ids))
    ids = [2, 198] * 4000                       # "<|im_end|>\n" x 4000: 4000 turn boundaries
    idx = prefix_index.PrefixIndex(32)
    assert idx.lookup(ids, range(2, len(ids) + 1, 2)) is None
    assert sum(hashed) == 0
    idx.insert(ids[:100], idx.new_slot(), 10)
    idx.insert([7] * 300, idx.new_slot(), 10)   # a length at a boundary, other ids
    hashed.clear()
    e = idx.lookup(ids, range(2, len(ids) + 1, 2))
    assert e is not None and e.length == 100    # the longest match is still found
    assert sum(hashed) <= 100 + 300


def test_keys_are_the_documented_bytes():
    import hashlib

    from dflash_server.cache.prefix_index import prefix_key

    ids = [0, 1, -5, 2**31 - 1, 49151]
    h = hashlib.blake2b(digest_size=16)
    h.update(len(ids).to_bytes(8, "little"))
    for t in ids:
        h.update(t.to_bytes(4, "little", signed=True))
    assert prefix_key(ids) == prefix_key(tuple(ids)) == h.hexdigest()  # (disk caches keep their names)
