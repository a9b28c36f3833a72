"""StopStringMatcher: emits exactly the text before the earliest stop string, whatever the split."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.engine.stop_strings import StopStringMatcher


def _feed_all(matcher: StopStringMatcher, deltas: list[str]) -> tuple[list[tuple[str, bool]], str]:
    results = []
    for delta in deltas:
        results.append(matcher.feed(delta))
        if results[-1][1]:
            break
    return results, matcher.flush()


def test_no_stop_strings_pass_through() -> None:
    matcher = StopStringMatcher([])
    assert matcher.feed("Hello S") == ("Hello S", False)
    assert matcher.feed("TOP") == ("TOP", False)
    assert matcher.flush() == ""
    assert not matcher.stopped


def test_stop_within_one_delta() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("Hello STOP world") == ("Hello ", True)
    assert matcher.stopped
    assert matcher.feed("more") == ("", True)
    assert matcher.flush() == ""


def test_stop_spanning_deltas_is_held_back_then_dropped() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("Hello S") == ("Hello ", False)
    assert matcher.feed("T") == ("", False)
    assert matcher.feed("OP and after") == ("", True)


def test_held_back_text_released_when_the_match_fails() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("a ST") == ("a ", False)
    assert matcher.feed("O") == ("", False)
    assert matcher.feed("RM") == ("STORM", False)


def test_flush_releases_partial_match() -> None:
    matcher = StopStringMatcher(["</answer>"])
    assert matcher.feed("42 </ans") == ("42 ", False)
    assert matcher.flush() == "</ans"
    assert not matcher.stopped


def test_earliest_occurrence_wins() -> None:
    matcher = StopStringMatcher(["world", "lo w"])
    assert matcher.feed("hello world") == ("hel", True)


def test_longer_stop_starting_earlier_beats_a_complete_later_one() -> None:
    # "c" is complete at 2, but "abcd" may still start at 0: wait for the next character.
    matcher = StopStringMatcher(["abcd", "c"])
    assert matcher.feed("xabc") == ("x", False)
    assert matcher.feed("d!") == ("", True)
    matcher = StopStringMatcher(["abcd", "c"])
    assert matcher.feed("xabc") == ("x", False)
    assert matcher.feed("e") == ("ab", True)


def test_flush_cuts_at_a_pending_complete_stop() -> None:
    matcher = StopStringMatcher(["abcd", "c"])
    assert matcher.feed("abc") == ("", False)
    assert matcher.flush() == "ab"
    assert matcher.stopped


def test_duplicate_and_overlapping_stops() -> None:
    matcher = StopStringMatcher(["aa", "aa", "a"])
    assert matcher.feed("baab") == ("b", True)


@pytest.mark.parametrize(("stop", "message"), [(["ok", ""], "got ''"), ([3], "got 3"), ("###", "got the string '###'")])
def test_invalid_stop_strings_rejected(stop: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StopStringMatcher(stop)  # type: ignore[arg-type]


@st.composite
def _case(draw: st.DrawFn) -> tuple[str, list[str], list[str]]:
    """A text over a small alphabet (many overlaps), stop strings (mostly its substrings) and a split."""
    text = draw(st.text(alphabet="abc d", max_size=40))
    stops = []
    for _ in range(draw(st.integers(min_value=0, max_value=4))):
        if text and draw(st.booleans()):
            start = draw(st.integers(min_value=0, max_value=len(text) - 1))
            end = draw(st.integers(min_value=start + 1, max_value=min(len(text), start + 6)))
            stops.append(text[start:end])
        else:
            stops.append(draw(st.text(alphabet="abc d", min_size=1, max_size=5)))
    cuts = sorted(draw(st.lists(st.integers(min_value=0, max_value=len(text)), max_size=12)))
    deltas = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
    return text, stops, deltas


@settings(max_examples=400, deadline=None)
@given(_case())
def test_emitted_text_is_text_before_first_stop(case: tuple[str, list[str], list[str]]) -> None:
    text, stops, deltas = case
    occurrences = [i for i in (text.find(s) for s in stops) if i >= 0]
    expected = text[: min(occurrences)] if occurrences else text
    matcher = StopStringMatcher(stops)
    results, tail = _feed_all(matcher, deltas)
    emitted = "".join(chunk for chunk, _ in results) + tail
    assert emitted == expected
    assert matcher.stopped == bool(occurrences)
    if not stops:
        assert [chunk for chunk, _ in results] == deltas  # nothing held back
    if not (results and results[-1][1]):  # not stopped by feed
        # Before the flush, what was held back is a proper prefix of some stop string.
        fed = "".join(deltas[: len(results)])
        held_back = fed[len("".join(chunk for chunk, _ in results)) :]
        assert not held_back or any(len(s) > len(held_back) and s.startswith(held_back) for s in stops)
