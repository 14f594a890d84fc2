from dflash_server.engine.stops import StopStringMatcher


def feed(stops, deltas):
    m = StopStringMatcher(tuple(stops))
    out, stopped = [], False
    for d in deltas:
        text, stopped = m.push(d)
        out.append(text)
        if stopped:
            break
    if not stopped:
        out.append(m.flush())
    return out, stopped, m.matched


def test_no_stops_passes_through():
    out, stopped, _ = feed([], ["a", "b"])
    assert "".join(out) == "ab" and not stopped


def test_stop_across_boundaries_is_excluded():
    out, stopped, matched = feed(["END"], ["hello E", "N", "D more"])
    assert stopped and matched == "END"
    assert "".join(out) == "hello "
    # the partial "E" was held back, never released early
    assert out[0] == "hello "


def test_false_prefix_is_released():
    out, stopped, _ = feed(["END"], ["hello E", "x"])
    assert not stopped and "".join(out) == "hello Ex"


def test_earliest_of_several_stops_wins():
    out, stopped, matched = feed(["bb", "a"], ["xxbba"])
    assert matched == "bb" and "".join(out) == "xx"


def test_stop_inside_one_delta():
    out, stopped, matched = feed(["\n\n"], ["line one\n\nline two"])
    assert "".join(out) == "line one" and stopped
