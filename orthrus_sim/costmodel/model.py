"""Model catalogue built from Hugging Face ``config.json`` fields, and the embedding LoRA."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from orthrus_sim import read_structured

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class ModelSpec:
    """What the cost model needs of a decoder: shapes, and whether the MLP is gated."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tied_embeddings: bool = False
    qkv_bias: bool = False
    gated_mlp: bool = True
    max_position_embeddings: int = 4096
    dtype_bytes: int = 2
    architecture: str = "LlamaForCausalLM"

    @property
    def q_width(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def mlp_in_width(self) -> int:
        """Output width of the first MLP matmul (gate+up fused when gated)."""
        return self.intermediate_size * (2 if self.gated_mlp else 1)

    @property
    def params_per_layer(self) -> int:
        d = self.hidden_size
        attn = d * (self.q_width + 2 * self.kv_width) + self.q_width * d
        mlp = d * self.mlp_in_width + self.intermediate_size * d
        return attn + mlp + 2 * d

    @property
    def num_params(self) -> int:
        emb = self.vocab_size * self.hidden_size
        head = 0 if self.tied_embeddings else emb
        return self.num_layers * self.params_per_layer + emb + head + self.hidden_size

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token across all layers."""
        return 2 * self.num_layers * self.kv_width * self.dtype_bytes


@dataclass(frozen=True)
class LoRASpec:
    """An embedding adapter: rank and the projections it modifies (PEFT target names)."""

    rank: int = 16
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj",
                                "gate_proj", "up_proj", "down_proj")
    alpha: float = field(default=32.0, compare=False)

    def __post_init__(self) -> None:
        if self.rank <= 0:
            raise ValueError(f"embedding.lora_rank must be positive, got {self.rank}")
        unknown = set(self.targets) - set(LORA_TARGETS)
        if unknown:
            raise ValueError(
                f"embedding.lora_targets: unknown {sorted(unknown)}; known: {', '.join(LORA_TARGETS)}"
            )


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _need(cfg: dict, key: str, source: str):
    if key not in cfg:
        raise ValueError(f"{source}: config.json has no field {key!r}")
    value = cfg[key]
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{source}: config.json field {key!r} must be a positive integer, "
                         f"got {value!r}")
    return value


def spec_from_config(cfg: dict, name: str, source: str = "model") -> ModelSpec:
    """Build a spec from a ``config.json`` dict (Llama, Mistral, Qwen2 and OPT layouts)."""
    if not isinstance(cfg, dict):
        raise ValueError(f"{source}: config.json must hold a JSON object")
    archs = cfg.get("architectures") or [cfg.get("model_type", "LlamaForCausalLM")]
    arch = archs[0]
    dtype = DTYPE_BYTES.get(str(cfg.get("torch_dtype", "bfloat16")), 2)
    if cfg.get("model_type") == "opt" or arch.startswith("OPT"):
        d = _need(cfg, "hidden_size", source)
        heads = _need(cfg, "num_attention_heads", source)
        return ModelSpec(
            name=name, hidden_size=d, num_layers=_need(cfg, "num_hidden_layers", source),
            num_heads=heads, num_kv_heads=heads, head_dim=d // heads,
            intermediate_size=_need(cfg, "ffn_dim", source),
            vocab_size=_need(cfg, "vocab_size", source),
            tied_embeddings=bool(cfg.get("tie_word_embeddings", True)), qkv_bias=True,
            gated_mlp=False, max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            dtype_bytes=dtype, architecture=arch,
        )
    d = _need(cfg, "hidden_size", source)
    heads = _need(cfg, "num_attention_heads", source)
    kv_heads = cfg.get("num_key_value_heads", heads)
    head_dim = cfg.get("head_dim") or d // heads
    return ModelSpec(
        name=name, hidden_size=d, num_layers=_need(cfg, "num_hidden_layers", source),
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        intermediate_size=_need(cfg, "intermediate_size", source),
        vocab_size=_need(cfg, "vocab_size", source),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("attention_bias", False)) or arch.startswith("Qwen2"),
        gated_mlp=True, max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        dtype_bytes=dtype, architecture=arch,
    )


# Fields as published in each model's Hugging Face config.json.
MODEL_CONFIGS: dict[str, dict] = {
    "mistral-7b-v0.1": dict(architectures=["MistralForCausalLM"], hidden_size=4096,
                            num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                            intermediate_size=14336, vocab_size=32000, tie_word_embeddings=False,
                            max_position_embeddings=32768),
    "qwen2-7b": dict(architectures=["Qwen2ForCausalLM"], hidden_size=3584, num_hidden_layers=28,
                     num_attention_heads=28, num_key_value_heads=4, intermediate_size=18944,
                     vocab_size=152064, tie_word_embeddings=False,
                     max_position_embeddings=131072),
    "llama-3.1-8b": dict(architectures=["LlamaForCausalLM"], hidden_size=4096,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False,
                         max_position_embeddings=131072),
    "llama-2-7b": dict(architectures=["LlamaForCausalLM"], hidden_size=4096, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=32, intermediate_size=11008,
                       vocab_size=32000, tie_word_embeddings=False, max_position_embeddings=4096),
    "llama-3-8b": dict(architectures=["LlamaForCausalLM"], hidden_size=4096, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
                       vocab_size=128256, tie_word_embeddings=False, max_position_embeddings=8192),
    "opt-1.3b": dict(architectures=["OPTForCausalLM"], model_type="opt", hidden_size=2048,
                     num_hidden_layers=24, num_attention_heads=32, ffn_dim=8192,
                     vocab_size=50272, tie_word_embeddings=True, max_position_embeddings=2048),
    # The project's CPU benchmark model (`orthrus-real init-model --size small`).
    "orthrus-small": dict(architectures=["LlamaForCausalLM"], hidden_size=768,
                          num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                          head_dim=64, intermediate_size=2048, vocab_size=32000,
                          tie_word_embeddings=True, max_position_embeddings=4096),
}


def get_model(name_or_path: str) -> ModelSpec:
    """A catalogue model by name, or any local ``config.json`` (file or its directory)."""
    if name_or_path in MODEL_CONFIGS:
        return spec_from_config(MODEL_CONFIGS[name_or_path], name_or_path, name_or_path)
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json" or path.exists():
        cfg = read_structured(path, "model: config file")
        return spec_from_config(cfg, path.parent.name or str(path), str(path))
    raise ValueError(
        f"model: unknown name {name_or_path!r}; known: {', '.join(sorted(MODEL_CONFIGS))}, "
        "or a path to a config.json"
    )
