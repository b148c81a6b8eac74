"""Write a seeded, randomly initialised model directory in Hugging Face layout (config.json,
safetensors, tokenizer.json) and optionally a PEFT LoRA embedding adapter. Tests and
benchmarks use these, since no model hub can be reached."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from orthrus_real.engine.model_files import LORA_MODULES

SIZES = {
    # tiny: the test model (fast on CPU, fp32 by default)
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512, tokenizer_vocab=512,
                 tie_word_embeddings=False, torch_dtype="float32"),
    # tiny64: the vLLM test model (vLLM's CPU attention needs head_dim 64 or more)
    "tiny64": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=64, vocab_size=512, tokenizer_vocab=512,
                   tie_word_embeddings=False, torch_dtype="float32"),
    # small: the CPU benchmark model (~100 M parameters, bf16)
    "small": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                  num_attention_heads=12, num_key_value_heads=4, head_dim=64, vocab_size=32000,
                  tokenizer_vocab=8000, tie_word_embeddings=True, torch_dtype="bfloat16"),
    # 1b: the GPU mix-benchmark model (TinyLlama-1.1B's shape, ~1.1 B parameters, bf16)
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
               num_attention_heads=32, num_key_value_heads=4, head_dim=64, vocab_size=32000,
               tokenizer_vocab=8000, tie_word_embeddings=False, torch_dtype="bfloat16"),
}
FAMILIES = {
    "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama", rope_theta=500000.0,
                  rms_norm_eps=1e-5, attention_bias=False,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}),
    "mistral": dict(architectures=["MistralForCausalLM"], model_type="mistral", rope_theta=10000.0,
                    rms_norm_eps=1e-5, sliding_window=None),
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", rope_theta=1000000.0,
                  rms_norm_eps=1e-6, use_sliding_window=False, sliding_window=None),
}
SPECIAL = ["<unk>", "<s>", "</s>", "<pad>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _corpus(seed: int, lines: int = 4000) -> list[str]:
    rng = np.random.default_rng(seed)
    syllables = [a + b for a in "bcdfghjklmnprstvwz" for b in "aeiou"] + ["th", "qu", "ing", "ed"]
    words = ["".join(rng.choice(syllables, size=rng.integers(1, 4))) for _ in range(3000)]
    return [" ".join(rng.choice(words, size=rng.integers(4, 16))) + "." for _ in range(lines)]


def build_tokenizer(vocab_size: int, seed: int) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(seed), trainer)
    return tok


def _tensor(gen: torch.Generator, shape, dtype, std=0.02) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * std).to(dtype)


def init_model(out_dir: str | Path, family: str = "llama", size: str = "tiny", seed: int = 0,
               dtype: str | None = None, shards: int = 1, adapter_rank: int | None = None,
               max_position_embeddings: int = 4096) -> Path:
    """Write the model; with ``adapter_rank``, also a LoRA adapter in ``out_dir/adapter``."""
    if family not in FAMILIES:
        raise ValueError(f"--family must be one of {', '.join(FAMILIES)}, got {family!r}")
    if size not in SIZES:
        raise ValueError(f"--size must be one of {', '.join(SIZES)}, got {size!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    spec = dict(SIZES[size])
    tok_vocab = spec.pop("tokenizer_vocab")
    if dtype:
        spec["torch_dtype"] = dtype
    cfg = {**FAMILIES[family], **spec, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2,
           "pad_token_id": 3, "max_position_embeddings": max_position_embeddings,
           "initializer_range": 0.02}
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg["torch_dtype"]]
    gen = torch.Generator().manual_seed(seed)
    d, inter = cfg["hidden_size"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    w = {"model.embed_tokens.weight": _tensor(gen, (cfg["vocab_size"], d), torch_dtype),
         "model.norm.weight": torch.ones(d, dtype=torch_dtype)}
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = _tensor(gen, (cfg["vocab_size"], d), torch_dtype)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(d, dtype=torch_dtype)
        w[p + "post_attention_layernorm.weight"] = torch.ones(d, dtype=torch_dtype)
        for name, shape in (("q_proj", (q, d)), ("k_proj", (kv, d)), ("v_proj", (kv, d)),
                            ("o_proj", (d, q))):
            w[p + f"self_attn.{name}.weight"] = _tensor(gen, shape, torch_dtype)
        if family == "qwen2":
            for name, n in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
                w[p + f"self_attn.{name}.bias"] = _tensor(gen, (n,), torch_dtype)
        w[p + "mlp.gate_proj.weight"] = _tensor(gen, (inter, d), torch_dtype)
        w[p + "mlp.up_proj.weight"] = _tensor(gen, (inter, d), torch_dtype)
        w[p + "mlp.down_proj.weight"] = _tensor(gen, (d, inter), torch_dtype)
    _save_weights(w, out, shards)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}, indent=2) + "\n")
    build_tokenizer(tok_vocab, seed).save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>",
        "model_max_length": max_position_embeddings, "chat_template": CHAT_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2) + "\n")
    if adapter_rank:
        write_adapter(out / "adapter", cfg, adapter_rank, seed + 1, out)
    return out


def _save_weights(w: dict[str, torch.Tensor], out: Path, shards: int) -> None:
    names = sorted(w)
    if shards <= 1:
        save_file({k: w[k].contiguous() for k in names}, str(out / "model.safetensors"),
                  metadata={"format": "pt"})
        return
    weight_map = {}
    for s in range(shards):
        part = names[s::shards]
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: w[k].contiguous() for k in part}, str(out / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
    total = sum(t.numel() * t.element_size() for t in w.values())
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")


def write_adapter(adapter_dir: Path, cfg: dict, rank: int, seed: int, base: Path) -> Path:
    """A PEFT LoRA adapter on every attention and MLP projection, both factors random (PEFT
    initialises B to zero; a test adapter must change the output)."""
    adapter_dir.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg["torch_dtype"]]
    d, inter = cfg["hidden_size"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    dims = {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d),
            "gate_proj": (d, inter), "up_proj": (d, inter), "down_proj": (inter, d)}
    tensors = {}
    for i in range(cfg["num_hidden_layers"]):
        for module, (n_in, n_out) in dims.items():
            group = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{i}.{group}.{module}"
            tensors[f"{key}.lora_A.weight"] = _tensor(gen, (rank, n_in), dtype, 0.05)
            tensors[f"{key}.lora_B.weight"] = _tensor(gen, (n_out, rank), dtype, 0.05)
    save_file(tensors, str(adapter_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    (adapter_dir / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "FEATURE_EXTRACTION", "r": rank, "lora_alpha": 2 * rank,
        "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
        "target_modules": list(LORA_MODULES), "base_model_name_or_path": str(base)}, indent=2) + "\n")
    return adapter_dir
