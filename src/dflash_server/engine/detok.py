"""Incremental detokenization that never emits half a UTF-8 character.

Byte-level BPE splits multi-byte characters across tokens; decoding token by token would
print U+FFFD. We re-decode a small window and only emit text once it no longer ends in an
incomplete character.
"""
from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_ids: tuple[int, ...] = ()):
        self.tok = tokenizer
        self.skip = set(skip_ids)
        self.ids: list[int] = []
        self.prefix_offset = 0  # window start: decoding from here gives stable text
        self.read_offset = 0    # tokens before this have been emitted

    def push(self, token_id: int) -> str:
        """Add one token; return the newly completed text (maybe empty)."""
        if token_id in self.skip:
            return ""
        self.ids.append(token_id)
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset])
        full = self.tok.decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix):]
        return ""

    def flush(self) -> str:
        """Whatever is left at the end (an incomplete character is emitted as-is)."""
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset])
        full = self.tok.decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix):]
