"""Stop strings through the shared Aho-Corasick automaton give exactly the plain loop's answers: the first stop
string in the list that ends in a token's new text wins, cut at its earliest such occurrence, with
include_stop_str_in_output and min_tokens as before; and one automaton serves a request's n samples."""
from __future__ import annotations

import random

import pytest

from pressroom.engine.detokenizer import NO_STOP, IncrementalDetokenizer, StopStrings


def plain_loop(pieces: list[str], stops: list[str], include: bool, min_tokens: int) -> tuple[str, str | None, int]:
    """The loop the automaton replaces: every stop string searched in the text that can hold a new match."""
    text = ""
    for count, piece in enumerate(pieces, 1):
        before = len(text)
        text += piece
        if count <= min_tokens:
            continue
        for stop in stops:
            at = text.find(stop, max(0, before - len(stop) + 1))
            if at >= 0:
                return (text[:at + len(stop)] if include else text[:at]), stop, count
    return text, None, len(pieces)


def piece_decoder(pieces: list[str]):
    """A tokenizer whose token i decodes to pieces[i], concatenated: the new text of each step is one piece."""
    return lambda ids, skip: "".join(pieces[i] for i in ids)


def automaton(pieces: list[str], stops: StopStrings | list[str], include: bool,
              min_tokens: int) -> tuple[str, str | None, int]:
    d = IncrementalDetokenizer(piece_decoder(pieces), [], True, stops, include, min_tokens)
    for count in range(1, len(pieces) + 1):
        if d.add(count - 1) is not None:
            return d.text, d.stopped_by, count
    return d.text, d.stopped_by, len(pieces)


def random_case(rng: random.Random) -> tuple[list[str], list[str], bool, int]:
    alphabet = rng.choice(["ab", "abc", "abcd", "aé🙂", "xyz "])
    words = ["".join(rng.choices(alphabet, k=rng.randint(1, 6))) for _ in range(rng.randint(1, 12))]
    text_len = rng.randint(0, 60)
    pieces, built = [], 0
    while built < text_len:
        piece = "".join(rng.choices(alphabet, k=rng.randint(1, 5)))
        pieces.append(piece)
        built += len(piece)
    return pieces, words, rng.random() < 0.5, rng.choice([0, 0, 1, 3, 8])


@pytest.mark.parametrize("seed", range(20))
def test_automaton_matches_the_plain_loop_on_random_texts(seed):
    rng = random.Random(seed)
    for _ in range(200):
        pieces, stops, include, min_tokens = random_case(rng)
        assert automaton(pieces, stops, include, min_tokens) == plain_loop(pieces, stops, include, min_tokens), \
            (pieces, stops, include, min_tokens)


def test_the_first_listed_stop_wins_over_an_earlier_match():
    pieces, stops = ["xx ab cd"], ["cd", "ab"]
    assert automaton(pieces, stops, False, 0) == ("xx ab ", "cd", 1) == plain_loop(pieces, stops, False, 0)


def test_the_winner_is_cut_at_its_earliest_occurrence_in_the_new_text():
    pieces = ["a", "b-ab-ab"]
    assert automaton(pieces, ["ab"], True, 0) == ("ab", "ab", 2) == plain_loop(pieces, ["ab"], True, 0)


def test_overlapping_and_nested_stop_strings():
    pieces = ["she", "rs", " his", "hers"]
    stops = ["hers", "he", "his", "s"]
    for include in (False, True):
        for min_tokens in range(4):
            assert automaton(pieces, stops, include, min_tokens) == plain_loop(pieces, stops, include, min_tokens)


def test_a_match_during_min_tokens_is_skipped_but_a_later_one_found():
    pieces = ["STOP", " go", " STOP"]
    assert automaton(pieces, ["STOP"], False, 1) == ("STOP go ", "STOP", 3)


def test_duplicate_stop_strings_report_the_string():
    assert automaton(["a stop"], ["stop", "stop"], False, 0) == ("a ", "stop", 1)


def test_one_automaton_serves_many_samples_independently():
    stops = StopStrings(["END", "halt"])
    texts = [["go", " on", " EN", "D"], ["ha", "lt"], ["no stop here"]]
    results = [automaton(pieces, stops, False, 0) for pieces in texts]
    assert results == [("go on ", "END", 4), ("", "halt", 2), ("no stop here", None, 1)]


def test_walk_reports_the_node_and_no_stop_when_none_ends():
    stops = StopStrings(["abc"])
    node, index, end = stops.walk(0, "xab")
    assert (index, end) == (NO_STOP, -1) and node != 0  # "ab" is under way
    assert stops.walk(node, "c")[1:] == (0, 1)


def test_many_stop_strings_are_built_once_and_matched():
    rng = random.Random(7)
    stops = ["".join(rng.choices("abcdefgh", k=rng.randint(3, 12))) for _ in range(5000)]
    automaton_ = StopStrings(stops)
    pieces = ["".join(rng.choices("abcdefgh ", k=4)) for _ in range(300)]
    assert automaton(pieces, automaton_, False, 0) == plain_loop(pieces, stops, False, 0)


def test_holdback_is_the_longest_stop_string_less_one():
    d = IncrementalDetokenizer(piece_decoder(["x"]), [], True, ["ab", "abcde"], False)
    assert d.holdback == 4
    assert IncrementalDetokenizer(piece_decoder(["x"]), [], True, None, False).holdback == 0
