"""Server settings (frozen, validated); the ``serve`` command's defaults come from here."""
from __future__ import annotations

from dataclasses import dataclass, field


# llama.cpp's defaults, what users of a local server expect when neither the request nor
# the model says otherwise (the APIs' own 1.0 with no truncation makes small models ramble)
LLAMA_CPP_SAMPLING = {"temperature": 0.8, "top_p": 0.95, "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.0}


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    model_name: str = "dflash"
    model_aliases: tuple[str, ...] = ()     # other names accepted in "model"; "*" accepts any
    api_key: str | None = None
    cors_origins: tuple[str, ...] = ()      # empty: CORS off
    allowed_hosts: tuple[str, ...] = ()     # Host names beyond loopback ones (see hosts.py)
    default_max_tokens: int = 4096          # when a request gives none (clamped to what fits)
    # sampling when a request gives none: these if set (flags), else the model's own
    # (generation_config.json / GGUF metadata), else llama.cpp's (LLAMA_CPP_SAMPLING)
    default_temperature: float | None = None
    default_top_p: float | None = None
    default_top_k: int | None = None
    default_min_p: float | None = None
    default_repetition_penalty: float | None = None
    max_queue: int = 64                     # requests waiting behind the running one
    max_body_bytes: int = 8 * 1024 * 1024    # requests are rejected by size before tokenizing too
    chat_template: str | None = None        # overrides the model's template
    shutdown_grace_s: float = 10.0          # SIGTERM: in-flight work gets this long, then is cancelled
    log_requests: bool = False
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        def check(name, ok, what):
            if not ok:
                raise ValueError(f"{name} must be {what}, got {getattr(self, name)!r}")
        check("port", 0 <= self.port <= 65535, "in [0, 65535]")
        check("model_name", bool(self.model_name) and len(self.model_name) <= 256, "a non-empty name")
        check("default_max_tokens", self.default_max_tokens >= 1, ">= 1")
        check("max_queue", self.max_queue >= 0, ">= 0")
        def optional(name, low, high):
            v = getattr(self, name)
            check(name, v is None or low <= v <= high, f"in [{low}, {high}]")
        optional("default_temperature", 0, 2)
        optional("default_top_p", 1e-6, 1)
        optional("default_top_k", 0, 1_000_000)
        optional("default_min_p", 0, 1)
        optional("default_repetition_penalty", 1e-6, 10)
        check("max_body_bytes", self.max_body_bytes >= 1024, ">= 1024")
        check("shutdown_grace_s", self.shutdown_grace_s >= 0, ">= 0")
        check("api_key", self.api_key is None or len(self.api_key) >= 1, "non-empty")

    def sampling_defaults(self, model: dict) -> tuple[dict, dict]:
        """(value, source) per sampling field: "flag", "model" or "llama.cpp"."""
        values, sources = {}, {}
        for key, fallback in LLAMA_CPP_SAMPLING.items():
            flag = getattr(self, f"default_{key}")
            values[key], sources[key] = ((flag, "flag") if flag is not None else
                                         (model[key], "model") if key in model else (fallback, "llama.cpp"))
        return values, sources

    def accepts_model(self, name: str | None) -> bool:
        return (not name or name == self.model_name or name in self.model_aliases
                or "*" in self.model_aliases)
