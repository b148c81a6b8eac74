"""A Llama-family decoder (Llama 2/3/3.1, Mistral, Qwen2) over a paged KV cache, with an
embedding LoRA applied to one contiguous slice of rows only."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from orthrus_real.engine.attention import AttentionMetadata, paged_attention
from orthrus_real.engine.cpu_gemm import PLAIN, CpuGemm
from orthrus_real.engine.model_files import DecoderConfig, LoRAAdapter
from orthrus_real.engine.paged_attention import PagedMetadata, inplace_attention


def rope_inv_freq(cfg: DecoderConfig) -> torch.Tensor:
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "llama3":  # Llama 3.1: long wavelengths slowed by `factor`, smooth in between
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        low_wl, high_wl = old_len / low, old_len / high
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > low_wl, inv / factor, inv)
        mid = (wavelen <= low_wl) & (wavelen >= high_wl)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    elif kind not in (None, "default"):
        raise ValueError(f"rope_scaling type {kind!r} is not supported (llama3 or none)")
    return inv.float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, heads, D); rotate-half convention of Hugging Face Llama, in x's dtype as there."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalised in fp32 (as Hugging Face does), scaled in the model dtype."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


class Decoder:
    """Weights plus a forward pass; ``forward`` returns final-norm hidden states (T, d)."""

    def __init__(self, cfg: DecoderConfig, weights: dict[str, torch.Tensor], device: torch.device,
                 adapter: LoRAAdapter | None = None, gemm: CpuGemm = PLAIN) -> None:
        """``gemm``: which library multiplies fp32 projections on a CPU (``cpu_gemm.py``)."""
        self.cfg = cfg
        self.device = device
        self.linear = gemm.linear
        dtype = cfg.dtype

        def take(name: str) -> torch.Tensor:
            if name not in weights:
                raise ValueError(f"model weights have no tensor {name!r}")
            return weights[name].to(device=device, dtype=dtype)

        self.embed = take("model.embed_tokens.weight")
        self.norm = take("model.norm.weight")
        self.lm_head = self.embed if cfg.tie_word_embeddings else take("lm_head.weight")
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            layer = {
                "in_norm": take(p + "input_layernorm.weight"),
                "post_norm": take(p + "post_attention_layernorm.weight"),
                "qkv": torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"]),
                "o": take(p + "self_attn.o_proj.weight"),
                "gate_up": torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]),
                "down": take(p + "mlp.down_proj.weight"),
                "qkv_bias": torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
                if cfg.qkv_bias else None,
            }
            self.layers.append(layer)
        self.adapter = None
        if adapter is not None:
            self.adapter = {key: (a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype))
                            for key, (a, b) in adapter.weights.items()}
            self.lora_scaling = adapter.scaling
        self.inv_freq = rope_inv_freq(cfg).to(device)
        self.scale = cfg.head_dim ** -0.5
        self.q_width = cfg.num_heads * cfg.head_dim
        self.kv_width = cfg.num_kv_heads * cfg.head_dim

    def merge_adapter(self) -> None:
        """Fold the adapter into the weights (W + scaling * B @ A, in fp32) and drop it: what a
        server whose every row is an embedding runs (the merged embedding model of a
        Dedicated split), with no per-row adapter work left in the forward pass."""
        if self.adapter is None:
            return
        fused = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "o_proj": "o",
                 "gate_proj": "gate_up", "up_proj": "gate_up", "down_proj": "down"}
        start = {"q_proj": 0, "k_proj": self.q_width, "v_proj": self.q_width + self.kv_width,
                 "o_proj": 0, "gate_proj": 0, "up_proj": self.cfg.intermediate_size,
                 "down_proj": 0}
        copied = set()
        for (layer, module), (a, b) in self.adapter.items():
            key = (layer, fused[module])
            if key not in copied:  # never write into tensors the loaded files may back
                self.layers[layer][key[1]] = self.layers[layer][key[1]].clone()
                copied.add(key)
            w = self.layers[layer][key[1]]
            rows = slice(start[module], start[module] + self._width(module))
            delta = (b.float() @ a.float()) * self.lora_scaling
            w[rows] = (w[rows].float() + delta).to(w.dtype)
        self.adapter = None

    def _lora(self, x: torch.Tensor, y: torch.Tensor, layer: int, modules: tuple[str, ...],
              rows: slice) -> None:
        """Add the adapter's delta to ``y`` (a fused projection's output) on ``rows`` only."""
        if self.adapter is None or rows.stop <= rows.start:
            return
        xs = x[rows]
        col = 0
        for module in modules:
            pair = self.adapter.get((layer, module))
            width = self._width(module)
            if pair is not None:
                a, b = pair
                y[rows, col:col + width] += (xs @ a.t()) @ b.t() * self.lora_scaling
            col += width

    def _width(self, module: str) -> int:
        cfg = self.cfg
        return {"q_proj": self.q_width, "k_proj": self.kv_width, "v_proj": self.kv_width,
                "o_proj": cfg.hidden_size, "gate_proj": cfg.intermediate_size,
                "up_proj": cfg.intermediate_size, "down_proj": cfg.hidden_size}[module]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata | PagedMetadata,
                caches: list, lora_rows: slice = slice(0, 0)) -> torch.Tensor:
        """``meta`` chooses the attention: gathered contexts (``attention.py``) or the cache read
        in place (``paged_attention.py``)."""
        cfg = self.cfg
        attend = inplace_attention if isinstance(meta, PagedMetadata) else paged_attention
        h = self.embed[input_ids]
        freqs = meta.positions.float()[:, None] * self.inv_freq[None, :]
        cos = torch.cat((freqs.cos(), freqs.cos()), -1)[:, None, :].to(cfg.dtype)
        sin = torch.cat((freqs.sin(), freqs.sin()), -1)[:, None, :].to(cfg.dtype)
        t = h.shape[0]
        for i, layer in enumerate(self.layers):
            x = rms_norm(h, layer["in_norm"], cfg.rms_norm_eps)
            qkv = self.linear(x, layer["qkv"], layer["qkv_bias"])
            self._lora(x, qkv, i, ("q_proj", "k_proj", "v_proj"), lora_rows)
            q = qkv[:, :self.q_width].view(t, cfg.num_heads, cfg.head_dim)
            k = qkv[:, self.q_width:self.q_width + self.kv_width].view(t, cfg.num_kv_heads, cfg.head_dim)
            v = qkv[:, self.q_width + self.kv_width:].view(t, cfg.num_kv_heads, cfg.head_dim)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            attn = attend(q, k, v, caches[i], meta, self.scale, i)
            attn = attn.reshape(t, self.q_width)
            o = self.linear(attn, layer["o"], split=False)
            self._lora(attn, o, i, ("o_proj",), lora_rows)
            h = h + o
            x = rms_norm(h, layer["post_norm"], cfg.rms_norm_eps)
            gu = self.linear(x, layer["gate_up"])
            self._lora(x, gu, i, ("gate_proj", "up_proj"), lora_rows)
            inter = cfg.intermediate_size
            act = F.silu(gu[:, :inter]) * gu[:, inter:]
            down = self.linear(act, layer["down"], split=False)
            self._lora(act, down, i, ("down_proj",), lora_rows)
            h = h + down
        return rms_norm(h, self.norm, cfg.rms_norm_eps)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.linear(hidden, self.lm_head).float()
