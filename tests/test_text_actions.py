"""text_actions: TextFitter gives exactly what the character-by-character definition gives."""

from __future__ import annotations

from gymnasium import spaces
from hypothesis import given
from hypothesis import strategies as st

from crl_gym.wrappers.text_actions import TextFitter, fit_to_space


def reference_fit(text: str, space: spaces.Text) -> str:
    """The definition: characters outside the charset become '?' (dropped when '?' is not in
    the charset), then the text is cut to max_length."""
    cs = space.character_set
    out = "".join(c if c in cs else ("?" if "?" in cs else "") for c in text)
    return out[: space.max_length]


@given(st.text(alphabet="ab?-]^\\\n é€", max_size=40), st.sampled_from(["ab?", "ab", "a-]^\\?", "é€ \n"]),
       st.integers(min_value=1, max_value=50))
def test_fitter_matches_the_definition(text: str, charset: str, max_length: int) -> None:
    space = spaces.Text(max_length=max_length, charset=charset)
    assert TextFitter(space)(text) == reference_fit(text, space) == fit_to_space(text, space)


def test_non_text_spaces_pass_through() -> None:
    assert TextFitter(spaces.Discrete(3))("anything ü") == "anything ü"
    # worked example: 'x' is outside {a, b, ?} -> '?', then cut to 3 characters
    assert TextFitter(spaces.Text(max_length=3, charset="ab?"))("axbb") == "a?b"
