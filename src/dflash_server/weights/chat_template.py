"""Chat templates: the model's own Jinja template in a sandboxed environment.

Mirrors the environment Hugging Face uses (trim_blocks, lstrip_blocks, loop controls,
``raise_exception``, ``strftime_now``, a non-ASCII-preserving ``tojson``), so templates
written for transformers render identically; the sandbox denies attribute access to
Python internals, so a template cannot execute code.
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateError(ValueError):
    pass


def _raise(message):
    raise TemplateError(str(message))


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise TemplateError(f"chat template does not compile: {e}") from None


def render_chat(source: str, messages: list[dict], *, add_generation_prompt: bool = True,
                tools: list[dict] | None = None, bos_token: str = "", eos_token: str = "",
                **kwargs) -> str:
    try:
        return compile_template(source).render(
            messages=messages, tools=tools or None, add_generation_prompt=add_generation_prompt,
            bos_token=bos_token, eos_token=eos_token, **kwargs)
    except TemplateError:
        raise
    except jinja2.TemplateError as e:
        raise TemplateError(f"chat template failed: {e}") from None
