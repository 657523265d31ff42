"""One-line errors made from a library's or a user's exception (:func:`mergeqp.errors.first_line`)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from mergeqp.errors import first_line


def test_the_first_line_and_what_a_colon_introduces():
    assert first_line(ValueError("bad value\nTraceback detail")) == "bad value"
    # a first line that introduces the rest said nothing alone (a QA review, stop 76)
    got = first_line(ValueError("Couldn't instantiate the backend tokenizer from one of:\n(1) a `tokenizers` file\n"
                                "(2) a slow tokenizer\n"))
    assert got == "Couldn't instantiate the backend tokenizer from one of: (1) a `tokenizers` file (2) a slow tokenizer"
    assert first_line("") == "" and first_line(KeyError()) == ""
    # a traceback after the colon stays out (a review of the fix: the error at its end was cut off)
    assert first_line("bad value:\nTraceback (most recent call last):\n  File x\nValueError: y") == "bad value:"


def test_a_long_message_is_cut_at_a_space_and_says_so():
    text = "Connection closed by peer. Check the logs of the remote rank for the reason " * 8
    got = first_line(RuntimeError(text), limit=100)
    assert len(got) <= 100 and got.endswith(" ...") and text.startswith(got[:-4])
    assert text[len(got) - 4] == " "  # (cut at a space, not mid-word: "...Check the logs of the re)")


@given(st.text(max_size=400), st.integers(min_value=0, max_value=300))
def test_one_line_within_the_limit(text, limit):
    got = first_line(text, limit)
    assert "\n" not in got and "\r" not in got and len(got) <= limit
