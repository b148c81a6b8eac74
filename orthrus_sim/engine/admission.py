"""KV admission: which request may take blocks, the two admission modes, holding blocks back
for a refused embedding head, which keys and values an embedding stores, and what admitting,
releasing and preempting a request does to the queues and the block manager
(docs/scheduler.md has the invariants)."""

from __future__ import annotations

from orthrus_sim.engine.batch import EMBED_CHUNK, BatchItem
from orthrus_sim.engine.config import SchedulerConfig
from orthrus_sim.engine.kv_cache import BlockManager
from orthrus_sim.engine.queues import EMBEDDING, GENERATION, Queues, insert_in_order
from orthrus_sim.engine.request import FINISHED, RUNNING, Request, RequestKind, RequestState


class KVAdmission(Queues):
    """The paged KV cache of one replica and the rules for taking and giving back its blocks."""

    name: str  # the policy's (``Policy`` and its subclasses set both)
    serves: tuple[RequestKind, ...]

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self.blocks = BlockManager(config.num_blocks, config.block_size)
        self.preemptions = {EMBEDDING.value: 0, GENERATION.value: 0}
        # blocks set aside for refused embedding heads, for the rest of the iteration
        self._held_back = 0
        self._held_for: dict[str, int] = {}

    def _reject_reason(self, request: Request) -> str | None:
        cfg = self.config
        if request.kind not in self.serves:
            return f"this replica ({self.name}) does not serve {request.kind.value} requests"
        total = request.input_len + request.max_output_tokens
        if cfg.max_model_len is not None and total > cfg.max_model_len:
            return (
                f"input_len + max_output_tokens = {total} exceeds the model's maximum length "
                f"{cfg.max_model_len}"
            )
        embedding = request.is_embedding
        blocks = self.blocks
        if blocks.blocks_for(total) > blocks.num_blocks:  # an embedding stores at most its input
            stored = self.embed_kv_tokens(request) if embedding else total
            if blocks.blocks_for(stored) > blocks.num_blocks:
                return (
                    f"{stored} tokens of keys and values need {blocks.blocks_for(stored)} KV "
                    f"blocks but the cache holds {blocks.num_blocks}"
                )
        if embedding and cfg.chunk_size is None and request.input_len > cfg.token_budget:
            return (
                f"input_len {request.input_len} exceeds the token budget {cfg.token_budget} and "
                "embeddings are not chunked (scheduler.chunk_size is null)"
            )
        return None

    def embed_kv_tokens(self, request: Request) -> int:
        """Tokens of an embedding whose keys and values the cache must hold: those a later
        chunk of it attends to, i.e. every token before its last chunk, the chunks planned at
        ``chunk_size`` from where it stands (``embedding_kv: all``: its whole input). Its last
        chunk attends to its own keys and values inside the pass and stores none, so a
        one-chunk (or atomic) embedding needs no blocks. A chunk cut shorter than planned (the
        iteration-time target) moves the last chunk later; ``schedule_embedding`` then grows
        the blocks (``_embed_chunk_kv``)."""
        cfg = self.config
        if cfg.embedding_kv == "all":
            return request.input_len
        done = request.num_computed
        left = request.input_len - done
        if left <= 1:
            return done
        size = cfg.chunk_size or left
        return done + (left - 1) // size * size

    def writes_kv(self, item: BatchItem) -> bool:
        """Whether ``item`` stores its keys and values in the cache: every item but an
        embedding's last chunk under ``embedding_kv: read`` (nothing attends to that one's
        after the pass). Executors write the slots of exactly these items."""
        return (item.kind is not EMBED_CHUNK or self.config.embedding_kv == "all"
                or item.end < item.request.input_len)

    def _embed_slots_full(self) -> bool:
        cap = self.config.max_num_embeds
        return cap is not None and len(self._embeds_holding) >= cap

    def _kv_allows(self, blocks: int, request_id: str) -> bool:
        """Admission test: ``blocks`` fit beside what is held back for other requests."""
        held = self._held_back
        if held:
            held -= self._held_for.get(request_id, 0)
        manager = self.blocks
        return blocks <= len(manager._free) - manager.virtual - held  # num_free, inlined

    def _final_blocks(self, request: Request) -> int:
        """Blocks a generation request will hold at its expected end."""
        final = request.input_len + max(request.expected_output_tokens, request.num_generated + 1)
        return max(self.blocks.held(request.request_id), self.blocks.blocks_for(final))

    def _reserve_fits(self, blocks: int, request_id: str) -> bool:
        """``kv_admission: reserve``: the running generations' expected final sizes, what
        embeddings hold, what is held back for other requests and ``blocks`` more (the
        newcomer's final size) all fit the cache. Embeddings are admitted by it too: blocks an
        embedding takes are blocks a running decode may need. (``schedule_embedding`` and
        ``schedule_generation`` test the mode themselves before calling it.)"""
        if self.config.kv_admission != "reserve":
            return True
        self._sync_cohort()  # the running decodes' sizes, as they stand
        projected = sum(self._final_blocks(r) for r in self._running)
        held_for_others = self._held_back - self._held_for.get(request_id, 0)
        return (projected + self.embedding_blocks() + held_for_others + blocks
                <= self.blocks.num_blocks)

    def _hold_back(self, request_id: str, blocks: int) -> None:
        """Set ``blocks`` of the free pool aside for a waiting embedding head for the rest of
        this iteration: later admissions of other requests cannot take them."""
        if request_id not in self._held_for:
            self._held_for[request_id] = blocks
            self._held_back += blocks

    def embedding_blocks(self) -> int:
        """KV blocks held by embeddings in flight."""
        held = self.blocks.held
        return sum(held(rid) for rid in self._embeds_holding)

    def _admit(self, request: Request, num_tokens: int, now: float) -> None:
        rid = request.request_id
        if num_tokens and not self.blocks.grow(rid, num_tokens):
            raise RuntimeError(f"request {rid}: admitted without free blocks")
        request.transition(RUNNING)
        if request.admitted_at is None:
            request.admitted_at = now
        self._holding[rid] = request
        if request.is_embedding:
            self._embeds_holding[rid] = request
        self._unqueue_work(request)

    def _release(self, request: Request) -> None:
        rid = request.request_id
        self.blocks.free(rid)
        held = self._holding.pop(rid, None) is not None
        self._requests.pop(rid, None)
        if not held:  # only a request holding no blocks has queued work
            self._unqueue_work(request)
        if request.is_embedding:
            self._embeds_holding.pop(rid, None)
            try:
                self._embeddings.remove(request)
            except ValueError:
                pass  # never queued here
        else:  # a request holding blocks is among the running, one holding none waits
            self._running_order.pop(rid, None)
            if held:
                _discard(self._running, request)
                if self._prefilling:  # most leave decoding: a raised ValueError costs ~1 us
                    _discard(self._prefilling, request)
            else:
                _discard(self._waiting_gen, request)

    def _finish(self, request: Request, now: float) -> None:
        self._release(request)
        request.transition(FINISHED)
        request.finished_at = now

    def _preempt(self, victim: Request) -> None:
        """Recompute-preemption: free the victim's blocks and put it back in its queue."""
        self.blocks.free(victim.request_id)
        del self._holding[victim.request_id]
        self._running_order.pop(victim.request_id, None)
        self._embeds_holding.pop(victim.request_id, None)
        victim.transition(RequestState.WAITING)
        victim.reset_for_recompute()
        self._queue_work(victim)
        self.preemptions[victim.kind.value] += 1
        if not victim.is_embedding:
            self._running.remove(victim)
            if victim in self._prefilling:
                self._prefilling.remove(victim)
            insert_in_order(self._waiting_gen, victim)


def _discard(queue: list[Request], request: Request) -> None:
    """Take ``request`` out of ``queue`` if it is there."""
    try:
        queue.remove(request)
    except ValueError:
        pass  # not in this one
