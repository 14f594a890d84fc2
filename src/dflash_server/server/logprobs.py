"""Token log-probabilities in the Chat Completions, Completions and Responses shapes."""
from __future__ import annotations

import math
from functools import lru_cache

from ..engine.generate import TokenEvent


def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's byte -> printable character table (byte-level BPE vocabularies)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTES = _byte_decoder()


class TokenTexts:
    """id -> (text, utf-8 bytes) for one tokenizer, cached."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.lookup = lru_cache(maxsize=65536)(self._lookup)

    def _lookup(self, token_id: int) -> tuple[str, list[int]]:
        text = self.tokenizer.decode([token_id])
        piece = None
        tok = getattr(self.tokenizer, "tok", None)
        if tok is not None:
            piece = tok.id_to_token(token_id)
        if piece and all(ch in _BYTES for ch in piece):
            raw = bytes(_BYTES[ch] for ch in piece)  # byte-level BPE: exact bytes, even half characters
        elif piece and piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:
            raw = bytes([int(piece[3:5], 16)])
        else:
            raw = text.encode("utf-8")
        return text, list(raw)

    def text(self, token_id: int) -> str:
        return self.lookup(token_id)[0]

    def bytes(self, token_id: int) -> list[int]:
        return self.lookup(token_id)[1]


def _finite(x: float) -> float:
    # JSON has no -inf: an impossible token reports the most negative finite value instead
    return x if math.isfinite(x) else -9999.0


def chat_entries(events: list[TokenEvent], texts: TokenTexts) -> list[dict]:
    out = []
    for ev in events:
        top = [{"token": texts.text(i), "logprob": _finite(lp), "bytes": texts.bytes(i)}
               for i, lp in ev.top_logprobs or []]
        out.append({"token": texts.text(ev.token_id), "logprob": _finite(ev.logprob),
                    "bytes": texts.bytes(ev.token_id), "top_logprobs": top})
    return out


def completion_logprobs(events: list[TokenEvent], texts: TokenTexts, offset: int = 0) -> dict:
    tokens, lps, tops, offsets = [], [], [], []
    pos = offset
    for ev in events:
        t = texts.text(ev.token_id)
        tokens.append(t)
        lps.append(_finite(ev.logprob))
        tops.append({texts.text(i): _finite(lp) for i, lp in ev.top_logprobs or []})
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}
