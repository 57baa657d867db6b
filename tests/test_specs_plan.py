"""How a plan says its numbers in words (`specs.plan`)."""

from __future__ import annotations

import pytest

from moeplan.specs.plan import token_words


@pytest.mark.parametrize(("tokens", "said"), [
    (999.9e9, "1T"), (15e12, "15T"), (2.5e16, "25,000T"), (1e18, "1,000,000T"),
    (300e9, "300B"), (4_194_304, "4.19M"), (40_000, "40,000"), (512, "512")])
def test_token_counts_read_as_people_say_them_never_in_exponents(tokens, said):
    assert token_words(tokens) == said
