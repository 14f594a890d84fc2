"""Request fields shared by the APIs: bounded types and the sampling mixin.

Models are strict (no "5" -> 5 coercion) and ignore unknown fields, which is what the
official clients expect from a compatible server; fields whose meaning we cannot honour
are declared and rejected explicitly instead of being silently dropped.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints

from ..engine.sampling import SamplingParams
from .errors import bad_request
from .tool_schema import check_parameters

MAX_TOKENS_LIMIT = 10**9
ToolName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.:\-]{1,128}$")]
StopString = Annotated[str, StringConstraints(max_length=512)]
Json = dict[str, Any]
ToolSchema = Annotated[Json | None, AfterValidator(check_parameters)]  # a function's parameters


def output_grammar(kind: str, schema: Json | None, where: str) -> str | None:
    """The llguidance grammar for an output format: None for ``text``, any JSON object for
    ``json_object``, the schema for ``json_schema`` (its structure is checked here; whether
    llguidance can compile it, against the tokenizer, when the request is queued)."""
    if kind == "text":
        return None
    if kind == "json_schema" and not isinstance(schema, dict):
        raise bad_request("json_schema needs a schema (a JSON object)", where)
    from ..engine.grammar import json_schema_grammar

    try:
        return json_schema_grammar(schema if kind == "json_schema" else None)
    except (ValueError, TypeError, RecursionError) as e:  # (nesting deeper than Python's JSON allows)
        raise bad_request(f"{where}: the schema cannot be used: {type(e).__name__}: {str(e)[:300]}", where) \
            from None


class Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class PrefixCacheOption(Model):
    """Per-request prefix cache override: off (neither read nor written), memory (never
    written to disk), full (written to disk whatever its length)."""
    scope: Literal["off", "memory", "full"]


class PrefillCompressionOption(Model):
    """Per-request PFlash override (see pflash.policy.Override)."""
    mode: Literal["off", "auto", "always"] | None = None
    keep_ratio: float | None = Field(None, gt=0, le=1)
    threshold: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)


class CacheFields(Model):
    """The server's per-request extensions, on every endpoint."""
    prefix_cache: PrefixCacheOption | None = None
    prefill_compression: Literal["off", "auto", "always"] | PrefillCompressionOption | None = None
    session_id: Annotated[str, StringConstraints(min_length=1, max_length=256)] | None = None
    speculative: bool | None = None     # false: decode without the DFlash draft (where one is loaded)

    def engine_options(self) -> dict:
        """These fields as GenOptions arguments."""
        return {"cache_scope": self.cache_scope, "compression": self.compression, "session_id": self.session_id,
                "speculative": self.speculative is not False}

    @property
    def compression(self):
        """The request's PFlash override (pflash.policy.Override) or None."""
        from ..pflash.policy import Override

        v = self.prefill_compression
        if v is None:
            return None
        if isinstance(v, str):
            return Override(mode=v)
        return Override(v.mode, v.keep_ratio, v.threshold)

    @property
    def cache_scope(self) -> str | None:
        return self.prefix_cache.scope if self.prefix_cache is not None else None


class SamplingFields(CacheFields):
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=1_000_000)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)

    def sampling(self, defaults: dict) -> SamplingParams:
        """The request's sampling; each field it leaves out comes from ``defaults`` (the
        server's resolved defaults, ServerConfig.sampling_defaults)."""
        def pick(name):
            v = getattr(self, name)
            return defaults[name] if v is None else v
        try:
            return SamplingParams(
                temperature=float(pick("temperature")), top_p=max(float(pick("top_p")), 1e-6),  # 0: the top token
                top_k=max(0, int(pick("top_k"))), min_p=float(pick("min_p")),
                repetition_penalty=float(pick("repetition_penalty")),
                frequency_penalty=self.frequency_penalty or 0.0, presence_penalty=self.presence_penalty or 0.0,
                seed=None if self.seed is None else self.seed % 2**63)
        except ValueError as e:
            raise bad_request(str(e)) from None


def stop_list(stop: str | list[str] | None, limit: int, param: str = "stop") -> tuple[str, ...]:
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else list(stop)
    if len(items) > limit:
        raise bad_request(f"{param}: at most {limit} stop sequences, got {len(items)}", param)
    return tuple(dict.fromkeys(s for s in items if s))


def text_of_parts(content, param: str, allowed=("text", "input_text", "output_text")) -> str:
    """String content, or the text of a list of content parts (only text parts are supported)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        ptype = part.get("type") if isinstance(part, dict) else getattr(part, "type", None)
        text = part.get("text") if isinstance(part, dict) else getattr(part, "text", None)
        if ptype not in allowed or not isinstance(text, str):
            raise bad_request(f"{param}: content part type {ptype!r} is not supported (this server takes text)",
                              param)
        texts.append(text)
    return "\n".join(texts)
