"""``OrthrusScheduler``: vLLM's scheduler with every batch decided by the shared core's policy.

vLLM's own ``schedule()`` walks its running and waiting queues; this one asks the core policy
(``make_policy``: IBS by default, or any baseline) for a batch unit, then carries it out with
vLLM's machinery: KV-cache allocation, preemption bookkeeping, ``SchedulerOutput``.
``update_from_output`` is vLLM's (it finishes sampled and pooled requests alike) followed by
the core's ``complete``. The core keeps its own block accounting, sized to vLLM's cache, so both
always agree; a disagreement is a bug and raises.

Set it with ``scheduler_cls`` and the policy with ``additional_config={"orthrus": {...}}``:
``policy`` and any field of ``SchedulerConfig`` but those vLLM decides (block size, KV blocks,
model length); ``VllmEngine`` hands over the whole config (``orthrus_real.engine.settings``). With
``tpot_target_s``, ``predictor`` names the calibration, model and adapter rank of the cost model
that predicts iteration times (``calibrated_predictor``).
Prefix caching, speculative decoding, KV connectors and pipeline parallelism are refused: the
core's accounting does not model them.
"""

from __future__ import annotations

import time

from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from orthrus_real.engine.settings import from_vllm_options
from orthrus_real.vllm_backend.support import check_policy
from orthrus_sim.costmodel.predictor import calibrated_predictor
from orthrus_sim.engine import Request, RequestKind, make_policy


class AccountingError(RuntimeError):
    """The core's and vLLM's views of a request or of the KV cache disagree."""


def orthrus_options(vllm_config) -> dict:
    extra = vllm_config.additional_config or {}
    return dict(extra.get("orthrus", {}))


class OrthrusScheduler(Scheduler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._refuse_unsupported()
        opts = orthrus_options(self.vllm_config)
        predictor = opts.pop("predictor", None)  # {calibration, model, lora_rank}: tpot_target_s
        policy, self.config = from_vllm_options(
            opts, block_size=self.block_size,
            num_blocks=self.kv_cache_manager.block_pool.get_num_free_blocks(),
            max_model_len=self.max_model_len,
            max_batched_tokens=self.scheduler_config.max_num_batched_tokens,
            max_running=self.max_num_running_reqs)
        slots = self.config.max_num_seqs + (self.config.max_num_embeds or 0)
        if self.config.max_num_embeds is None or slots > self.max_num_running_reqs:
            raise ValueError(
                "additional_config.orthrus: max_num_seqs + max_num_embeds must be set and fit "
                f"vLLM's max_num_seqs ({self.max_num_running_reqs}), the request slots of one batch")
        self.policy = make_policy(check_policy(policy), self.config,
                                  calibrated_predictor(**predictor) if predictor else None)
        self.last_batch = None  # the core's batch unit behind the latest SchedulerOutput
        self.last_output: SchedulerOutput | None = None  # kept for inspection (tests, stats)
        self._in_flight: dict[int, object] = {}
        self.t0 = time.monotonic()  # the policy's clock origin; VllmEngine sets its own

    def _refuse_unsupported(self) -> None:
        problems = []
        if self.cache_config.enable_prefix_caching:
            problems.append("enable_prefix_caching (set it False)")
        if self.vllm_config.speculative_config is not None:
            problems.append("speculative decoding")
        if self.connector is not None:
            problems.append("KV connectors")
        if self.use_pp:
            problems.append("pipeline parallelism")
        if self.use_v2_model_runner:
            problems.append("model runner V2 (set VLLM_USE_V2_MODEL_RUNNER=0)")
        if len(self.kv_cache_config.kv_cache_groups) != 1:
            problems.append("models with more than one KV-cache group")
        if problems:
            raise ValueError("OrthrusScheduler does not support " + ", ".join(problems))

    def now(self) -> float:
        """Seconds on the clock the requests' arrival times use (Unified-Homo compares them)."""
        return time.monotonic() - self.t0

    # ----- requests ------------------------------------------------------------------------
    def add_request(self, request) -> None:
        """vLLM's queues plus the core's; a request the core already holds (the in-process
        engine adds it there first, to reject with a reason) is linked, not added twice."""
        core = self.policy.get(request.request_id)
        if core is None:
            core = core_request(request, self.now())
            if not self.policy.add(core, self.now()):
                raise ValueError(f"request {request.request_id}: {core.reject_reason}")
        super().add_request(request)

    def finish_requests(self, request_ids, finished_status):
        finished = super().finish_requests(request_ids, finished_status)
        for req in finished:
            self.policy.abort(req.request_id, self.now())
        return finished

    # ----- one step -----------------------------------------------------------------------
    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        self.current_step += 1
        self.kv_cache_manager.new_step_starts()
        batch = self.policy.schedule(self.now())
        stamp = time.monotonic()
        for vreq in [r for r in self.running if not self.policy.holds_kv(r.request_id)]:
            self.running.remove(vreq)  # the core preempted it (recompute): mirror that
            self._preempt_request(vreq, stamp)

        new, resumed, running = [], [], []
        num_tokens: dict[str, int] = {}
        blocks = {}
        for item in batch.items:
            rid = item.request.request_id
            vreq = self.requests.get(rid)
            if vreq is None or vreq.num_computed_tokens != item.start:
                raise AccountingError(
                    f"request {rid}: the core schedules tokens from {item.start}, vLLM has "
                    f"{None if vreq is None else vreq.num_computed_tokens} computed")
            got = self.kv_cache_manager.allocate_slots(vreq, item.num_tokens)
            if got is None:
                raise AccountingError(
                    f"request {rid}: vLLM has no KV blocks for {item.num_tokens} tokens the core "
                    f"allocated ({self.policy.blocks.num_free} free in the core)")
            if vreq.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                self.waiting.remove_request(vreq)
                self.running.append(vreq)
                (new if vreq.status is RequestStatus.WAITING else resumed).append(vreq)
                vreq.status = RequestStatus.RUNNING
                blocks[rid] = self.kv_cache_manager.get_blocks(rid)
            else:
                running.append(vreq)
                blocks[rid] = got
            num_tokens[rid] = item.num_tokens

        out = SchedulerOutput(
            scheduled_new_reqs=[
                NewRequestData.from_request(r, blocks[r.request_id].get_block_ids(),
                                            uses_mrope=self.model_uses_mrope)
                for r in new],
            scheduled_cached_reqs=self._make_cached_request_data(running, resumed, num_tokens,
                                                                 {}, blocks),
            num_scheduled_tokens=num_tokens,
            total_num_scheduled_tokens=batch.total_tokens,
            scheduled_spec_decode_tokens={},
            scheduled_encoder_inputs={},
            preempted_req_ids=self.reset_preempted_req_ids,
            finished_req_ids=self.finished_req_ids,
            free_encoder_mm_hashes=self.encoder_cache_manager.get_freed_mm_hashes(),
            new_block_ids_to_zero=self._get_new_block_ids_to_zero(),
        )
        self.prev_step_scheduled_req_ids.clear()
        self.prev_step_scheduled_req_ids.update(num_tokens)
        self._update_after_schedule(out)
        self._in_flight[id(out)] = batch
        self.last_batch, self.last_output = batch, out
        return out

    def update_from_output(self, scheduler_output, model_runner_output):
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        batch = self._in_flight.pop(id(scheduler_output))
        ended = {rid for rid in scheduler_output.num_scheduled_tokens
                 if (r := self.requests.get(rid)) is None or r.is_finished()}
        self.policy.complete(batch, self.now(), ended)
        for rid in ended:  # ended in vLLM for a reason the core does not model (max_model_len)
            if self.policy.get(rid) is not None:
                self.policy.abort(rid, self.now())
        return outputs


def core_request(vreq, now: float) -> Request:
    """The core's view of a vLLM request: kind, lengths, pooling head."""
    ids = list(vreq.prompt_token_ids or [])
    pooling = vreq.pooling_params
    if pooling is not None:
        head, normalize = pooling_options(pooling)
        return Request(vreq.request_id, RequestKind.EMBEDDING, now, len(ids), token_ids=ids,
                       pooling=head, normalize=normalize,
                       adapter=vreq.lora_request.lora_name if vreq.lora_request else None)
    return Request(vreq.request_id, RequestKind.GENERATION, now, len(ids),
                   max_output_tokens=vreq.max_tokens, token_ids=ids)


def pooling_options(pooling_params) -> tuple[str, bool]:
    """The pooling head and normalisation an embedding request asks for (``extra_kwargs``)."""
    extra = pooling_params.extra_kwargs or {}
    return extra.get("orthrus_pooling", "mean"), bool(extra.get("orthrus_normalize", True))
