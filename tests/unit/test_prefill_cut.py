"""Anthropic prefill: the prompt is the conversation's generation prompt followed by the
prefill, whatever the prefill's text (a '<' that also starts the template's end-of-turn
markup, or text that also appears earlier in the conversation)."""
from pathlib import Path

import pytest

from dflash_server.server.prompt import PromptBuilder
from dflash_server.weights.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def builder(tmp_path_factory):
    from helpers.tiny import write_smol_tokenizer

    d = Path(tmp_path_factory.mktemp("tok"))
    write_smol_tokenizer(d)
    return PromptBuilder(Tokenizer.from_hf_dir(d, {}), None, 4096)


@pytest.fixture(scope="module")
def qwen3_builder(tiny_dir):
    return PromptBuilder(Tokenizer.from_hf_dir(tiny_dir("qwen3")), None, 4096)


@pytest.mark.parametrize("prefill", ["<", "end", "|", "im_end"])
def test_prefill_that_also_spells_end_of_turn_markup(builder, prefill):
    q = [{"role": "user", "content": "Write XML."}]
    head = builder.chat(q).text   # ... "<|im_start|>assistant\n"
    p = builder.chat(q + [{"role": "assistant", "content": prefill, "_continue": True}])
    assert p.text == head + prefill, "the prompt was cut inside the template's '<|im_end|>'"
    assert p.ids == builder.tokenizer.encode(head + prefill, add_bos=False)


def test_prefill_changed_by_the_template_is_not_found_in_an_earlier_message(qwen3_builder):
    # Qwen3's template lstrips '\n' from assistant content; the same text in the user's
    # message must not become the cut point (the prompt would end inside the user's turn)
    msgs = [{"role": "user", "content": "Say:\n\n\nYes. Then explain."},
            {"role": "assistant", "content": "\n\n\nYes", "_continue": True}]
    try:
        p = qwen3_builder.chat(msgs)
    except Exception:  # noqa: BLE001 - a 400 (cannot continue) is an acceptable answer
        return
    assert p.text.rstrip().endswith("Yes") and "assistant" in p.text[p.text.rfind("<|im_start|>"):], p.text
