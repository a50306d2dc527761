"""Byte-level tokenizer: a token is one byte, so the vocabulary is exactly 256.

Why bytes: no merges to learn, no files to ship, and any text (any Unicode, any
binary junk) encodes. The price is longer sequences, which a tiny model with a
512-byte context can afford. Decoding uses ``errors="replace"`` so that a
sequence cut in the middle of a multibyte UTF-8 character (as a streaming
decoder sees all the time) never raises.
"""
from __future__ import annotations

VOCAB_SIZE = 256


def encode(text: str | bytes) -> list[int]:
    """Text (or raw bytes) -> list of byte values in [0, 256)."""
    if isinstance(text, str):
        text = text.encode("utf-8", errors="surrogatepass")   # any str, even a lone surrogate ("\ud800")
    elif not isinstance(text, (bytes, bytearray)):
        raise TypeError(f"encode() takes str or bytes, not {type(text).__name__}")
    return list(text)


def decode_bytes(ids) -> bytes:
    """Token ids -> the raw bytes they stand for."""
    ids = [int(i) for i in ids]
    bad = [i for i in ids if not 0 <= i < VOCAB_SIZE]
    if bad:
        raise ValueError(f"token ids must lie in [0, {VOCAB_SIZE}); got {bad[:5]}")
    return bytes(ids)


def decode(ids) -> str:
    """Token ids -> text; an incomplete or invalid UTF-8 sequence becomes U+FFFD."""
    return decode_bytes(ids).decode("utf-8", errors="replace")
