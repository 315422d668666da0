from __future__ import annotations

import pytest

from optkit.serve.detokenize import IncrementalDetokenizer

MULTIBYTE = "Hi 👋🏽 there — 世界, naïve café! 🚀\nok 日本語"


def _prompt(tok) -> list[int]:
    text = tok.apply_chat_template([{"role": "user", "content": "say hi"}], tokenize=False, add_generation_prompt=True)
    return tok.encode(text)


def _stream(det: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    pieces = [det.push(t) for t in ids]
    pieces.append(det.finish())
    return pieces


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_streamed_text_equals_full_decode_with_multibyte_characters(tokenizer, skip_special_tokens):
    out_ids = tokenizer.encode(MULTIBYTE) + tokenizer.encode("<|im_end|>")  # ends with a special token
    assert len(out_ids) > len(MULTIBYTE)  # multi-byte characters span several byte tokens
    det = IncrementalDetokenizer(tokenizer, _prompt(tokenizer), skip_special_tokens=skip_special_tokens)
    pieces = _stream(det, out_ids)
    expected = tokenizer.decode(out_ids, skip_special_tokens=skip_special_tokens)
    assert "".join(pieces) == expected == det.text
    assert all("\ufffd" not in p for p in pieces)  # never a partial character
    assert "" in pieces[:-1]  # some pushes waited for the rest of a character
    assert "👋" in pieces and "世" in pieces  # and then emitted it whole
    assert pieces[-1] == "" and not det.stopped


def test_empty_prompt_and_prefix_invariant(tokenizer):
    out_ids = tokenizer.encode(" 世界 ok")
    det = IncrementalDetokenizer(tokenizer, [])
    streamed = ""
    for t in out_ids:
        streamed += det.push(t)
        assert tokenizer.decode(out_ids).startswith(streamed)
    assert streamed + det.finish() == tokenizer.decode(out_ids)


def test_trailing_incomplete_character_is_flushed_like_decode(tokenizer):
    out_ids = tokenizer.encode("ok 🚀")[:-2]  # cut the emoji's last two bytes
    det = IncrementalDetokenizer(tokenizer, _prompt(tokenizer))
    pieces = _stream(det, out_ids)
    assert "".join(pieces[:-1]) == "ok "
    assert "".join(pieces) == tokenizer.decode(out_ids)
    assert pieces[-1].startswith("\ufffd")


def test_no_stop_strings_holds_nothing_back(tokenizer):
    det = IncrementalDetokenizer(tokenizer, _prompt(tokenizer))
    assert [det.push(t) for t in tokenizer.encode("abc")] == ["a", "b", "c"]
    assert det.finish() == ""


def test_finish_releases_held_back_text_when_no_stop_matched(tokenizer):
    det = IncrementalDetokenizer(tokenizer, _prompt(tokenizer), stop=("XYZ",))
    assert [det.push(t) for t in tokenizer.encode("abcXY")] == ["", "", "a", "b", "c"]
    assert det.finish() == "XY"
    assert det.text == "abcXY" and not det.stopped


def test_stop_string_split_over_several_tokens(tokenizer):
    ids = tokenizer.encode("Hello world STOP and more")
    det = IncrementalDetokenizer(tokenizer, _prompt(tokenizer), stop=("STOP",))
    streamed = ""
    for t in ids:
        streamed += det.push(t)
        assert "Hello world ".startswith(streamed)  # never a partial "S", "ST", "STO"
        if det.stopped:
            break
    assert det.stopped and det.text == "Hello world "
    assert streamed + det.finish() == "Hello world "
    assert det.push(ids[-1]) == "" and det.text == "Hello world "  # nothing after a stop


def test_stop_string_with_multibyte_characters(tokenizer):
    ids = tokenizer.encode("ok 世界 next")
    det = IncrementalDetokenizer(tokenizer, _prompt(tokenizer), stop=("世界",))
    assert "".join(_stream(det, ids)) == "ok " == det.text
    assert det.stopped


def test_stop_at_the_very_first_token(tokenizer):
    ids = tokenizer.encode("Hello")
    det = IncrementalDetokenizer(tokenizer, _prompt(tokenizer), stop=("H", "zzz"))
    assert det.push(ids[0]) == ""
    assert det.stopped and det.text == ""
    assert [det.push(t) for t in ids[1:]] == ["", "", "", ""]
    assert det.finish() == ""


@pytest.mark.parametrize("stop", [("world", "ld"), ("ld", "world"), ("o w", "world", "ld")])
def test_earliest_stop_match_wins(tokenizer, stop):
    det = IncrementalDetokenizer(tokenizer, _prompt(tokenizer), stop=stop)
    streamed = "".join(_stream(det, tokenizer.encode("Hello world!")))
    expected = "Hell" if "o w" in stop else "Hello "
    assert streamed == det.text == expected and det.stopped


def test_stop_matches_within_one_multi_character_token(tokenizer):
    # a special token decodes to many characters at once; a stop inside it still truncates
    ids = tokenizer.encode("ab") + tokenizer.encode("<|im_end|>") + tokenizer.encode("cd")
    det = IncrementalDetokenizer(tokenizer, [], stop=("im_e",), skip_special_tokens=False)
    assert "".join(_stream(det, ids)) == "ab<|" == det.text


def test_rejects_empty_stop_string(tokenizer):
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(tokenizer, [], stop=("",))


@pytest.mark.real_model
def test_real_byte_level_bpe_tokenizer():
    """SmolLM2's GPT-2-style BPE (with merges) from the embedded GGUF: multi-character
    tokens and emoji split across merged byte tokens."""
    from transformers import AutoTokenizer

    from optkit.checkpoint.default import find_default_gguf

    gguf = find_default_gguf()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    prompt = tok.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    text = MULTIBYTE + " The quick brown fox 🦊 jumps.  Ünïcödé ✓✓ 中文字符 end"
    out_ids = tok.encode(text) + [tok.convert_tokens_to_ids("<|im_end|>")]
    for skip in (True, False):
        det = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
        pieces = _stream(det, out_ids)
        assert "".join(pieces) == tok.decode(out_ids, skip_special_tokens=skip)
        assert all("\ufffd" not in p for p in pieces)
    det = IncrementalDetokenizer(tok, prompt, stop=("brown fox",))
    assert "".join(_stream(det, out_ids)) == text[: text.index("brown fox")] == det.text
