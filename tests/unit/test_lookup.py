"""Prompt-lookup drafts (spec.lookup): the index against a brute-force search, incremental
indexing, and when a sequence stops looking up."""
import random

import pytest

from dflash_server.spec.lookup import LookupIndex, LookupStore, LookupUse


def brute(tokens, depth, n_min, n_max):
    """What the index must propose: for n from n_max down, the latest earlier occurrence of
    the last n tokens (ending before the suffix itself), then what followed it."""
    for n in range(n_max, n_min - 1, -1):
        if len(tokens) < n:
            continue
        suffix = tokens[len(tokens) - n:]
        for i in range(len(tokens) - n - 1, -1, -1):
            if tokens[i:i + n] == suffix:
                out = []
                for k in range(depth):        # an overlapping copy: past the end, from the copy itself
                    j = i + n + k
                    out.append(tokens[j] if j < len(tokens) else out[j - len(tokens)])
                return out
    return []


@pytest.mark.parametrize("vocab", [3, 8, 50])
def test_index_equals_brute_force_at_every_length(vocab):
    rng = random.Random(vocab)
    for n_min, n_max in ((1, 1), (2, 4), (1, 3)):
        toks = [rng.randrange(vocab) for _ in range(300)]
        idx = LookupIndex(n_min, n_max)
        for i in range(1, len(toks) + 1):
            idx.sync(toks[:i])
            for depth in (1, 5):
                assert idx.propose(depth) == brute(toks[:i], depth, n_min, n_max), (vocab, n_min, n_max, i, depth)


def test_sync_appends_across_prompt_and_output():
    prompt, out = [1, 2, 3, 4, 9], [1, 2, 3]
    a = LookupIndex()
    a.sync(prompt, out[:1])
    a.sync(prompt, out[:2])
    a.sync(prompt, out)
    b = LookupIndex()
    b.sync(prompt + out)
    assert a.tokens == b.tokens == prompt + out and a.after == b.after
    assert a.propose(3) == [4, 9, 1]         # "1 2 3" was followed by 4 9 1 (the copy runs into the output)
    assert a.propose(6) == [4, 9, 1, 2, 3, 4]  # and on past the end, from the copy's own start
    a.sync(prompt, out)                      # nothing new: nothing changes
    assert a.tokens == prompt + out


def test_no_match_and_short_contexts():
    idx = LookupIndex(2, 4)
    assert idx.propose(4) == []
    idx.sync([7])
    assert idx.propose(4) == []
    idx.sync([7, 8, 9, 10])                  # no bigram repeats
    assert idx.propose(4) == []
    assert idx.propose(0) == []
    idx.sync([7, 8, 9, 10, 7, 8])
    assert idx.propose(2) == [9, 10] and idx.propose(6) == [9, 10, 7, 8, 9, 10]
    run = LookupIndex(2, 4)
    run.sync([5, 1, 1, 1])                   # a run: the latest "1 1 1" overlaps it, so the copy repeats
    assert run.propose(4) == [1, 1, 1, 1]
    with pytest.raises(ValueError):
        LookupIndex(0, 2)
    with pytest.raises(ValueError):
        LookupIndex(3, 2)


def test_the_longest_suffix_wins_over_a_later_shorter_one():
    # "1 2 3" occurs early followed by 4; "2 3" occurs later followed by 5: the 3-gram decides
    toks = [1, 2, 3, 4, 0, 2, 3, 5, 0, 1, 2, 3]
    idx = LookupIndex(2, 4)
    idx.sync(toks)
    assert idx.propose(1) == [4]
    assert brute(toks, 1, 2, 4) == [4]


def test_a_sequence_stops_looking_up_when_it_does_not_pay():
    use = LookupUse()
    for _ in range(LookupUse.TRIAL - 1):
        use.learn(0)
        assert use.paying                   # still on trial
    use.learn(0)
    assert not use.paying                   # four lookups, nothing accepted
    good = LookupUse()
    for a in (0, 3, 0, 0):                  # 3 drafts over 4 steps: 0.75 a step
        good.learn(a)
    assert good.paying
    good.learn(0)
    good.learn(0)                           # 3 over 6: 0.5, still paying; one more miss and it stops
    assert good.paying
    good.learn(0)
    assert not good.paying


def test_store_lookups_are_judged_apart_from_the_sequences_own():
    use = LookupUse()
    use.source = "store"
    for _ in range(LookupUse.TRIAL):
        use.learn(0)
    assert not use.pays("store") and use.paying          # the store's copies stopped, its own go on
    use.source = "own"
    use.learn(3)
    assert use.steps == 1 and use.accepted == 3 and use.record["store"] == [LookupUse.TRIAL, 0]


# --- across requests: LookupStore (--lookup-store) ----------------------------------------------

def store_brute(docs, context, depth, n_min=LookupStore.N_MIN, n_max=LookupStore.N_MAX):
    """The latest occurrence (newest document first, then the latest place in it) of the
    longest suffix of ``context`` followed by at least one token of its document; what follows."""
    for n in range(n_max, n_min - 1, -1):
        if len(context) < n:
            continue
        suffix = list(context[-n:])
        for doc in reversed(docs):
            for i in range(len(doc) - n - 1, -1, -1):
                if doc[i:i + n] == suffix:
                    return doc[i + n:i + n + depth]
    return []


@pytest.mark.parametrize("vocab", [2, 4, 30])
def test_store_equals_brute_force(vocab):
    rng = random.Random(vocab)
    store, docs = LookupStore(100_000), []
    for _ in range(12):
        doc = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
        store.add(doc)
        docs.append(doc)
        for _ in range(40):
            ctx = [rng.randrange(vocab) for _ in range(rng.randrange(0, 12))]
            if rng.random() < 0.5 and docs:   # often a context that does occur
                d = rng.choice(docs)
                i = rng.randrange(len(d))
                ctx = ctx + d[max(0, i - 9):i + 1]
            for depth in (1, 6):
                assert store.propose(ctx, depth) == store_brute(docs, ctx, depth), (ctx, depth)
    assert store.proposals > store.matches > 0


def test_store_copies_stop_at_the_end_of_a_request():
    store = LookupStore(1000)
    store.add([1, 2, 3, 4, 5])
    store.add([9, 9, 9])
    assert store.propose([7, 1, 2, 3], 8) == [4, 5]            # not on into the next request's tokens
    assert store.propose([3, 4, 5], 3) == [] and store.propose([1, 2], 3) == []   # at its end; too short a suffix
    assert store.propose([1, 2, 3], 0) == []


def test_store_is_bounded_and_keeps_the_newest_whole_requests():
    store = LookupStore(200)
    docs = [[1000 + 10 * k + j for j in range(9)] for k in range(60)]
    for doc in docs:
        store.add(doc)
        assert len(store) <= 200
    assert store.propose(docs[-1][:3], 2) == docs[-1][3:5]     # the newest are kept
    assert store.propose(docs[0][:3], 2) == []                  # the oldest are gone
    kept = [d for d in docs if store.propose(d[:3], 1)]
    assert kept == docs[len(docs) - len(kept):] and len(kept) >= 200 // 10 // 2   # a contiguous newest run, whole
    big = list(range(5000, 5000 + 1000))                        # one request longer than the store
    store.add(big)
    assert len(store) <= 200 and store.propose(big[-10:-7], 3) == big[-7:-4] and store.propose(docs[-1][:3], 1) == []
    huge = LookupStore(100_000)
    huge.add(list(range(10_000)))                               # a request keeps its last MAX_ADD tokens
    assert len(huge) == LookupStore.MAX_ADD + 1 and huge.propose([0, 1, 2], 1) == [] \
        and huge.propose([9000, 9001, 9002], 1) == [9003]


def test_store_survives_hash_collisions():
    """A table entry that does not hold the suffix (what a hash collision would give) is skipped."""
    store = LookupStore(1000)
    store.add([1, 2, 3, 4, 5, 6])
    store.add([7, 8, 9, 10])
    for n, table in store.after.items():   # point every key at the second request's entries
        for key in list(table):
            table[key] = len(store) - 2
    assert store.propose([1, 2, 3], 2) == []


@pytest.mark.parametrize("bad", [0, 63, -5, True, 2.5, "4096", None])
def test_store_refuses_a_bad_capacity(bad):
    with pytest.raises(ValueError, match="capacity"):
        LookupStore(bad)
