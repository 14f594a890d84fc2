"""Grammar-constrained decoding with llguidance: a token mask per sequence.

A request may carry a grammar (llguidance's JSON form: a JSON schema, a Lark grammar or a
regex; ``json_schema_grammar`` builds the first). Its sequence gets a ``Constraint``: before
each token is chosen, the tokens the grammar cannot take next are masked out of the logits
(llguidance computes the mask in ~25 us for a 49k vocabulary); the chosen token then
advances the grammar. Every token of a sequence goes through ``Sequence.commit`` in order,
plain, batched or speculative, so under DFlash a drafted token the grammar forbids is never
the target's choice (a rejection) and the grammar only ever consumes committed tokens:
nothing to roll back, and output with a draft equals output without.

llguidance (MIT, Microsoft's guidance project) was chosen over xgrammar for its footprint:
one 3 MB wheel with no dependencies (xgrammar pulls transformers, triton and more), a
mask in tens of microseconds on CPU, and JSON schema, Lark and regex grammars.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict

import numpy as np
import torch


def json_schema_grammar(schema: dict | None) -> str:
    """A grammar for JSON output: any object when ``schema`` is None (``json_object``).
    Whitespace between tokens is fixed (none: ``,`` and ``:``), not free: a free-whitespace
    grammar lets a weak model spend its whole budget on blank lines inside the object."""
    import llguidance

    return llguidance.LLMatcher.grammar_from_json_schema(schema if schema is not None else {"type": "object"},
                                                         defaults={"whitespace_flexible": False})


class GrammarCompiler:
    """The tokenizer as llguidance sees it (built once, on the first constrained request:
    ~0.4 s for a 49k vocabulary) and grammar checks against it. Thread-safe."""

    READY = 8  # compiled grammars kept for the requests that checked them

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._ll = None
        self._lock = threading.Lock()
        self._ready: OrderedDict[str, object] = OrderedDict()

    @property
    def ll_tokenizer(self):
        with self._lock:
            if self._ll is None:
                import llguidance

                ll = llguidance.LLTokenizer(self.tokenizer.tok.to_str(), n_vocab=self.vocab_size,
                                            eos_token=list(self.tokenizer.eos_token_ids))
                # tokens llguidance holds as special (added ones such as Qwen's </tool_call>,
                # EOS aside): a grammar must name them as tokens (``lark_text``)
                eos = set(ll.eos_tokens)
                self.special = torch.tensor([ll.is_special_token(t) and t not in eos
                                             for t in range(ll.vocab_size)] +
                                            [False] * max(0, self.vocab_size - ll.vocab_size))[:self.vocab_size]
                self._ll = ll
            return self._ll

    def lark_text(self, text: str) -> str:
        """``text`` as a Lark terminal: the token when this vocabulary has it as one token
        llguidance holds special (Qwen's ``<tool_call>``: its mask and its parser disagree
        about such a token spelled out as a string), else the quoted string."""
        tid = self.tokenizer.tok.token_to_id(text)
        _ = self.ll_tokenizer  # (builds ``special``)
        if tid is not None and tid < len(self.special) and bool(self.special[tid]):
            return f"<[{tid}]>"
        return json.dumps(text)

    def check(self, grammar: str) -> None:
        """Compile ``grammar`` as the engine will use it (its limits included), or raise
        ValueError with llguidance's message. Call it off the engine's thread: a large schema
        takes seconds to compile, and ``constraint`` then starts from this compiled matcher
        instead of compiling again on the thread every sequence waits on."""
        import llguidance

        with self._lock:
            if grammar in self._ready:
                self._ready.move_to_end(grammar)
                return
        if grammar.lstrip().startswith("{"):  # llguidance's JSON form (else a Lark grammar)
            try:
                json.loads(grammar)
            except (ValueError, RecursionError):
                raise ValueError("grammar: not JSON (or nested too deeply)") from None
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, limits=_limits())
        if matcher.is_error():
            raise ValueError(f"grammar: {matcher.get_error()[:500]}")
        with self._lock:
            self._ready[grammar] = matcher
            while len(self._ready) > self.READY:
                self._ready.popitem(last=False)

    def constraint(self, grammar: str) -> "Constraint":
        with self._lock:
            ready = self._ready.get(grammar)
        if ready is not None:
            return Constraint(self.ll_tokenizer, grammar, self.vocab_size, ready.deep_copy())
        return Constraint(self.ll_tokenizer, grammar, self.vocab_size)


def _limits():
    """Work bounds per grammar: llguidance's defaults let a pathological pattern (e.g.
    ``(a+)+$``) take 3 s to start and 16 ms a token on the engine's thread; with these it
    takes 1.4 ms and 0.2 ms, ordinary schemas are unaffected, and a grammar that needs more
    fails its own request with llguidance's message."""
    import llguidance

    return llguidance.LLParserLimits(initial_lexer_fuel=200_000, step_lexer_fuel=50_000, max_lexer_states=50_000)


class Constraint:
    def __init__(self, ll_tokenizer, grammar: str, vocab_size: int, matcher=None):
        """``matcher``: one compiled already (GrammarCompiler.check), in its start state."""
        import llguidance
        # (not llguidance.torch: its import pulls in torch._dynamo, seconds on the first
        # constrained request, on the engine's thread)
        import llguidance.numpy as lt

        self.matcher = matcher if matcher is not None else llguidance.LLMatcher(ll_tokenizer, grammar,
                                                                                limits=_limits())
        if self.matcher.is_error():
            raise ValueError(f"grammar: {self.matcher.get_error()[:500]}")
        self._fill = lt.fill_next_token_bitmask
        self.bitmask = lt.allocate_token_bitmask(1, vocab_size)
        self.vocab_size = vocab_size

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """(V,) logits with every token the grammar cannot take next at -inf (a copy)."""
        self._fill(self.matcher, self.bitmask, 0)
        if self.matcher.is_error():
            raise ValueError(f"grammar: {self.matcher.get_error()[:300]}")
        # bit t % 32 of word t // 32 allows token t: unpacked by numpy in a few microseconds
        # (llguidance's own apply is a torch.compile'd kernel: 1.5 s to compile on the
        # first request, and a compile is not something a request should wait for)
        bits = np.unpackbits(self.bitmask.view(np.uint8), bitorder="little")[:self.vocab_size]
        allowed = torch.from_numpy(bits).to(device=logits.device, dtype=torch.bool)
        return logits.float().masked_fill(~allowed, float("-inf"))

    def consume(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise ValueError(f"grammar: token {token} was not allowed ({self.matcher.get_error()[:300]})")

    @property
    def stopped(self) -> bool:
        """The grammar admits nothing more (the output is complete)."""
        return self.matcher.is_stopped()
