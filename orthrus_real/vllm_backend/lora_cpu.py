"""Segment LoRA ops for vLLM's CPU path (installed in the worker on CPU only).

vLLM's CPU punica wrapper runs its prefill ("sgmv") LoRA ops in plain torch by gathering one
copy of the adapter weights per token (``weights[token_indices]``) and multiplying batched
(``einsum("bi,boi->bo")``): for a 2,048-token embedding chunk on the ``small`` model that moves
gigabytes per layer, and a step took ~11.5 s against ~0.85 s on the PyTorch engine. The
punica metadata already describes the batch as segments of consecutive tokens sharing one
adapter, so these versions do one matmul per segment with that adapter's weights. They also
skip segments without an adapter (index -1), which the gathering version maps to the last
adapter slot (vllm-project/vllm PR #48421).

A batch without a prefill row (all decodes) takes the per-token ("bgmv") ops instead, which
gather a weight copy for every row as well, rows without an adapter included: on the ``small``
model, 42 ms of every 14-decode iteration (measured on one core; a decode step of stock vLLM
without LoRA takes ~57 ms), a cost the cost model never charges (generation rows carry no
adapter) and that only decode-only iterations paid (Unified-Homo's, issue 22). The ``bgmv_*``
versions group the rows by adapter instead, one matmul per adapter present.

An iteration none of whose rows carries an adapter (a decode-only or generation-only batch of a
server with the embedding adapter loaded) skips the LoRA layers' calls altogether, as vLLM's GPU
kernels do (their "no LoRA" flag): the calls for nothing still cost each LoRA linear of every
layer a few small tensor operations (buffers, ``unique``), and the cost model charges adapter
work by adapter rows only. Measured on one core (Unified-Homo serving the 1:9 mix, 14 decodes
at ~156 tokens, two rounds alternated): decode-only iterations 50.6 / 50.0 ms with the calls,
50.0 / 46.4 ms without; the plug-in without an adapter loaded 46.0 / 47.9 ms.
``ORTHRUS_LORA_SKIP=0`` keeps vLLM's calls (to measure the difference).

Same signatures and results as ``vllm.lora.ops.torch_ops.sgmv_*`` and ``bgmv_*`` (rows without
an adapter get none, which the gathering versions give only with the last slot kept empty, as
the engine keeps it).
"""

from __future__ import annotations

import os

import torch


def _weights(stacked: torch.Tensor) -> torch.Tensor:
    """[max_loras, 1, out, in] or [max_loras, out, in] -> [max_loras, out, in]."""
    return stacked[:, 0] if stacked.dim() == 4 else stacked


def _segments(starts: torch.Tensor, lengths: torch.Tensor, indices: torch.Tensor):
    for start, n, idx in zip(starts.tolist(), lengths.tolist(), indices.tolist()):
        yield start, start + n, idx


def _write(out: torch.Tensor, rows: slice, cols: slice, y: torch.Tensor | None, add: bool) -> None:
    if y is None:  # no adapter on these rows
        if not add:
            out[rows, cols] = 0
    elif add:
        out[rows, cols] += y
    else:
        out[rows, cols] = y


def sgmv_shrink(inputs, lora_a_weights, output_tensor, b_seq_start_loc, seq_len_tensor,
                lora_indices_tensor, batches, max_seq_length, token_nums, scaling) -> None:
    w = _weights(lora_a_weights)
    cols = slice(0, w.shape[1])
    for s, e, idx in _segments(b_seq_start_loc, seq_len_tensor, lora_indices_tensor):
        y = None if idx < 0 else scaling * (inputs[s:e].to(output_tensor.dtype)
                                            @ w[idx].to(output_tensor.dtype).T)
        _write(output_tensor, slice(s, e), cols, y, add=False)


def sgmv_expand(inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor,
                lora_indices_tensor, batches, max_seq_length, token_nums,
                add_inputs: bool = False) -> None:
    w = _weights(lora_b_weights)
    n = min(w.shape[1], output_tensor.shape[1])
    for s, e, idx in _segments(b_seq_start_loc, seq_len_tensor, lora_indices_tensor):
        y = None if idx < 0 else (inputs[s:e].to(output_tensor.dtype)
                                  @ w[idx, :n].to(output_tensor.dtype).T)
        _write(output_tensor, slice(s, e), slice(0, n), y, add_inputs)


def sgmv_expand_slice(inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor,
                      lora_indices_tensor, batches, max_seq_length, token_nums, slice_offset,
                      slice_size, add_inputs: bool = False) -> None:
    w = _weights(lora_b_weights)
    cols = slice(slice_offset, slice_offset + slice_size)
    for s, e, idx in _segments(b_seq_start_loc, seq_len_tensor, lora_indices_tensor):
        y = None if idx < 0 else (inputs[s:e].to(output_tensor.dtype)
                                  @ w[idx].to(output_tensor.dtype).T)
        _write(output_tensor, slice(s, e), cols, y, add_inputs)


def _groups(indices: torch.Tensor):
    """(adapter index, its rows) for each adapter the per-token ``indices`` name; rows with -1
    (no adapter) are in none. A slice when one adapter holds every row."""
    present = torch.unique(indices).tolist()
    if present == [] or present == [-1]:
        return
    if len(present) == 1:
        yield present[0], slice(None)
        return
    for idx in present:
        if idx >= 0:
            yield idx, (indices == idx).nonzero().squeeze(1)


def _same_rows(inputs: torch.Tensor, output: torch.Tensor, indices: torch.Tensor) -> bool:
    """The shapes these versions handle; vLLM's own op runs anything else (one input row
    broadcast to every output row)."""
    return inputs.shape[0] == output.shape[0] == indices.shape[0]


def bgmv_shrink(inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling=1.0) -> None:
    if not _same_rows(inputs, output_tensor, lora_indices_tensor):
        return _vllm_op("bgmv_shrink")(inputs, lora_a_weights, output_tensor,
                                       lora_indices_tensor, scaling)
    w = _weights(lora_a_weights)
    cols = slice(0, w.shape[1])
    output_tensor[:, cols] = 0
    for idx, rows in _groups(lora_indices_tensor):
        output_tensor[rows, cols] = scaling * (inputs[rows].to(output_tensor.dtype)
                                               @ w[idx].to(output_tensor.dtype).T)


def bgmv_expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor,
                add_inputs: bool = True) -> None:
    if not _same_rows(inputs, output_tensor, lora_indices_tensor):
        return _vllm_op("bgmv_expand")(inputs, lora_b_weights, output_tensor,
                                       lora_indices_tensor, add_inputs)
    w = _weights(lora_b_weights)
    n = min(w.shape[1], output_tensor.shape[1])
    _expand_rows(inputs, w, output_tensor, lora_indices_tensor, slice(0, n), n, add_inputs)


def bgmv_expand_slice(inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset,
                      slice_size, add_inputs: bool = True) -> None:
    if not _same_rows(inputs, output_tensor, lora_indices_tensor):
        return _vllm_op("bgmv_expand_slice")(inputs, lora_b_weights, output_tensor,
                                             lora_indices_tensor, slice_offset, slice_size,
                                             add_inputs)
    w = _weights(lora_b_weights)
    _expand_rows(inputs, w, output_tensor, lora_indices_tensor,
                 slice(slice_offset, slice_offset + slice_size), w.shape[1], add_inputs)


def _expand_rows(inputs, w, out, indices, cols: slice, n: int, add: bool) -> None:
    if not add:
        out[:, cols] = 0
    for idx, rows in _groups(indices):
        y = inputs[rows].to(out.dtype) @ w[idx, :n].to(out.dtype).T
        out[rows, cols] += y


def _vllm_op(name: str):
    from vllm.lora.ops import torch_ops

    return getattr(torch_ops, name)


def has_adapter_rows(wrapper) -> bool:
    """Whether a row of the wrapper's current batch (a token, or a row that samples) carries an
    adapter; -1 is "none" in vLLM's mapping."""
    return bool((wrapper.token_lora_indices >= 0).any()) or \
        bool((wrapper.sampler_indices >= 0).any())


def _noting_adapter_rows(update):
    def update_metadata(self, *args, **kwargs):
        update(self, *args, **kwargs)
        self.orthrus_adapter_rows = has_adapter_rows(self)
    return update_metadata


def _only_with_adapter_rows(add):
    """``add`` (which adds the adapters' delta to its output) when a row has an adapter; with
    none there is nothing to add."""
    def method(self, *args, **kwargs):
        if getattr(self, "orthrus_adapter_rows", True):
            add(self, *args, **kwargs)
    return method


def install() -> None:
    """Point vLLM's CPU punica wrapper at these ops (its module-level names), and have it skip
    its LoRA calls in an iteration without adapter rows (once per process)."""
    from vllm.lora.punica_wrapper import punica_cpu

    for op in (sgmv_shrink, sgmv_expand, sgmv_expand_slice, bgmv_shrink, bgmv_expand,
               bgmv_expand_slice):
        setattr(punica_cpu, op.__name__, op)
    cls = punica_cpu.PunicaWrapperCPU
    if os.environ.get("ORTHRUS_LORA_SKIP", "1") == "0":  # vLLM's calls, for an A/B
        return
    if not getattr(cls, "orthrus_skips_without_adapter", False):
        cls.update_metadata = _noting_adapter_rows(cls.update_metadata)
        cls.add_lora_linear = _only_with_adapter_rows(cls.add_lora_linear)
        cls.add_lora_logits = _only_with_adapter_rows(cls.add_lora_logits)
        cls.orthrus_skips_without_adapter = True
