"""Stop strings are exact: the text ends just before the first stop string, and no part of one is
ever emitted, streamed or not, even where it spans several tokens (held back until it cannot be
one). Checked by feeding a tokenizer's tokens one at a time and comparing with the plain string
cut, for every stop string that spans a token boundary of a text."""

from __future__ import annotations

import pytest

from conftest import make_tiny_lm, make_tiny_tokenizer
from mlx_specdec.decoding import GenerationParams, stream_events
from mlx_specdec.decoding.autoregressive import autoregressive
from mlx_specdec.decoding.base import _ThreadText, take_tokens


def streamed(tokenizer, tokens, stop):
    """(each token's emitted text, the text at the end, hit a stop string)."""
    thread = _ThreadText(tokenizer, stop)
    pieces, hit = [], False
    for token in tokens:
        piece, hit = thread.add(token)
        pieces.append(piece)
        if hit:
            break
    pieces.append(thread.flush())
    return pieces, "".join(pieces), hit


def spanning_stops(tokenizer, tokens, text, lengths=(2, 3, 4, 6, 9)):
    """Substrings of `text` that cross at least one token boundary."""
    bounds = {len(tokenizer.decode(tokens[: i + 1])) for i in range(len(tokens) - 1)}
    for n in lengths:
        for start in range(0, len(text) - n + 1):
            if any(start < b < start + n for b in bounds):
                yield text[start: start + n]


def check_exact(tokenizer, text):
    tokens = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(tokens) == text
    checked = 0
    for stop in spanning_stops(tokenizer, tokens, text):
        pieces, out, hit = streamed(tokenizer, tokens, [stop])
        assert hit and out == text[: text.find(stop)], (stop, out)
        so_far = ""
        for piece in pieces:  # no prefix of the output ever runs into the stop string
            so_far += piece
            assert stop not in so_far and so_far == text[: len(so_far)]
        checked += 1
    # a near miss is held back and then released: everything comes out
    pieces, out, hit = streamed(tokenizer, tokens, [text[-3:] + "zz"])
    assert not hit and out == text
    return checked


def test_held_back_text_never_leaks_a_stop_string_tiny_tokenizer():
    tokenizer = make_tiny_tokenizer()
    assert check_exact(tokenizer, "w5 w6 w7 w5 w6 w8 w9 w10 w11") > 50


def test_several_stop_strings_stop_at_the_first_one():
    tokenizer = make_tiny_tokenizer()
    tokens = tokenizer.encode("w5 w6 w7 w8 w9", add_special_tokens=False)
    _, out, hit = streamed(tokenizer, tokens, ["w8 w", "6 w7"])
    assert hit and out == "w5 w"


def test_a_stream_stops_at_the_stop_string_and_the_tail_is_not_emitted():
    lm = make_tiny_lm()
    plain = [e for e in stream_events(lm, [5, 6, 7], autoregressive, GenerationParams(max_tokens=24), "ar")]
    text = "".join(e.text or "" for e in plain if e.kind == "token")
    stop = text[len(text) // 2 - 2: len(text) // 2 + 3]
    got = [e for e in stream_events(lm, [5, 6, 7], autoregressive, GenerationParams(max_tokens=24, stop=(stop,)), "ar")]
    out = "".join(e.text or "" for e in got if e.kind == "token")
    assert out == text[: text.find(stop)]
    assert got[-1].stats.finish_reason == "stop"


def test_take_tokens_counts_tokens_even_when_their_text_is_held():
    tokenizer = make_tiny_tokenizer()
    thread = _ThreadText(tokenizer, ["w6 w9"])
    kept, delta, end = take_tokens(tokenizer.encode("w5 w6", add_special_tokens=False), thread, {2}, 10)
    assert len(kept) == 2 and end is None and "w6" not in delta


@pytest.mark.slow
def test_the_default_model_s_tokenizer_stops_exactly_where_a_stop_spans_tokens():
    from mlx_specdec.engine import Engine

    tokenizer = Engine.load("default").lm.tokenizer
    checked = 0
    for text in ("1. 1\n2. 2\n3. 3\n4. 4", "**Sleep**: keep a schedule.\n\n**Light**: dim it ✨ at night.",
                 "def f(x):\n    return x ** 2  # square"):
        checked += check_exact(tokenizer, text)
    assert checked > 300
