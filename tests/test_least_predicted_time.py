"""The least-predicted-time rule of the one router (orthrus_sim/routing/rules.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orthrus_sim.costmodel import CostModel, get_hardware, get_model
from orthrus_sim.engine import Request, RequestKind, SchedulerConfig
from orthrus_sim.experiment.scenario import load_scenario
from orthrus_sim.routing.rules import (
    ROLES_FOR,
    ROUTERS,
    LeastPredictedTime,
    _Load,
    make_router,
)
from orthrus_sim.sim.run import simulate
from tests.test_routing import COST, FakePolicy, FakeReplica

GEN_COST = CostModel(get_hardware("a100-40gb"), get_model("mistral-7b-v0.1"))  # no adapter
PLAIN = SchedulerConfig(token_budget=2048, chunk_size=512)  # no iteration-time target


def replica(index: int, role: str = "unified", work: int = 0, config: SchedulerConfig = PLAIN
            ) -> FakeReplica:
    """What a router needs of a replica, simulated or real (routing.py's docstring)."""
    return FakeReplica(index, role, work, GEN_COST if role in ("generation", "decode") else COST,
                       FakePolicy(config))


def gen(name: str, prompt: int = 128, output: int = 256, at: float = 0.0) -> Request:
    return Request(name, RequestKind.GENERATION, at, prompt, max_output_tokens=output)


def emb(name: str, tokens: int = 128, at: float = 0.0) -> Request:
    return Request(name, RequestKind.EMBEDDING, at, tokens)


def books(router) -> dict[int, tuple]:
    return {i: (x.generations, x.decode_kv, x.final_kv, x.embed_tokens, x.prompt_tokens,
                dict(x.prompts)) for i, x in router.load.items()}


def test_a_burst_goes_where_the_predicted_queue_is_cheaper_not_where_fewer_tokens_wait():
    """Replica 0 holds two long prompts (6,000 tokens to prefill: ~0.5 s of chunked iterations),
    replica 1 forty short decodes (8,640 tokens of work, but a decode shares its step: a new
    embedding rides in the next iteration beside them). Least-work counts tokens and sends the
    burst to replica 0; the cost model sends it to replica 1."""
    reps = [replica(0, work=2 * 3001), replica(1, work=40 * 216)]
    router = make_router("least-predicted-time", reps)
    assert isinstance(router, LeastPredictedTime)
    for i in range(2):  # the books a replica holding this work has (as routing it would leave)
        router._book(gen(f"p{i}", 3000, 1), reps[0])
    for i in range(40):
        router._book(gen(f"d{i}", 16, 200), reps[1])
    assert make_router("least-work", reps).route(emb("x")).index == 0
    burst = [emb(f"e{i}") for i in range(10)]
    assert router.predicted_s(reps[0], burst[0]) > 5 * router.predicted_s(reps[1], burst[0])
    assert [router.route(e).index for e in burst] == [1] * 10
    # the burst's own tokens count: enough of it and replica 0 gets some
    more = [router.route(emb(f"m{i}", 2000)).index for i in range(6)]
    assert 0 in more and 1 in more


def test_decodes_on_a_replica_slow_what_is_sent_there():
    """With the same queued chunk work, a replica with more decodes runs fewer chunk tokens per
    iteration and longer decode steps: a generation is predicted later there."""
    reps = [replica(0), replica(1)]
    router = make_router("least-predicted-time", reps)
    for i in range(60):
        router._book(gen(f"a{i}", 64, 2000), reps[0])
    for i in range(20):
        router._book(gen(f"b{i}", 192, 2000), reps[1])  # the same prompt tokens
    g = gen("new", at=10.0)  # every prompt predicted prefilled by then
    assert router.predicted_s(reps[1], g) < router.predicted_s(reps[0], g)
    assert router.route(g).index == 1


def test_ties_go_to_the_lowest_index_and_the_rule_is_deterministic():
    def placements():
        router = make_router("least-predicted-time", [replica(i) for i in range(3)])
        return [router.route(emb(f"e{i}")).index for i in range(6)]

    assert placements() == [0, 1, 2, 0, 1, 2]
    assert placements() == placements()


def test_release_restores_the_books():
    reps = [replica(i) for i in range(3)]
    router = make_router("least-predicted-time", reps)
    for i in range(5):
        router.route(gen(f"g{i}", 100 + i, 300))
    before = books(router)
    extra = [emb("e", 700), gen("g", 900, 50)]
    for r in extra:
        router.route(r)
    assert books(router) != before
    for r in extra:
        router.release(r)
    assert books(router) == before
    for i in range(5):
        router.release(gen(f"g{i}", 100 + i, 300))
    assert books(router) == books(make_router("least-predicted-time", reps))
    router.release(emb("never-routed"))  # a request it does not know changes nothing
    assert all(x == _Load() for x in router.load.values())


def test_a_prompt_stops_counting_once_predicted_prefilled():
    reps = [replica(0)]
    router = make_router("least-predicted-time", reps)
    router.route(gen("g", 4000, 3000))
    assert router.load[0].prompt_tokens == 4000
    (done, _), = router.load[0].prompts.values()
    router.route(emb("soon", at=done / 2))
    assert router.load[0].prompt_tokens == 4000
    router.route(emb("later", at=done))
    assert router.load[0].prompt_tokens == 0 and router.load[0].generations == 1


def test_kinds_go_only_to_replicas_whose_role_serves_them():
    dedicated = [replica(0, "embedding"), replica(1, "generation"), replica(2, "generation")]
    router = make_router("least-predicted-time", dedicated)
    assert {router.route(emb(f"e{i}")).index for i in range(20)} == {0}
    assert {router.route(gen(f"g{i}")).index for i in range(20)} == {1, 2}
    assert make_router("least-predicted-time", dedicated[:1]).route(gen("x")) is None

    disagg = [replica(0, "prefill"), replica(1, "decode"), replica(2, "decode")]
    router = make_router("least-predicted-time", disagg)
    g = gen("g", 500, 100)
    assert router.route(g).index == 0
    assert router.load[0].prompt_tokens == 500 and router.load[0].generations == 0
    router.release(g)  # prefilled: handed off
    g.num_computed = g.input_len
    assert router.hand_off(g).index == 1
    assert router.hand_off(gen("h", 500, 100)).index == 2  # the least loaded decode replica
    assert router.load[1].generations == 1 and router.load[1].prompt_tokens == 0
    router.release(g)
    assert router.load[1] == _Load() and router.load[0] == _Load()


PLACEMENTS = {
    "unified": [replica(0), replica(1), replica(2, config=SchedulerConfig(
        token_budget=1024, chunk_size=256, max_num_seqs=4, num_blocks=64, tpot_target_s=0.03))],
    "dedicated": [replica(0, "embedding"), replica(1, "generation"), replica(2, "generation")],
    "disagg": [replica(0, "prefill"), replica(1, "decode"), replica(2, "decode")],
}
OPS = st.lists(st.tuples(st.sampled_from(["e", "g", "release", "hand-off"]),
                         st.integers(1, 3000), st.integers(1, 2000), st.floats(0, 2)),
               min_size=1, max_size=120)


def _replay(placement: str, ops) -> list[int]:
    """Run ``ops`` against a fresh router; check its books after each; the placements."""
    reps = PLACEMENTS[placement]
    router = make_router("least-predicted-time", reps)
    live: dict[str, tuple[Request, object]] = {}
    placed, now = [], 0.0
    for n, (op, tokens, output, dt) in enumerate(ops):
        now += dt
        if op in ("release", "hand-off"):
            if live:
                rid = sorted(live)[tokens % len(live)]
                req, rep = live.pop(rid)
                router.release(req)
                if op == "hand-off" and rep.role == "prefill":
                    req.num_computed = req.input_len
                    to = router.hand_off(req)
                    assert to.role == "decode"
                    live[rid] = (req, to)
                    placed.append(to.index)
        else:
            req = (emb(f"r{n}", tokens, now) if op == "e" else gen(f"r{n}", tokens, output, now))
            rep = router.route(req)
            assert rep is not None and rep.role in ROLES_FOR[req.kind]
            live[req.request_id] = (req, rep)
            placed.append(rep.index)
        for x in router.load.values():
            assert min(x.generations, x.decode_kv, x.final_kv, x.embed_tokens, x.prompt_tokens) >= 0
            assert x.prompt_tokens == sum(t for _, t in x.prompts.values())
        gens = [r for r, rep in live.values() if not r.is_embedding and rep.role != "prefill"]
        assert sum(x.generations for x in router.load.values()) == len(gens)
    for req, _ in list(live.values()):
        router.release(req)
    assert all(x == _Load() for x in router.load.values())
    return placed


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(sorted(PLACEMENTS)), OPS)
def test_books_stay_true_whatever_comes_and_goes(placement, ops):
    """Every request lands on a replica serving its kind, the books never go negative and hold
    exactly what is placed, releasing everything empties them, and the same requests give the
    same placements."""
    assert _replay(placement, ops) == _replay(placement, ops)


def test_a_simulated_cluster_routes_by_predicted_time_deterministically():
    sets = ["duration_s=20", "warmup_s=5", "workload.arrival.clients=64",
            "workload.arrival.ramp_s=2", "workload.generation_output.value=64",
            "cluster.router=least-predicted-time"]
    sc = load_scenario("scenarios/mix_sweep.yaml", sets)
    first = simulate(sc, "orthrus", keep_rows=False).metrics
    again = simulate(load_scenario("scenarios/mix_sweep.yaml", sets), "orthrus",
                     keep_rows=False).metrics
    assert first["throughput_rps"]["embedding"] > 0 and first["throughput_rps"]["generation"] > 0
    first.pop("sim_wall_s"), again.pop("sim_wall_s")
    assert again == first
    split = simulate(sc, "disagg-pd-1:3", keep_rows=False).metrics  # hand-offs by the rule
    assert split["throughput_rps"]["generation"] > 0


def test_a_scenario_names_a_bad_router():
    with pytest.raises(ValueError, match="cluster.router.*least-predicted-time"):
        load_scenario("scenarios/mix_sweep.yaml", ["cluster.router=fastest"])


def test_the_catalogue_lists_the_routers():
    from typer.testing import CliRunner

    from orthrus_sim.cli import app

    res = CliRunner().invoke(app, ["catalogue"])
    assert res.exit_code == 0 and all(rule in res.output for rule in ROUTERS)
