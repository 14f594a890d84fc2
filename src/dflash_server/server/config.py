"""Server settings (frozen, validated); the ``serve`` command's defaults come from here."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    model_name: str = "dflash"
    model_aliases: tuple[str, ...] = ()     # other names accepted in "model"; "*" accepts any
    api_key: str | None = None
    cors_origins: tuple[str, ...] = ()      # empty: CORS off
    default_max_tokens: int = 4096          # when a request gives none (clamped to what fits)
    default_temperature: float = 1.0        # when a request gives none (the APIs' own default)
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
        check("default_temperature", 0 <= self.default_temperature <= 2, "in [0, 2]")
        check("max_body_bytes", self.max_body_bytes >= 1024, ">= 1024")
        check("shutdown_grace_s", self.shutdown_grace_s >= 0, ">= 0")
        check("api_key", self.api_key is None or len(self.api_key) >= 1, "non-empty")

    def accepts_model(self, name: str | None) -> bool:
        return (not name or name == self.model_name or name in self.model_aliases
                or "*" in self.model_aliases)
