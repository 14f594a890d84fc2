"""Hostile or inconsistent Laguna (MoE) checkpoints: a clear error at load, never a crash or
a silently wrong model; the CLI prints one line for them."""
import json
import shutil

import gguf
import pytest

from dflash_server.errors import ModelLoadError
from helpers.build import pipeline
from helpers.gguf_export import export_gguf
from helpers.qwen_tokenizer import gguf_tokenizer_metadata_from_hf
from unit.test_cli_errors import assert_clean_error, gen


def _edited(tiny_dir, tmp_path, **changes):
    dst = tmp_path / "m"
    shutil.copytree(tiny_dir("laguna"), dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("changes,needle", [
    ({"num_attention_heads_per_layer": [4, 8]}, "head counts"),
    ({"num_attention_heads_per_layer": [4, 8, 7, 4]}, "multiples of num_kv_heads"),
    ({"moe_apply_router_weight_on_input": True}, "moe_apply_router_weight_on_input"),
    ({"num_experts_per_tok": 9}, "experts per token"),
    ({"mlp_layer_types": ["dense", "sparse", "mixed", "sparse"]}, "mlp layer types"),
    ({"gating": "per-element"}, "g_proj has 4 outputs"),      # the weights are per head
    ({"num_experts": 16}, "experts.8"),                       # more experts than the file holds
    ({"moe_intermediate_size": 48}, "shape"),
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "rope_theta": 1e4}}}, "yarn"),
    ({"rope_parameters": {"full_attention": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}},
     "not supported"),
])
def test_inconsistent_config_is_a_clear_error(tiny_dir, tmp_path, changes, needle):
    path = _edited(tiny_dir, tmp_path, **changes)
    with pytest.raises((ModelLoadError, ValueError)) as e:
        pipeline(path)
    assert needle.lower() in str(e.value).lower(), str(e.value)


def test_cli_reports_a_bad_moe_config_in_one_line(tiny_dir, tmp_path):
    assert_clean_error(gen(_edited(tiny_dir, tmp_path, num_experts_per_tok=0)), "experts per token")


def test_gguf_with_fewer_stacked_experts_than_declared(tiny_dir, tmp_path):
    """A GGUF whose expert_count says more experts than its stacked tensors hold."""
    src = tiny_dir("laguna", moe_router_logit_softcapping=0.0)
    path = export_gguf(src, tmp_path / "l.gguf", "laguna", gguf_tokenizer_metadata_from_hf(src, pre="smollm"))
    reader = gguf.GGUFReader(str(path), "r+")
    field = reader.fields["laguna.expert_count"]
    field.parts[field.data[0]][0] = 12  # in place: 8 experts stored
    del reader
    with pytest.raises(ModelLoadError, match="has no matrix 8"):
        pipeline(path)
