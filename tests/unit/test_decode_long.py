"""``Tokenizer.decode_long`` (huge /detokenize requests, in pieces so /health stays
responsive) equals ``decode`` exactly: pieces cut inside multi-byte characters, inside merges
and after leading-space rules, on a byte-level BPE and a Qwen vocabulary."""
import random
from pathlib import Path

import pytest

from dflash_server.weights.tokenizer import Tokenizer


@pytest.fixture(scope="module", params=["smol", "qwen3_5"])
def tok(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    if request.param == "smol":
        from helpers.tiny import write_smol_tokenizer
        write_smol_tokenizer(Path(d))
    else:
        from helpers.qwen_tokenizer import write_qwen_tokenizer
        write_qwen_tokenizer(Path(d), "qwen3_5")
    return Tokenizer.from_hf_dir(Path(d), {})


def test_pieces_join_to_the_whole_decode(tok):
    rng = random.Random(0)
    text = "héllo wörld 🌍 日本語 — \n  x" * 100 + "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(1500))
    for ids in (tok.encode(text), [rng.randrange(tok.vocab_size) for _ in range(6000)], [42] * 3000):
        for chunk in (7, 97, 1000):
            assert tok.decode_long(ids, chunk=chunk) == tok.decode(ids), chunk
    assert tok.decode_long([]) == ""
