"""Tokenizer wrapper and streaming detokenizer (official V4 tokenizer.json)."""

import random
import shutil

import pytest

from engine.tokenizer import IncrementalDetokenizer, Tokenizer, _bundled_tokenizer_json


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(None)


def test_special_ids_and_sizes(tok):
    assert tok.bos_id == 0 and tok.eos_id == 1
    assert tok.vocab_size == 129280
    assert tok.token_to_id("<｜User｜>") == 128803
    assert tok.token_to_id("<｜Assistant｜>") == 128804
    assert tok.token_to_id("<think>") == 128821
    assert tok.token_to_id("</think>") == 128822
    assert tok.token_to_id("｜DSML｜") == 128825
    assert tok.id_to_token(128822) == "</think>"
    assert tok.token_to_id("no such token") is None


def test_from_dir_variants(tmp_path):
    # A model dir without tokenizer.json falls back to the bundled copy.
    assert Tokenizer.from_dir(tmp_path).source == str(_bundled_tokenizer_json())
    shutil.copy(_bundled_tokenizer_json(), tmp_path / "tokenizer.json")
    assert Tokenizer.from_dir(tmp_path).source == str(tmp_path / "tokenizer.json")
    assert Tokenizer.from_dir(tmp_path / "tokenizer.json").eos_id == 1


def test_encode_recognises_special_strings(tok):
    ids = tok.encode("<｜User｜>hi<｜Assistant｜></think>")
    assert ids[0] == 128803 and ids[-2:] == [128804, 128822]
    assert tok.encode("hi", add_bos=True)[0] == 0
    assert tok.encode("hi")[0] != 0  # no BOS unless asked
    assert tok.encode("") == []


def test_decode_round_trip_and_skip(tok):
    text = "<｜begin▁of▁sentence｜>Hello, 世界! 😀<｜end▁of▁sentence｜>"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=True) == "Hello, 世界! 😀"


SAMPLES = [
    "深度求索的模型在推理时逐字输出。日本語のテキストもあります、カタカナ。",
    "emoji: 😀🎉🧑‍🚀👨‍👩‍👧‍👦🇯🇵🏳️‍🌈 done",
    "Mixed: naïve café — Ω≈ç√ 中文 and 한국어 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ∑ x² <think>ok</think> 𠀋𡈽",
    "",
]


def _stream(tok, ids, **kw):
    det = IncrementalDetokenizer(tok, **kw)
    deltas = [det.push(i) for i in ids]
    return deltas, det.flush()


@pytest.mark.parametrize("use_byte_table", [True, False])
@pytest.mark.parametrize("text", SAMPLES)
def test_stream_detokenize(tok, text, use_byte_table):
    ids = tok.encode(text)
    deltas, tail = _stream(tok, ids, use_byte_table=use_byte_table)
    for d in deltas:
        assert "\ufffd" not in d
        d.encode("utf-8")  # no lone surrogates / broken characters
    assert "".join(deltas) + tail == tok.decode(ids) == text
    assert tail == ""  # valid UTF-8: nothing left over


def test_multibyte_characters_span_tokens(tok):
    # The emoji sample really does split characters across tokens, and the
    # detokenizer holds those partial bytes back instead of emitting them.
    ids = tok.encode(SAMPLES[1])
    partial = [i for i in ids if b"\xef\xbf\xbd" in tok.decode([i]).encode()]
    assert partial, "expected some tokens holding incomplete UTF-8"
    deltas, _ = _stream(tok, ids)
    assert any(d == "" for d in deltas)


def test_skip_special_tokens_stream(tok):
    ids = tok.encode("<｜begin▁of▁sentence｜>你好<｜User｜>🙂<｜end▁of▁sentence｜>")
    for table in (True, False):
        deltas, tail = _stream(tok, ids, skip_special_tokens=True, use_byte_table=table)
        assert "".join(deltas) + tail == tok.decode(ids, skip_special_tokens=True)


def test_random_ids_match_full_decode(tok):
    # Random ids produce invalid byte soup; the stream must still equal the
    # full decode, U+FFFD placement included.
    rng = random.Random(1234)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 10))]
        for table in (True, False):
            deltas, tail = _stream(tok, ids, use_byte_table=table)
            assert "".join(deltas) + tail == tok.decode(ids)


def test_detokenizer_factory(tok):
    det = tok.detokenizer()
    out = "".join(det.push(i) for i in tok.encode("ok 👍")) + det.flush()
    assert out == "ok 👍" and det.ids == tok.encode("ok 👍")
