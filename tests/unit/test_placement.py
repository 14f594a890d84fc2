import pytest

from dflash_server.runtime.placement import parse_devices, parse_split, plan_placement


def ranges(shards):
    return [(s.begin, s.end) for s in shards]


def test_even_and_weighted_splits():
    assert ranges(plan_placement(30, ["cpu"])) == [(0, 30)]
    assert ranges(plan_placement(30, ["cpu", "cpu"])) == [(0, 15), (15, 30)]
    assert ranges(plan_placement(30, ["cpu", "cpu"], [1, 2])) == [(0, 10), (10, 30)]
    assert ranges(plan_placement(7, ["cpu"] * 3, [1, 3, 3])) == [(0, 1), (1, 4), (4, 7)]


def test_every_shard_gets_a_layer_and_ranges_are_contiguous():
    for n in range(1, 12):
        for k in range(1, n + 1):
            for split in ([1] * k, [100] + [1] * (k - 1), [1] * (k - 1) + [100]):
                shards = plan_placement(n, ["cpu"] * k, split)
                assert shards[0].begin == 0 and shards[-1].end == n
                assert all(a.end == b.begin for a, b in zip(shards, shards[1:]))
                assert all(s.num_layers >= 1 for s in shards)


@pytest.mark.parametrize("text", ["0", "1,0", "-1,2", "a,b", "nan", "1,,2"])
def test_bad_split_weights(text):
    with pytest.raises(ValueError):
        parse_split(text)


def test_wrong_count_and_too_many_shards():
    with pytest.raises(ValueError, match="weights"):
        plan_placement(10, ["cpu", "cpu"], [1, 2, 3])
    with pytest.raises(ValueError, match="layer"):
        plan_placement(2, ["cpu"] * 3)


@pytest.mark.parametrize("text,why", [("gpu", "unknown"), ("cuda:x", "unknown"), ("cpu,,cpu", "empty"),
                                      ("remote:cpu", "first device must be local"),
                                      ("remote:cpu,cpu", "first device must be local"),
                                      ("cpu,remote:cpu,cpu", "one local group followed by one remote group"),
                                      ("cpu,remote:gpu", "unknown"), ("cpu,remote:", "unknown"), ("", "empty")])
def test_bad_devices(text, why):
    with pytest.raises(ValueError, match=why):
        parse_devices(text)


def test_good_devices():
    assert parse_devices("cpu,cuda:0,cuda:1") == ["cpu", "cuda:0", "cuda:1"]
    assert parse_devices("cuda:0,remote:cpu,remote:cuda:1") == ["cuda:0", "remote:cpu", "remote:cuda:1"]


def test_split_local_remote():
    from dflash_server.runtime.placement import split_local_remote

    shards = plan_placement(6, parse_devices("cpu,cpu,remote:cuda:0"))
    local, remote = split_local_remote(shards)
    assert [(s.device, s.begin, s.end) for s in local] == [("cpu", 0, 2), ("cpu", 2, 4)]
    assert [(s.device, s.begin, s.end) for s in remote] == [("cuda:0", 4, 6)]
