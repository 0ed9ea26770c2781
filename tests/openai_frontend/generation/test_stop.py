"""Stop strings: matched across chunks, the earliest wins, held text released when it cannot stop."""

from __future__ import annotations

from openai_frontend.generation.stop import StopMatcher


def _run_stops(stops, chunks):
    matcher = StopMatcher(stops)
    out = [matcher.feed(c) for c in chunks]
    if not matcher.stopped:
        out.append(matcher.flush())
    return "".join(out), matcher.stopped, out


def test_stop_string_split_across_chunks():
    text, stopped, out = _run_stops(["STOP"], ["Hello S", "T", "OP and more"])
    assert (text, stopped) == ("Hello ", True)
    assert out == ["Hello ", "", ""]  # "S", "ST" held back until decided


def test_held_prefix_is_released_when_it_cannot_be_a_stop():
    text, stopped, out = _run_stops(["STOP"], ["Hello S", "TAR", "s"])
    assert (text, stopped) == ("Hello STARs", False)
    assert out[:2] == ["Hello ", "STAR"]


def test_earliest_stop_wins_and_is_not_included():
    text, stopped, _ = _run_stops(["world", "lo"], ["Hello wor", "ld"])
    assert (text, stopped) == ("Hel", True)


def test_stop_inside_one_chunk_and_at_the_start():
    assert _run_stops(["\n\n"], ["a\n\nb"])[:2] == ("a", True)
    assert _run_stops(["abc"], ["abc"])[:2] == ("", True)


def test_held_tail_released_at_the_end():
    assert _run_stops(["</end>"], ["text </e"])[:2] == ("text </e", False)


def test_no_stops_passes_text_through():
    assert _run_stops([], ["a", "b"]) == ("ab", False, ["a", "b", ""])


def test_the_matcher_names_the_stop_string_that_ended_the_text():
    matcher = StopMatcher(["cd", "bcd", "zz"])
    assert matcher.feed("ab") == "a" and matcher.matched is None  # "b" may start "bcd"
    assert matcher.feed("cdzz") == "" and matcher.matched == "bcd"  # the first to start; at one place, the longest
    tie = StopMatcher(["ab", "abc"])
    assert tie.feed("xabcd") == "x" and tie.matched == "abc"
