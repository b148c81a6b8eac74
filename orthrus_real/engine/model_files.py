"""Model directories as Hugging Face stores them: config.json, *.safetensors (sharded too),
tokenizer.json, and PEFT LoRA adapters; plus ``init_model`` that writes a seeded random one."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from orthrus_sim import read_structured

SUPPORTED = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}
BIDIRECTIONAL_HINTS = ("BertModel", "XLMRobertaModel", "T5EncoderModel", "NomicBertModel")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class DecoderConfig:
    """The fields of config.json the engine uses."""

    architecture: str
    family: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    dtype: torch.dtype
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @property
    def max_model_len(self) -> int:
        return self.max_position_embeddings


def _field(cfg: dict, key: str, path: Path, kind=int):
    if key not in cfg:
        raise ValueError(f"{path}: config.json has no field {key!r}")
    value = cfg[key]
    if kind is int and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
        raise ValueError(f"{path}: config.json field {key!r} must be a positive integer, got {value!r}")
    return value


def read_config(model_dir: str | Path) -> DecoderConfig:
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        raise ValueError(f"model directory {model_dir} does not exist")
    cfg = read_structured(path, "model config")
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else cfg.get("model_type", "?")
    if arch in BIDIRECTIONAL_HINTS or cfg.get("is_causal") is False or cfg.get("is_decoder") is False:
        raise ValueError(
            f"{path}: {arch} is a bidirectional encoder; chunked embedding needs a causal decoder "
            "(chunk k must not see chunks after it). Serve it with an atomic embedding server."
        )
    if arch not in SUPPORTED:
        raise ValueError(f"{path}: unknown architecture {arch!r}; supported: {', '.join(SUPPORTED)}")
    heads = _field(cfg, "num_attention_heads", path)
    hidden = _field(cfg, "hidden_size", path)
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    dtype_name = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")
    if dtype_name not in DTYPES:
        raise ValueError(f"{path}: torch_dtype {dtype_name!r} is not one of {', '.join(DTYPES)}")
    max_pos = _field(cfg, "max_position_embeddings", path)
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    if isinstance(window, int) and 0 < window < max_pos:
        max_pos = window  # full attention equals sliding-window attention up to the window
    return DecoderConfig(
        architecture=arch, family=SUPPORTED[arch], hidden_size=hidden,
        intermediate_size=_field(cfg, "intermediate_size", path),
        num_layers=_field(cfg, "num_hidden_layers", path), num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads", heads),
        head_dim=cfg.get("head_dim") or hidden // heads,
        vocab_size=_field(cfg, "vocab_size", path),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(cfg.get("rope_theta", 10000.0)),
        rope_scaling=cfg.get("rope_scaling"), max_position_embeddings=max_pos,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
        dtype=DTYPES[dtype_name], bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids,
    )


def read_weights(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of ``model.safetensors`` or of the shards named by its index file."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(read_structured(index, "weight index")["weight_map"].values()))
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir}: no *.safetensors weight files")
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        path = model_dir / name
        if not path.exists():
            raise ValueError(f"{model_dir}: weight shard {name} named by the index is missing")
        weights.update(load_file(str(path)))
    return weights


@dataclass(frozen=True)
class LoRAAdapter:
    """A PEFT LoRA adapter: per layer and module, (A [r, in], B [out, r]) and the scale."""

    name: str
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def _adapter_config(adapter_dir: Path) -> tuple[dict, int]:
    cfg = read_structured(adapter_dir / "adapter_config.json", "adapter config")
    if not isinstance(cfg, dict):
        raise ValueError(f"{adapter_dir}: adapter_config.json must hold a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{adapter_dir}: peft_type {cfg.get('peft_type')!r} is not LORA")
    rank = cfg.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        raise ValueError(f"{adapter_dir}: adapter_config.json field 'r' must be a positive integer")
    return cfg, rank


def adapter_rank(adapter_dir: str | Path) -> int:
    """The LoRA rank of a PEFT adapter directory (its config only)."""
    return _adapter_config(Path(adapter_dir))[1]


def read_adapter(adapter_dir: str | Path, num_layers: int) -> LoRAAdapter:
    adapter_dir = Path(adapter_dir)
    cfg, rank = _adapter_config(adapter_dir)
    scaling = float(cfg.get("lora_alpha", rank)) / rank
    if cfg.get("use_rslora"):
        scaling = float(cfg.get("lora_alpha", rank)) / math.sqrt(rank)
    path = adapter_dir / "adapter_model.safetensors"
    if not path.exists():
        raise ValueError(f"{adapter_dir}: adapter_model.safetensors is missing")
    raw = load_file(str(path))
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for key, a in raw.items():
        if ".lora_A." not in key:
            continue
        parts = key.split(".")
        layer = int(parts[parts.index("layers") + 1])
        module = parts[parts.index("lora_A") - 1]
        b = raw.get(key.replace(".lora_A.", ".lora_B."))
        if b is None:
            raise ValueError(f"{adapter_dir}: {key} has no matching lora_B tensor")
        if module not in LORA_MODULES or layer >= num_layers:
            raise ValueError(f"{adapter_dir}: {key} targets a module or layer this model lacks")
        weights[(layer, module)] = (a, b)
    if not weights:
        raise ValueError(f"{adapter_dir}: no LoRA tensors found")
    return LoRAAdapter(adapter_dir.name, rank, scaling, weights)
