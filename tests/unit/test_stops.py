from serve_app.serving.stops import StopStringMatcher


def feed_all(matcher: StopStringMatcher, pieces: list[str]) -> tuple[str, bool]:
    out = []
    for piece in pieces:
        text, stopped = matcher.feed(piece)
        out.append(text)
        if stopped:
            return "".join(out), True
    out.append(matcher.flush())
    return "".join(out), False


def test_no_stops_passes_text_through():
    assert feed_all(StopStringMatcher([]), ["ab", "c"]) == ("abc", False)


def test_stop_split_across_pieces_is_found_and_dropped():
    assert feed_all(StopStringMatcher(["END"]), ["hello E", "N", "D tail"]) == ("hello ", True)


def test_partial_match_is_held_back_then_released():
    m = StopStringMatcher(["END"])
    assert m.feed("abcE") == ("abc", False)
    assert m.feed("N") == ("", False)
    assert m.feed("x") == ("ENx", False)


def test_earliest_of_several_stops_wins():
    assert feed_all(StopStringMatcher(["zz", "b"]), ["a", "bzz"]) == ("a", True)


def test_held_text_is_flushed_at_the_end():
    assert feed_all(StopStringMatcher(["STOP"]), ["abc", "ST"]) == ("abcST", False)


def test_empty_stop_strings_are_ignored():
    assert feed_all(StopStringMatcher([""]), ["abc"]) == ("abc", False)
