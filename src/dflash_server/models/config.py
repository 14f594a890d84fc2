"""Architecture description shared by all families (parsed from HF config.json or GGUF)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    rope_scaling: dict | None = None
    partial_rotary_factor: float = 1.0
    attention_bias: bool = False
    qk_norm: bool = False
    attn_output_gate: bool = False
    zero_centred_norm: bool = False
    # one entry per layer: "full_attention" | "sliding_attention" | "linear_attention"
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    # Gated DeltaNet (linear attention) sizes
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    # Gemma: attention scale query_pre_attn_scalar ** -0.5 (default head_dim), sliding layers'
    # own RoPE base, GELU-tanh MLP, embeddings times sqrt(hidden), norms after the attention and
    # the MLP too ("sandwich"), logits soft-capped
    query_pre_attn_scalar: float | None = None
    rope_local_theta: float | None = None
    hidden_act: str = "silu"
    embed_scale: bool = False
    sandwich_norms: bool = False
    final_logit_softcapping: float | None = None
    # per-layer query head counts (Laguna; empty: num_heads everywhere); the sliding layers'
    # own partial rotary factor and scaling (Laguna: full layers rotate half the head with
    # YaRN, sliding ones all of it, plainly)
    heads_per_layer: tuple[int, ...] = ()
    # full-attention layers' own head size and KV heads (Gemma 4's global layers), and their
    # values read from the key projection (attention_k_eq_v)
    head_dim_full: int | None = None
    num_kv_heads_full: int | None = None
    attention_k_eq_v: bool = False
    # Gemma 4 E2B / E4B: per-layer input embeddings (size per layer, their vocabulary) and the
    # last layers attending over the KV of the last earlier layer of their type
    per_layer_input_size: int = 0
    per_layer_vocab_size: int = 0
    num_kv_shared_layers: int = 0
    local_partial_rotary_factor: float | None = None
    rope_local_scaling: dict | None = None
    # attention output gate softplus(g_proj(x)) (Laguna): "" | "per_head" | "per_element"
    attn_softplus_gate: str = ""
    # mixture of experts (Laguna): per-layer "dense" | "sparse", sigmoid router with a selection
    # bias, top-k weights normalised, scaled, plus an always-on shared expert
    mlp_layer_types: tuple[str, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    moe_routed_scaling_factor: float = 1.0
    moe_router_softcap: float = 0.0
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model config: num_heads {self.num_heads} not divisible by num_kv_heads "
                             f"{self.num_kv_heads}")
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full_attention",) * self.num_layers)
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"model config: {len(self.layer_types)} layer_types for {self.num_layers} layers")
        bad = set(self.layer_types) - {"full_attention", "sliding_attention", "linear_attention"}
        if bad:
            raise ValueError(f"model config: unknown layer types {sorted(bad)}")
        if "sliding_attention" in self.layer_types and not (self.sliding_window or 0) > 0:
            raise ValueError("model config: sliding-window layers need a positive sliding_window")
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise ValueError(f"model config: unsupported activation {self.hidden_act!r}")
        if self.heads_per_layer:
            if len(self.heads_per_layer) != self.num_layers:
                raise ValueError(f"model config: {len(self.heads_per_layer)} head counts for {self.num_layers} layers")
            if any(int(h) <= 0 or int(h) % self.num_kv_heads for h in self.heads_per_layer):
                raise ValueError(f"model config: per-layer head counts {list(self.heads_per_layer)} must be positive "
                                 f"multiples of num_kv_heads {self.num_kv_heads}")
        if not 0 <= self.num_kv_shared_layers < self.num_layers:
            raise ValueError(f"model config: {self.num_kv_shared_layers} KV-shared layers of {self.num_layers}")
        for i in range(self.num_layers - self.num_kv_shared_layers, self.num_layers):
            self.kv_source(i)
        if self.attn_softplus_gate not in ("", "per_head", "per_element"):
            raise ValueError(f"model config: unknown attention gate {self.attn_softplus_gate!r}")
        if self.mlp_layer_types:
            if len(self.mlp_layer_types) != self.num_layers:
                raise ValueError(f"model config: {len(self.mlp_layer_types)} mlp_layer_types for "
                                 f"{self.num_layers} layers")
            if set(self.mlp_layer_types) - {"dense", "sparse"}:
                raise ValueError(f"model config: unknown mlp layer types {sorted(set(self.mlp_layer_types))}")
            if "sparse" in self.mlp_layer_types and not (
                    0 < self.num_experts_per_tok <= self.num_experts and self.moe_intermediate_size > 0):
                raise ValueError(f"model config: MoE layers need 0 < experts per token ({self.num_experts_per_tok}) "
                                 f"<= experts ({self.num_experts}) and a positive expert size")

    def heads(self, layer: int) -> int:
        """Query heads of one layer."""
        return int(self.heads_per_layer[layer]) if self.heads_per_layer else self.num_heads

    def kv_source(self, layer: int) -> int | None:
        """The layer whose KV a KV-shared layer attends over (the last layer of its type
        before the shared ones); None for a layer with its own KV."""
        first = self.num_layers - self.num_kv_shared_layers
        if not self.num_kv_shared_layers or layer < first:
            return None
        kind = self.layer_types[layer]
        src = next((i for i in range(first - 1, -1, -1) if self.layer_types[i] == kind), None)
        if src is None:
            raise ValueError(f"model config: KV-shared layer {layer} ({kind}) has no earlier {kind} layer to share")
        return src

    def kv_groups(self) -> tuple[tuple[int, int], ...]:
        """Inclusive layer ranges one shard must hold whole: the KV-shared layers with their
        sources (placement never cuts them)."""
        if not self.num_kv_shared_layers:
            return ()
        first = self.num_layers - self.num_kv_shared_layers
        return ((min(self.kv_source(i) for i in range(first, self.num_layers)), self.num_layers - 1),)

    def layer_head_dim(self, layer: int) -> int:
        full = self.layer_types[layer] == "full_attention"
        return self.head_dim_full if full and self.head_dim_full else self.head_dim

    def layer_kv_heads(self, layer: int) -> int:
        full = self.layer_types[layer] == "full_attention"
        return self.num_kv_heads_full if full and self.num_kv_heads_full else self.num_kv_heads

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def local_rotary_dim(self) -> int:
        """Rotated dims of the sliding layers' own RoPE (``rope_local_theta``)."""
        f = self.partial_rotary_factor if self.local_partial_rotary_factor is None else self.local_partial_rotary_factor
        return int(self.head_dim * f)


def rope_from_hf(cfg: dict) -> tuple[float, dict | None, float]:
    """(theta, scaling, partial_rotary_factor) from either the flat keys or ``rope_parameters``."""
    params = dict(cfg.get("rope_parameters") or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling") or None
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = params
    partial = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    return theta, scaling, partial


def eos_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)
