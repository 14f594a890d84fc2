"""A tokenizer_config.json whose chat_template is not a string (nor HF's list of
{"name", "template"} objects) is one clean ModelLoadError naming the file and the field, not
a TypeError / AttributeError traceback at load, or a template that fails every chat request."""
import json
from pathlib import Path

import pytest

from dflash_server.errors import ModelLoadError
from dflash_server.weights.tokenizer import Tokenizer


@pytest.mark.parametrize("template", [5, ["<|im_start|>"], {"default": "x"}, [{"name": "default", "template": 7}]])
def test_non_string_chat_template_is_a_load_error(tmp_path, template):
    from helpers.tiny import write_smol_tokenizer

    write_smol_tokenizer(Path(tmp_path))
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="tokenizer_config.json: chat_template"):
        Tokenizer.from_hf_dir(Path(tmp_path), {})


def test_named_templates_still_load(tmp_path):
    from helpers.tiny import write_smol_tokenizer

    write_smol_tokenizer(Path(tmp_path))
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert Tokenizer.from_hf_dir(Path(tmp_path), {}).chat_template == "D"
