"""Chat-turn boundaries of a rendered prompt.

A boundary is the position just after an end-of-turn marker (``<|im_end|>``,
``<|eot_id|>``, ``<end_of_turn>``, ``</s>`` ... as the tokenizer defines them), including a
directly following newline token, so that the prefix up to it is exactly what the next
request in the same conversation starts with.
"""
from __future__ import annotations

END_OF_TURN_TEXTS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "</s>", "<|endoftext|>",
                     "<turn|>", "<|END_OF_TURN_TOKEN|>")


class TurnBoundaries:
    def __init__(self, tokenizer):
        ids = set()
        for text in END_OF_TURN_TEXTS:
            tid = tokenizer.tok.token_to_id(text)
            if tid is not None:
                ids.add(tid)
        ids.update(tokenizer.eos_token_ids)
        self.end_ids = frozenset(ids)
        self.newline_ids = frozenset(i for i in (tokenizer.tok.token_to_id(t) for t in ("\n", "Ċ", "<0x0A>"))
                                     if i is not None)

    def find(self, token_ids) -> list[int]:
        out = []
        n = len(token_ids)
        for i, t in enumerate(token_ids):
            if t in self.end_ids:
                b = i + 1
                if b < n and token_ids[b] in self.newline_ids:
                    b += 1
                out.append(b)
        return out
