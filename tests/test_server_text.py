"""fuser/server/text.py: a step's tokens detokenized at once give the text of one token at a
time, and the direct decode is the tokenizer's own."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from fuser.models import TARGET_PATH
from fuser.server import text
from fuser.server.text import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer():
    if not (TARGET_PATH / "tokenizer.json").is_file():
        pytest.skip("the bundled tokenizer is not installed")
    return AutoTokenizer.from_pretrained(TARGET_PATH)


# Ids of the bundled byte-level BPE tokenizer, special ones and lone bytes of multi-byte
# characters (partial characters) among them; a sample of text's ids mixed in.
def ids_of(tokenizer) -> st.SearchStrategy[list[int]]:
    text = "déjà vu: ∑ naïve → 漢字 🙂 \n\tx = 1"
    sample = tokenizer(text, add_special_tokens=False)["input_ids"]
    return st.lists(st.one_of(st.integers(0, tokenizer.vocab_size - 1), st.sampled_from(sample)),
                    min_size=1, max_size=40)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(data=st.data(), skip=st.booleans())
def test_a_steps_tokens_at_once_stream_what_one_at_a_time_streams(tokenizer, data, skip):
    ids = data.draw(ids_of(tokenizer))
    cuts = sorted(data.draw(st.sets(st.integers(1, len(ids) - 1), max_size=len(ids) - 1))
                  if len(ids) > 1 else set())
    steps = [ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)])]
    one, many = IncrementalDetokenizer(tokenizer, skip), IncrementalDetokenizer(tokenizer, skip)
    for step in steps:
        # what one step releases is what its tokens released one at a time
        assert many.extend(step) == "".join(one.add(t) for t in step)
    assert many.flush() == one.flush()
    assert many.text == one.text


@settings(max_examples=40, deadline=None, derandomize=True)
@given(data=st.data(), skip=st.booleans())
def test_the_direct_decode_is_the_tokenizers_own(tokenizer, data, skip):
    ids = data.draw(ids_of(tokenizer))
    assert text.decoder(tokenizer, skip)(ids) == tokenizer.decode(ids, skip_special_tokens=skip)


def test_other_tokenizers_decode_through_their_own_decode(tokenizer, monkeypatch):
    """A tokenizer that cleans up tokenization spaces, or whose class overrides decode, is
    decoded by its own decode."""
    calls = []

    def own(ids, **kwargs):
        calls.append(list(ids))
        return "<own>"

    monkeypatch.setattr(tokenizer, "decode", own, raising=False)  # (the instance's)
    assert text.decoder(tokenizer, True)([5, 6]) != "<own>"  # the Rust tokenizer's, directly
    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces", True)
    assert text.decoder(tokenizer, True)([5, 6]) == "<own>"
    monkeypatch.undo()

    def overridden(self, ids, **kwargs):
        return "<class>"

    monkeypatch.setattr(type(tokenizer), "decode", overridden)
    assert text.decoder(tokenizer, True)([5, 6]) == "<class>"
