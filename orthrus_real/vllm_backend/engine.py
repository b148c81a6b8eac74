"""``VllmEngine``: the reference engine's interface over an in-process vLLM ``EngineCore``.

Requests are validated and tokenised as in the PyTorch engine (same messages), enter the
core's policy, then vLLM's scheduler (``OrthrusScheduler``, which shares that policy object).
One ``step`` is one vLLM ``EngineCore.step``: the policy's batch unit, one forward pass,
pooled vectors and sampled tokens. Stop strings are applied here, as vLLM's front end does.

    engine = VllmEngine("models/tiny64", adapter_dir="models/tiny64/adapter")
    engine.add_embedding("e1", text="a query")
    engine.add_generation("g1", text="a prompt", params=SamplingParams(max_tokens=8))
    results = engine.run_until_idle()
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from orthrus_real.engine.base import EngineBase, RequestOutput
from orthrus_real.engine.model_files import read_adapter
from orthrus_real.engine.settings import to_vllm_options
from orthrus_real.vllm_backend.support import check_policy, check_vllm, prepare_environment
from orthrus_sim.engine import Request, SchedulerConfig

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the ranks vLLM's LoRA kernels accept


class VllmEngine(EngineBase):
    def __init__(self, model_dir: str | Path, adapter_dir: str | Path | None = None,
                 policy: str = "ibs", scheduler: SchedulerConfig | None = None,
                 dtype: str | None = None, kv_cache_tokens: int = 32768,
                 max_num_embeds: int = 64, gpu_memory_utilization: float | None = None,
                 calibration: str | None = None) -> None:
        check_policy(policy)
        self.vllm_version = check_vllm()
        prepare_environment()
        super().__init__(model_dir)
        import torch

        from orthrus_real.engine.device import choose_dtype

        platform = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        cfg = self._set_dtype(*choose_dtype(platform, dtype, self.cfg.dtype))
        _check_head_size(cfg.head_dim, self.model_dir)
        base = scheduler or SchedulerConfig()
        self._lora = None
        engine_args: dict = {}
        if adapter_dir:
            self.adapter_name, self._lora, rank = _lora_request(Path(adapter_dir), cfg.num_layers)
            self.adapter_rank = rank
            # Two slots for one adapter: vLLM's torch LoRA ops (its CPU path) index the weight
            # stack with -1 for "no adapter", which is the last slot. Kept empty, that slot
            # is zeros, so generation rows in a mixed batch get no LoRA; with one slot they
            # would get the embedding adapter.
            engine_args = dict(enable_lora=True, max_loras=2, max_cpu_loras=2,
                             max_lora_rank=next(r for r in LORA_RANKS if r >= rank))
        if gpu_memory_utilization is not None:  # engines sharing one GPU (the dedicated split)
            engine_args["gpu_memory_utilization"] = gpu_memory_utilization
        # request slots of vLLM's input batch: embeddings need a cap of their own here
        base = replace(base, max_num_embeds=base.max_num_embeds or max_num_embeds)
        orthrus = to_vllm_options(base, policy)  # the whole config (issue 25: kv_admission)
        source = self._predictor_source(base, calibration)
        if source:  # the scheduler builds the predictor where it runs (vLLM's engine core)
            orthrus["predictor"] = source
        self.vllm_config = _vllm_config(
            model_dir=self.model_dir, dtype=str(cfg.dtype).removeprefix("torch."),
            max_model_len=self._model_len(base.max_model_len),
            token_budget=base.token_budget, block_size=(block := _platform_block_size()),
            num_blocks=max(2, kv_cache_tokens // block + 1),
            orthrus=orthrus,
            max_num_seqs=base.max_num_seqs + base.max_num_embeds, **engine_args)
        from vllm.v1.engine.core import EngineCore
        from vllm.v1.executor.abstract import Executor

        self.core = EngineCore(self.vllm_config, Executor.get_class(self.vllm_config),
                               log_stats=False)
        self.scheduler = self.core.scheduler
        self.scheduler.t0 = self._t0  # one clock for arrivals and the policy's timestamps
        self.policy = self.scheduler.policy  # one policy object: the core's, inside vLLM
        self.scheduler_config = self.policy.config
        self._live: dict[str, Request] = {}

    # ----- requests ------------------------------------------------------------------------
    def _submit(self, req: Request, kind: str) -> Request:
        super()._submit(req, kind)  # the core's admission check, with its reasons
        from vllm.v1.engine import EngineCoreRequest

        ecr = EngineCoreRequest(
            request_id=req.request_id, prompt_token_ids=list(req.token_ids), mm_features=None,
            sampling_params=None if req.is_embedding else self._sampling(req),
            pooling_params=self._pooling(req) if req.is_embedding else None,
            arrival_time=time.time(),
            lora_request=self._lora if req.is_embedding else None,  # the adapter: embeddings only
            cache_salt=None, data_parallel_rank=None)
        vreq, _ = self.core.preprocess_add_request(ecr)
        # straight to the scheduler: EngineCore.add_request refuses pooling on a generate runner
        self.scheduler.add_request(vreq)
        self._live[req.request_id] = req
        return req

    def _sampling(self, req: Request):
        from vllm import SamplingParams

        p = req.payload.params
        # max_output_tokens: a resumed request's tokens still to generate (its prompt holds the rest)
        sp = SamplingParams(max_tokens=req.max_output_tokens, temperature=p.temperature,
                            top_k=p.top_k, top_p=p.top_p, seed=p.seed,
                            stop_token_ids=list(p.stop_token_ids),
                            ignore_eos=p.ignore_eos, detokenize=False)
        eos = list(self.cfg.eos_token_ids)
        if eos and not p.ignore_eos:
            sp.update_from_generation_config({"eos_token_id": eos}, eos_token_id=eos[0])
        return sp

    @staticmethod
    def _pooling(req: Request):
        from vllm.pooling_params import PoolingParams

        return PoolingParams(task="embed", extra_kwargs={"orthrus_pooling": req.pooling,
                                                         "orthrus_normalize": req.normalize})

    def _drop(self, request_id: str) -> Request | None:
        req = self.policy.get(request_id)
        if req is None:
            return None
        self.core.abort_requests([request_id])  # vLLM frees its blocks, the core its own
        self._live.pop(request_id, None)
        return req

    # ----- one iteration -------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        start = self.now()
        outputs, executed = self.core.step()
        batch = self.scheduler.last_batch
        self.scheduler.last_batch = None
        results = []
        for group in outputs.values():
            for out in group.outputs:
                res = self._result(out)
                if res is not None:
                    results.append(res)
        if executed and batch:
            self._record(batch, start)
        return results

    def _result(self, out) -> RequestOutput | None:
        req = self._live.get(out.request_id)
        if req is None:
            return None
        if req.is_embedding:
            if out.pooling_output is None:
                return None
            del self._live[req.request_id]
            return self._embedding_output(req, out.pooling_output)
        state = req.payload
        done = out.finish_reason is not None
        for tok in out.new_token_ids:
            if self._take_token(req, state, tok) and not done:
                self.core.abort_requests([req.request_id])  # a stop string: vLLM does not see it
                done = True
            if done:
                break
        if done:
            del self._live[req.request_id]
            state.finish_reason = state.finish_reason or str(out.finish_reason)
        return self._generation_output(req, list(out.new_token_ids), done)

    def close(self) -> None:
        self.core.shutdown()


def _lora_request(adapter_dir: Path, num_layers: int):
    """vLLM's LoRA request for the adapter, checked first as the PyTorch engine checks it
    (config, tensors, target modules), so a bad adapter is named before vLLM starts."""
    from vllm.lora.request import LoRARequest

    rank = read_adapter(adapter_dir, num_layers).rank
    if rank > LORA_RANKS[-1]:
        raise ValueError(f"{adapter_dir}: LoRA rank {rank} exceeds vLLM's largest, {LORA_RANKS[-1]}")
    return adapter_dir.name, LoRARequest(adapter_dir.name, 1, str(adapter_dir)), rank


def _check_head_size(head_dim: int, model_dir: Path) -> None:
    """vLLM's CPU attention kernel takes a fixed list of head sizes; say so before starting."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    sizes = CPUAttentionBackend.get_supported_head_sizes()
    if head_dim not in sizes:
        raise ValueError(
            f"{model_dir}: head_dim {head_dim} is not supported by vLLM's CPU attention (it takes "
            f"{', '.join(map(str, sizes))}); use --backend torch, or a model such as "
            "init-model --size tiny64")


def _platform_block_size() -> int:
    """vLLM's block size on this platform (its CPU attention needs multiples of 32); the core
    adopts it, so ``SchedulerConfig.block_size`` does not apply to this backend."""
    from vllm.platforms import current_platform

    return 128 if current_platform.is_cpu() else 16


def _vllm_config(model_dir: Path, dtype: str, max_model_len: int, token_budget: int,
                 block_size: int, num_blocks: int, orthrus: dict,
                 max_num_seqs: int, **extra):
    """vLLM's config for one generate-runner engine driven by the Orthrus plug-in."""
    from vllm.engine.arg_utils import EngineArgs

    from orthrus_real.vllm_backend.worker import worker_class

    args = EngineArgs(
        model=str(model_dir), tokenizer=str(model_dir), dtype=dtype, max_model_len=max_model_len,
        # vLLM wants max_num_batched_tokens >= max_num_seqs; the core keeps the real budget
        max_num_batched_tokens=max(token_budget, max_num_seqs), max_num_seqs=max_num_seqs,
        block_size=block_size, num_gpu_blocks_override=num_blocks, enable_prefix_caching=False,
        enable_chunked_prefill=True, enforce_eager=True, async_scheduling=False,
        distributed_executor_backend="uni", disable_log_stats=True,
        scheduler_cls="orthrus_real.vllm_backend.scheduler.OrthrusScheduler",
        worker_cls=worker_class(), additional_config={"orthrus": orthrus}, **extra)
    return args.create_engine_config()
