"""Stop sequences over streamed text: held back while they may complete, never sent."""

from __future__ import annotations

from shardline.serving.stops import StopMatcher


def _run(stops: list[str], deltas: list[str]) -> tuple[list[str], bool]:
    m = StopMatcher(stops)
    out = [m.push(d) for d in deltas]
    out.append(m.flush())
    return out, m.stopped


def test_no_stops_passes_through() -> None:
    assert _run([], ["Hel", "lo"]) == (["Hel", "lo", ""], False)


def test_stop_inside_one_delta() -> None:
    assert _run(["\n\n"], ["Paris.\n\nNext", " more"]) == (["Paris.", "", ""], True)


def test_stop_across_deltas_is_held_back_then_dropped() -> None:
    assert _run(["END"], ["abc E", "N", "D tail"]) == (["abc ", "", "", ""], True)


def test_partial_that_does_not_complete_is_released() -> None:
    assert _run(["END"], ["abc E", "N", "X"]) == (["abc ", "", "ENX", ""], False)


def test_partial_held_until_end_is_flushed() -> None:
    assert _run(["END"], ["abc EN"]) == (["abc ", "EN"], False)


def test_earliest_of_several_stops_wins() -> None:
    assert _run(["b", "cd"], ["a cd b"]) == (["a ", ""], True)
