"""Scheduler knobs shared by every policy, checked up front so a bad value names itself."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

WAITING_WORK_MODES = ("prompt", "prompt+output")
KV_ADMISSION_MODES = ("optimistic", "reserve")
EMBEDDING_KV_MODES = ("read", "all")


@dataclass(frozen=True)
class SchedulerConfig:
    """Knobs of one replica's scheduler.

    token_budget: tokens per iteration (``B`` in the brief).
    chunk_size: most tokens of one embedding request per iteration (``C``); ``None`` means
        embeddings are atomic (one pass each), as a stock embedding server runs them.
    max_num_seqs: most generation requests running (holding KV blocks) at once, vLLM's
        decode-slot cap. Embedding requests are bounded by the budget and the KV cache only:
        they hold blocks for a few iterations, and counting them against the decode slots
        would let long decodes block embeddings (head-of-line blocking).
    max_num_embeds: most embedding requests holding KV blocks at once (``None``: no cap).
        Executors with a fixed number of request slots per batch (vLLM's input batch) set it.
    block_size / num_blocks: the paged KV cache.
    waiting_work: how IBS counts a waiting generation request's remaining work: ``"prompt"``
        (prompt tokens only) or ``"prompt+output"`` (plus its expected output). ``None`` (the
        default) follows the target (``counted_work``): ``"prompt"``, the brief's IBS, or
        ``"prompt+output"`` where ``tpot_target_s`` is set: the target cuts the room beside
        decodes, and a queue weighed by its prompts alone gives the generations' prompts too
        little of it (docs/scheduler.md). Kept unresolved, so a copy with another target
        (``dataclasses.replace``) follows that one.
    max_model_len: longest sequence the model accepts; longer requests are rejected.
    kv_admission: when a generation request may take KV blocks: ``"optimistic"`` (its prompt
        fits; decodes grow later and preempt when the cache is full, as vLLM does) or
        ``"reserve"`` (the expected final length of every running generation, its own included,
        fits beside what embeddings hold: no preemption while outputs end within
        ``expected_output_tokens``; an embedding is admitted by the same test).
    tpot_target_s: an iteration-time target for iterations that carry decodes (seconds;
        ``None``: no target, the brief's behaviour). While decodes run, the chunks a policy adds
        are cut so that the batch's *predicted* time stays within it (docs/scheduler.md,
        "Iteration-time target"); the executor hands the policy the predictor.
    tpot_slack_iterations: how far one decode-carrying iteration may go over the target, in
        targets, out of what the running decodes saved (docs/scheduler.md, "Slack"): each
        decode's slack is what the iterations since it began decoding left of the target, and
        a chunk may go where the batch is predicted within the target plus the least slack of
        the running decodes. So the target holds on every decode's mean time per token (what
        TPOT measures), and a prompt or an embedding chunk may go whole now and then where a
        per-iteration cap would cut it to crumbs. ``0``: every iteration within the target (an
        inter-token cap).
    tpot_credit: what a decode may take over the target ahead and repay over its output, as a
        share of the target per decode it expects (at most ``tpot_slack_iterations`` targets
        in all): so that a prompt need not wait for the newest decode to save its cost first.
        Each iteration counts a target shorter by this share, so the credit is repaid by the
        decode's expected last token where its iterations leave that room; a decode ends over
        the target by at most the credit it took (``slack.py`` lists when).
    min_chunk_tokens: the smallest chunk the target cuts a prompt or embedding chunk to (and
        the step it cuts in); a shorter remainder goes whole.
    embedding_kv: which of an embedding's keys and values are stored in the KV cache:
        ``"read"`` (the default) only those a later chunk of it attends to, so its last chunk
        (a one-chunk embedding entirely) holds no blocks and writes nothing; ``"all"`` every
        token's, as an executor whose attention writes every scheduled token does (the vLLM
        plug-in: docs/vllm.md). ``KVAdmission.embed_kv_tokens`` has the rule.
    """

    token_budget: int = 4096
    chunk_size: int | None = 512
    max_num_seqs: int = 256
    max_num_embeds: int | None = None
    block_size: int = 16
    num_blocks: int = 4096
    waiting_work: str | None = None
    max_model_len: int | None = None
    kv_admission: str = "optimistic"
    tpot_target_s: float | None = None
    tpot_slack_iterations: int = 8
    tpot_credit: float = 0.01
    min_chunk_tokens: int = 32
    embedding_kv: str = "read"

    def __post_init__(self) -> None:
        def positive(name: str, value: object) -> None:
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"scheduler.{name} must be a positive integer, got {value!r}")

        positive("token_budget", self.token_budget)
        if self.chunk_size is not None:
            positive("chunk_size", self.chunk_size)
            if self.chunk_size > self.token_budget:
                raise ValueError(
                    f"scheduler.chunk_size ({self.chunk_size}) is larger than "
                    f"scheduler.token_budget ({self.token_budget}): a chunk could never fit"
                )
        positive("max_num_seqs", self.max_num_seqs)
        if self.max_num_embeds is not None:
            positive("max_num_embeds", self.max_num_embeds)
        positive("block_size", self.block_size)
        positive("num_blocks", self.num_blocks)
        if self.max_model_len is not None:
            positive("max_model_len", self.max_model_len)
        positive("min_chunk_tokens", self.min_chunk_tokens)
        if (isinstance(self.tpot_slack_iterations, bool)
                or not isinstance(self.tpot_slack_iterations, int) or self.tpot_slack_iterations < 0):
            raise ValueError(f"scheduler.tpot_slack_iterations must be a non-negative integer, "
                             f"got {self.tpot_slack_iterations!r}")
        if (isinstance(self.tpot_credit, bool) or not isinstance(self.tpot_credit, int | float)
                or not 0 <= self.tpot_credit < 1):
            raise ValueError(f"scheduler.tpot_credit must be a fraction in [0, 1), "
                             f"got {self.tpot_credit!r}")
        if self.tpot_target_s is not None and (
                isinstance(self.tpot_target_s, bool) or not isinstance(self.tpot_target_s, int | float)
                or not self.tpot_target_s > 0 or self.tpot_target_s == float("inf")):
            raise ValueError(f"scheduler.tpot_target_s must be a positive number of seconds, "
                             f"got {self.tpot_target_s!r}")
        if self.kv_admission not in KV_ADMISSION_MODES:
            raise ValueError(
                f"scheduler.kv_admission must be one of {', '.join(KV_ADMISSION_MODES)}, "
                f"got {self.kv_admission!r}"
            )
        if self.embedding_kv not in EMBEDDING_KV_MODES:
            raise ValueError(
                f"scheduler.embedding_kv must be one of {', '.join(EMBEDDING_KV_MODES)}, "
                f"got {self.embedding_kv!r}"
            )
        if self.waiting_work is not None and self.waiting_work not in WAITING_WORK_MODES:
            raise ValueError(
                f"scheduler.waiting_work must be one of {', '.join(WAITING_WORK_MODES)}, "
                f"got {self.waiting_work!r}"
            )

    @property
    def kv_tokens(self) -> int:
        """Tokens the paged KV cache holds."""
        return self.num_blocks * self.block_size

    @property
    def counted_work(self) -> str:
        """The ``waiting_work`` mode in force: the one chosen, or the target's default."""
        if self.waiting_work is not None:
            return self.waiting_work
        return "prompt+output" if self.tpot_target_s is not None else "prompt"

    @cached_property
    def count_waiting_output(self) -> bool:
        """Read once per queued request: computed once (the config is frozen; a copy made
        with ``dataclasses.replace`` computes its own)."""
        return self.counted_work == "prompt+output"
