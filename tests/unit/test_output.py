"""OutputProcessor: incremental detokenization, UTF-8 hold-back, stop strings, eos, max_tokens."""

import random

import pytest

from xpyd.model.output import FinishReason, OutputProcessor, StopParams
from xpyd.model.tokenizer import load_tokenizer

EOS = 2  # <|im_end|>
TEXTS = [
    "Hello, world! This is plain ASCII text.",
    "Crème brûlée, façade, naïve, Ångström, smörgåsbord",
    "日本語のテキストと中文文本，还有한국어도 있어요。",
    "Emoji: 🎉🎮👩‍👩‍👧‍👦 🇫🇷 and 🤖 robots",
    "Mixed: café ☕ 東京 🗼 — “quotes” … done",
]


@pytest.fixture(scope="module")
def tok(smollm_dir):
    return load_tokenizer(smollm_dir)


def stream(tok, ids, **kw):
    out = OutputProcessor(tok, StopParams(**({"max_tokens": 10_000, "eos_token_ids": frozenset({EOS})} | kw)))
    deltas, reason = [], None
    for i in ids:
        delta, reason = out.append(i)
        deltas.append(delta)
        if reason is not None:
            break
    return out, deltas, reason


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_decode(tok, text):
    ids = tok(text).input_ids
    assert len(ids) > len(text.split())  # multi-token characters present or at least several tokens
    out, deltas, reason = stream(tok, ids)
    assert reason is None and out.finished is None
    assert "".join(deltas) == out.text == tok.decode(ids, skip_special_tokens=True) == text
    assert not any("\ufffd" in d for d in deltas)  # incomplete characters were held back, never emitted


def test_multi_token_characters_are_held_until_complete(tok):
    ids = tok("🎉").input_ids
    assert len(ids) > 1
    out, deltas, _ = stream(tok, ids)
    assert deltas[:-1] == [""] * (len(ids) - 1) and deltas[-1] == "🎉"


def test_random_token_ids_match_decode(tok):
    rng = random.Random(0)
    vocab = len(tok)
    for _ in range(20):
        ids = [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 40))]
        out, deltas, reason = stream(tok, ids, max_tokens=len(ids))
        assert reason is FinishReason.LENGTH
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)


def test_special_tokens_are_skipped(tok):
    ids = tok("Hi").input_ids + [1] + tok(" there").input_ids
    out, deltas, _ = stream(tok, ids)
    assert "".join(deltas) == "Hi there" == tok.decode(ids, skip_special_tokens=True)


def test_eos_stops_without_its_text(tok):
    ids = tok("Paris is nice.").input_ids
    out, deltas, reason = stream(tok, ids + [EOS, 42])
    assert reason is FinishReason.STOP and out.finished is FinishReason.STOP
    assert out.token_ids == ids + [EOS]  # eos counts as a generated token, the one after it is never seen
    assert out.text == "".join(deltas) == "Paris is nice."


def test_ignore_eos_keeps_going(tok):
    ids = tok("one").input_ids + [EOS] + tok(" two").input_ids
    out, deltas, reason = stream(tok, ids, ignore_eos=True, max_tokens=len(ids))
    assert reason is FinishReason.LENGTH and out.token_ids == ids
    assert "".join(deltas) == "one two" == tok.decode(ids, skip_special_tokens=True)


def test_max_tokens_gives_length_and_flushes_an_incomplete_character(tok):
    ids = tok("ok 🎉").input_ids
    out, deltas, reason = stream(tok, ids, max_tokens=len(ids) - 1)
    assert reason is FinishReason.LENGTH and len(out.token_ids) == len(ids) - 1
    assert "".join(deltas) == tok.decode(ids[:-1], skip_special_tokens=True)
    assert out.text.endswith("\ufffd")  # flushed as decode() shows it


def test_stop_string_spanning_tokens(tok):
    text = "The answer is forty-two. END OF ANSWER and more text"
    ids = tok(text).input_ids
    stop = " END OF ANSWER"
    out, deltas, reason = stream(tok, ids, stop=(stop,))
    assert reason is FinishReason.STOP
    assert out.text == "".join(deltas) == "The answer is forty-two."
    # it stopped at the token completing the stop string, not later
    consumed = tok.decode(out.token_ids)
    assert consumed.endswith("ANSWER") and stop in consumed and stop not in tok.decode(out.token_ids[:-1])


def test_possible_stop_prefix_is_held_then_released(tok):
    ids = tok("a END OF STORY b").input_ids
    out, deltas, reason = stream(tok, ids, stop=(" END OF ANSWER",), max_tokens=len(ids))
    assert reason is FinishReason.LENGTH
    assert "".join(deltas) == "a END OF STORY b"
    emitted = ["".join(deltas[: k + 1]) for k in range(len(ids))]
    decoded = [tok.decode(ids[: k + 1]) for k in range(len(ids))]
    k = decoded.index("a END OF")
    assert emitted[k] == "a"  # " END OF" could still become " END OF ANSWER": held back
    assert emitted[k + 1] == decoded[k + 1] == "a END OF ST"  # no longer possible: released at once


def test_earliest_of_several_stop_strings_wins(tok):
    ids = tok("alpha beta gamma delta").input_ids
    out, _, reason = stream(tok, ids, stop=("delta", " beta", "gamma"))
    assert reason is FinishReason.STOP and out.text == "alpha"


def test_stop_string_in_cjk_and_emoji(tok):
    for text, stop, want in [("日本語のテキスト", "テキ", "日本語の"), ("go 🎉🎉 now", "🎉", "go ")]:
        out, deltas, reason = stream(tok, tok(text).input_ids, stop=(stop,))
        assert reason is FinishReason.STOP and "".join(deltas) == want


def test_stop_string_at_the_very_end_is_still_removed(tok):
    ids = tok("say bye").input_ids
    out, deltas, reason = stream(tok, ids, stop=(" bye",), max_tokens=len(ids))
    assert reason is FinishReason.STOP and "".join(deltas) == "say"


def test_append_after_finish_raises(tok):
    out, _, _ = stream(tok, [EOS])
    with pytest.raises(RuntimeError):
        out.append(42)


def test_decoding_cost_stays_linear(tok):
    calls = []

    class Counting:
        def decode(self, ids, **kw):
            calls.append(len(ids))
            return tok.decode(ids, **kw)

    ids = tok(" ".join(TEXTS) * 8).input_ids
    out, deltas, _ = stream(Counting(), ids)
    assert "".join(deltas) == tok.decode(ids)
    assert max(calls) < 16  # only a short window is decoded per step, never the whole output


@pytest.mark.parametrize("kwargs", [dict(max_tokens=0), dict(max_tokens=1, stop=("",)), dict(max_tokens=1, stop="x"),
                                    dict(max_tokens=True)])
def test_stop_params_validation(kwargs):
    with pytest.raises(ValueError):
        StopParams(**kwargs)


def test_stop_params_accept_lists():
    p = StopParams(max_tokens=3, stop=["a"], eos_token_ids={2})
    assert p.stop == ("a",) and p.eos_token_ids == frozenset({2})
