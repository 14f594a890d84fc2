"""llguidance checks on the smol tokenizer: does a grammar accept a text, start to finish."""
from __future__ import annotations

import tempfile
from functools import lru_cache
from pathlib import Path


@lru_cache(maxsize=1)
def smol_compiler():
    """(GrammarCompiler, Tokenizer) for the SmolLM2 vocabulary (49,152 tokens)."""
    from dflash_server.engine.grammar import GrammarCompiler
    from dflash_server.weights.tokenizer import Tokenizer

    from .tiny import write_smol_tokenizer

    with tempfile.TemporaryDirectory() as d:
        write_smol_tokenizer(Path(d))
        tok = Tokenizer.from_hf_dir(Path(d), {})
    return GrammarCompiler(tok, tok.vocab_size), tok


def accepts(grammar: str, text: str) -> bool:
    import llguidance

    comp, tok = smol_compiler()
    m = llguidance.LLMatcher(comp.ll_tokenizer, grammar)
    return m.consume_tokens(tok.encode(text, add_bos=False)) and m.is_accepting()
