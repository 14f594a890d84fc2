"""Tokenizer wrapper: encode/decode, special ids, chat template (HF dir or GGUF)."""
from __future__ import annotations

import json
import time
from functools import cached_property
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from ..errors import ModelLoadError
from .chat_template import render_chat


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    def __init__(self, tok: HFTokenizer, *, bos_token_id: int | None, eos_token_ids: tuple[int, ...],
                 chat_template: str | None, add_bos: bool):
        self.tok = tok
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(dict.fromkeys(eos_token_ids))
        self.chat_template = chat_template
        self.add_bos = add_bos
        self.bos_token = tok.id_to_token(bos_token_id) if bos_token_id is not None else ""
        self.eos_token = tok.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else ""

    # --- construction -----------------------------------------------------------------
    @classmethod
    def from_hf_dir(cls, path: Path, model_cfg: dict | None = None) -> "Tokenizer":
        path = Path(path)
        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise ModelLoadError(f"{path}: no tokenizer.json")
        try:
            tok = HFTokenizer.from_file(str(tj))
        except Exception as e:
            raise ModelLoadError(f"{tj}: cannot load tokenizer ({e})") from None
        tc = {}
        if (path / "tokenizer_config.json").is_file():
            try:
                tc = json.loads((path / "tokenizer_config.json").read_text())
            except ValueError as e:
                raise ModelLoadError(f"{path}/tokenizer_config.json: {e}") from None
            if not isinstance(tc, dict):
                raise ModelLoadError(f"{path}/tokenizer_config.json: not a JSON object")
        template = tc.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            if not all(isinstance(t, dict) for t in template):
                raise ModelLoadError(f"{path}/tokenizer_config.json: chat_template is a list of something "
                                     "other than {\"name\", \"template\"} objects")
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        if template is not None and not isinstance(template, str):
            raise ModelLoadError(f"{path}/tokenizer_config.json: chat_template must be a string (or a list of "
                                 f"named templates), not {type(template).__name__}")
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        model_cfg = model_cfg or {}

        def tid(text):
            return tok.token_to_id(text) if text else None

        eos = []
        if tid(_token_text(tc.get("eos_token"))) is not None:
            eos.append(tid(_token_text(tc.get("eos_token"))))
        for src in (model_cfg, model_cfg.get("text_config") or {}):
            e = src.get("eos_token_id")
            eos.extend(e if isinstance(e, list) else ([e] if e is not None else []))
        bos = tid(_token_text(tc.get("bos_token")))
        if bos is None:
            bos = model_cfg.get("bos_token_id")
        return cls(tok, bos_token_id=bos, eos_token_ids=tuple(eos), chat_template=template,
                   add_bos=bool(tc.get("add_bos_token", False)) and bos is not None)

    @classmethod
    def from_gguf_meta(cls, meta: dict) -> "Tokenizer":
        from .gguf_tokenizer import tokenizer_from_gguf_metadata

        try:
            info = tokenizer_from_gguf_metadata(meta)
        except ValueError as e:
            raise ModelLoadError(f"GGUF tokenizer: {e}") from None
        eos = [info.eos_token_id] if info.eos_token_id is not None else []
        # chat models end turns with <|im_end|> / <end_of_turn> / <|eot_id|> even when the
        # file's eos says <|endoftext|>: stop on those too
        for text in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|endoftext|>"):
            if text in info.special_tokens:
                eos.append(info.special_tokens[text])
        return cls(info.tokenizer, bos_token_id=info.bos_token_id, eos_token_ids=tuple(eos),
                   chat_template=info.chat_template, add_bos=info.add_bos_token)

    # --- use --------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    @cached_property
    def max_token_chars(self) -> int:
        """The most characters one token stands for (special tokens included), plus one
        for a decoder that drops a word-start space (the first ``▁word`` piece)."""
        return max(len(self.tok.decode([i], skip_special_tokens=False)) for i in range(self.vocab_size)) + 1

    def max_chars(self, n_tokens: int) -> int:
        """No text longer than this encodes to ``n_tokens`` tokens or fewer, so a longer
        prompt can be refused without tokenizing it. A normalizer may shorten text before
        it is split (NFC composes a base and its marks into one character): 4x margin."""
        return n_tokens * self.max_token_chars * (1 if self.tok.normalizer is None else 4)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_long(self, ids: list[int], chunk: int = 65536, overlap: int = 8) -> str:
        """``decode`` of millions of ids in pieces, so that other threads run between them
        (the tokenizer holds the GIL for a whole call: 1.4 s for 3M ids). Equal to ``decode``:
        each piece is the text past what ``overlap`` ids before it decode to (so merges and
        leading-space rules see the same context), no piece ends inside a character (a piece
        whose text ends in a half character takes up to 4 more ids), and where a piece's
        context does not decode to a prefix of it the rest is decoded whole."""
        ids = list(ids)
        if len(ids) <= chunk:
            return self.decode(ids)
        out, a = [], 0
        while a < len(ids):
            b = min(len(ids), a + chunk)
            for _ in range(4):  # not inside a character
                if b >= len(ids) or not self.decode(ids[max(a, b - overlap):b]).endswith("\ufffd"):
                    break
                b += 1
            if a == 0:
                out.append(self.decode(ids[:b]))
            else:
                p = max(0, a - overlap)
                context, text = self.decode(ids[p:a]), self.decode(ids[p:b])
                if not text.startswith(context):
                    return self.decode(ids)  # (never seen; exact whatever the tokenizer does)
                out.append(text[len(context):])
            a = b
            time.sleep(0)  # let the event loop and other requests run
        return "".join(out)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template; pass --chat-template-file or use a raw prompt")
        return render_chat(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                           bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> list[int]:
        # the template writes BOS itself where the model wants one
        return self.encode(self.render_chat(messages, add_generation_prompt, **kwargs), add_bos=False)
