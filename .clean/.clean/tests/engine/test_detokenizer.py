"""IncrementalDetokenizer with SmolLM2's byte-level BPE: multi-byte characters split across tokens are
never shown half-done, the streamed text equals the one-shot decode, and stop strings are found and cut
even when they straddle tokens, with a held-back tail while a stop string could still be forming."""
from __future__ import annotations

import pytest

from pressroom.engine.detokenizer import IncrementalDetokenizer, fast_decoder

TEXTS = [
    "café au lait, s'il vous plaît é",
    "Hello 世界! 你好，世界。",
    "ok 🙂 fine🙂🙂 done",
    "naïve 🙂世界é — ¿Qué tal? 👩‍💻 ok",
]


@pytest.fixture(scope="module")
def decode(smollm_tokenizer):
    return fast_decoder(smollm_tokenizer)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level BPE vocabularies are written in."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def byte_tokens(tokenizer, text: str) -> list[int]:
    """One token per UTF-8 byte: every multi-byte character spans several tokens."""
    table = _bytes_to_unicode()
    ids = tokenizer.convert_tokens_to_ids([table[b] for b in text.encode("utf-8")])
    assert tokenizer.unk_token_id not in ids or tokenizer.unk_token_id is None
    return ids


def stream(decode, ids: list[int], prompt: list[int] = (), **kw) -> tuple[IncrementalDetokenizer, list[str]]:
    d = IncrementalDetokenizer(decode, list(prompt), **kw)
    texts = []
    for t in ids:
        stopped = d.add(t)
        texts.append(d.text)
        if stopped is not None:
            break
    return d, texts


# ---- multi-byte characters ------------------------------------------------------------------

@pytest.mark.parametrize("text", TEXTS)
def test_bpe_tokens_stream_to_the_full_decode(decode, smollm_tokenizer, text):
    ids = smollm_tokenizer.encode(text, add_special_tokens=False)
    d, texts = stream(decode, ids)
    assert d.text == decode(ids, True) == text
    for t in texts:
        assert "\ufffd" not in t
    for a, b in zip(texts, texts[1:]):
        assert b.startswith(a)  # text only ever grows


def test_the_emoji_really_spans_several_tokens(smollm_tokenizer, decode):
    """Guard for the test above: at least one character here is split over tokens."""
    ids = smollm_tokenizer.encode("🙂🙂", add_special_tokens=False)
    assert len(ids) > 2
    assert any("\ufffd" in decode([i], True) for i in ids)


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_per_byte_streams_to_the_full_decode(decode, smollm_tokenizer, text):
    ids = byte_tokens(smollm_tokenizer, text)
    assert len(ids) == len(text.encode("utf-8"))
    d, texts = stream(decode, ids)
    assert d.text == text
    assert all("\ufffd" not in t for t in texts)
    # Text appears exactly when a character's last byte arrives.
    done = b""
    for t, b in zip(texts, text.encode("utf-8")):
        done += bytes([b])
        assert t == done.decode("utf-8", errors="ignore")


@pytest.mark.parametrize("text", TEXTS[1:3])
def test_streaming_after_a_prompt_gives_only_the_new_text(decode, smollm_tokenizer, text):
    prompt = smollm_tokenizer.encode("<|im_start|>user\nSay something 世界 🙂<|im_end|>\n", add_special_tokens=False)
    ids = smollm_tokenizer.encode(text, add_special_tokens=False)
    d, texts = stream(decode, ids, prompt)
    assert d.text == text
    assert all("\ufffd" not in t for t in texts)


def test_special_tokens_skipped_or_kept(decode, smollm_tokenizer):
    ids = smollm_tokenizer.encode("Hi 🙂", add_special_tokens=False) + [smollm_tokenizer.eos_token_id]
    eos_text = smollm_tokenizer.eos_token
    assert stream(decode, ids, skip_special_tokens=True)[0].text == "Hi 🙂"
    assert stream(decode, ids, skip_special_tokens=False)[0].text == "Hi 🙂" + eos_text


# ---- stop strings ---------------------------------------------------------------------------

def _token_texts(decode, ids):
    return [decode([i], True) for i in ids]


def test_stop_string_across_a_token_boundary_is_found_and_cut(decode, smollm_tokenizer):
    text = "Hello world, this is a test of stop strings."
    ids = smollm_tokenizer.encode(text, add_special_tokens=False)
    stop = "o wor"
    pieces = _token_texts(decode, ids)
    assert not any(stop in p for p in pieces)  # really straddles tokens
    d, texts = stream(decode, ids, stop_strings=[stop])
    assert d.stopped_by == stop
    assert d.text == "Hell"
    assert len(texts) == 2  # found on the token that completes it, " world"
    assert d.visible_text(finished=True) == "Hell"


def test_include_stop_str_keeps_the_stop_string(decode, smollm_tokenizer):
    ids = smollm_tokenizer.encode("Hello world, this is a test.", add_special_tokens=False)
    d, _ = stream(decode, ids, stop_strings=["o wor"], include_stop_str=True)
    assert d.stopped_by == "o wor"
    assert d.text == "Hello wor"  # cut right after the stop string, even mid-token


def test_stop_string_spanning_three_tokens(decode, smollm_tokenizer):
    text = "alpha beta gamma delta epsilon"
    ids = smollm_tokenizer.encode(text, add_special_tokens=False)
    stop = "a beta gamma d"
    d, texts = stream(decode, ids, stop_strings=["zzz", stop])
    assert d.stopped_by == stop
    assert d.text == "alph"
    assert decode(ids[:len(texts)], True).startswith("alpha beta gamma d")
    assert not decode(ids[:len(texts) - 1], True).startswith("alpha beta gamma d")


def test_multibyte_stop_string_split_over_byte_tokens(decode, smollm_tokenizer):
    ids = byte_tokens(smollm_tokenizer, "say 世界 and 🙂 now")
    d, texts = stream(decode, ids, stop_strings=["界 and 🙂"])
    assert d.stopped_by == "界 and 🙂"
    assert d.text == "say 世"
    assert len(texts) == len("say 世界 and 🙂".encode())  # stops on the emoji's last byte


def test_stop_string_in_the_prompt_does_not_stop(decode, smollm_tokenizer):
    prompt = smollm_tokenizer.encode("please STOP", add_special_tokens=False)
    ids = smollm_tokenizer.encode(" and go on", add_special_tokens=False)
    d, _ = stream(decode, ids, prompt, stop_strings=["STOP"])
    assert d.stopped_by is None
    assert d.text == " and go on"


def test_no_stop_string_means_nothing_found(decode, smollm_tokenizer):
    ids = smollm_tokenizer.encode("one two three", add_special_tokens=False)
    d, _ = stream(decode, ids, stop_strings=["four"])
    assert d.stopped_by is None and d.text == "one two three"


# ---- held-back tail -------------------------------------------------------------------------

def test_visible_text_holds_back_a_possible_stop_prefix(decode, smollm_tokenizer):
    stop = "END!"
    text = "abc EN more EN here END! tail"
    ids = byte_tokens(smollm_tokenizer, text)  # one character per step
    d = IncrementalDetokenizer(decode, [], True, [stop], False)
    shown = []
    for t in ids:
        stopped = d.add(t)
        if stopped is not None:
            break
        visible = d.visible_text(finished=False)
        # Exactly the last len(stop) - 1 characters are withheld while unfinished...
        assert visible == d.text[:max(0, len(d.text) - (len(stop) - 1))]
        shown.append(visible)
    final = d.visible_text(finished=True)
    assert final == "abc EN more EN here "
    # ...so nothing shown is ever taken back, and no part of the stop string was ever shown.
    for s in shown:
        assert final.startswith(s)
    assert shown[-1] == "abc EN more EN here "  # with "abc EN more EN here END" decoded, "END" is held back


def test_visible_text_without_stop_strings_holds_nothing(decode, smollm_tokenizer):
    ids = smollm_tokenizer.encode("stream me now", add_special_tokens=False)
    d, _ = stream(decode, ids)
    assert d.visible_text(finished=False) == d.text == "stream me now"


def test_visible_text_is_always_a_prefix_of_the_final_text(decode, smollm_tokenizer):
    stops = ["世界。", "🙂 fine", "xyzzy"]
    for text in TEXTS + ["Hello 世界。 after"]:
        ids = smollm_tokenizer.encode(text, add_special_tokens=False)
        d = IncrementalDetokenizer(decode, [], True, stops, False)
        shown = []
        for t in ids:
            if d.add(t) is not None:
                break
            shown.append(d.visible_text(finished=False))
        final = d.visible_text(finished=True)
        for s in shown:
            assert final.startswith(s), (text, s, final)
            assert not any(stop in s for stop in stops)
        if d.stopped_by:
            assert d.stopped_by not in final and text.startswith(final + d.stopped_by)
