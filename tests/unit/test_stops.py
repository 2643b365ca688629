"""Stop sequences over streamed text: held back while they may complete, never sent."""

from __future__ import annotations

from shardline.serving.stops import StopMatcher, StopText


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


class _Letters:
    """A detokenizer whose token t reads as chr(t) (0 reads as nothing: an incomplete character)."""

    def push(self, token: int) -> str:
        return chr(token) if token else ""


def test_stop_text_says_where_each_token_starts_and_cuts_at_a_stop() -> None:
    text = StopText(_Letters(), ["cd"])
    got = [text.push(ord(c)) for c in "abc"] + [text.push(0), text.push(ord("d"))]
    assert got == [("a", 0), ("b", 1), ("", 2), ("", 3), ("", 3)]  # "c" held back: it may begin "cd"
    assert text.stopped and text.shown == 2 and text.decoded == 4
    assert text.flush() == ""


def test_stop_text_releases_held_text_at_the_end() -> None:
    text = StopText(_Letters(), ["cd"])
    assert [text.push(ord(c)) for c in "abc"] == [("a", 0), ("b", 1), ("", 2)]
    assert not text.stopped and text.flush() == "c" and text.shown == 3
