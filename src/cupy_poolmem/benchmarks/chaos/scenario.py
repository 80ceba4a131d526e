"""The scenario of a round: pure, the same for one seed and round everywhere."""

from __future__ import annotations

import random
from typing import NamedTuple

# -- the scenario (pure: the same for one seed and round everywhere) ------------------------------
HUB = -1  # the hub's slot in a scenario
SIZES = (512, 4096, 32768, 131072)  # int64 elements per array: 4 KiB to 1 MiB
ACTIONS = ("drop", "hold", "forward", "return")
#: Forged descriptor fields (or pairs of them), each with the change applied.
FORGERIES = (
    "ticket",
    "export_id",
    "size",
    "size+shape",
    "size+offset",
    "offset",
    "offset+shape",
    "shape-larger",
    "shape-smaller",
    "strides-negative",
    "strides-reversed",
    "strides-huge",
    "dtype-object",
    "dtype-wider",
    "dtype-reinterpret",
    "life-newer",
    "life-older",
    "life-huge",
    "version",
)
#: Every kind of event a scenario may draw (each covered over a few dozen rounds).
EVENT_KINDS = (
    "kill_producer",
    "kill_consumer",
    "kill_forwarder",
    "returning_producer",
    "forward",
    "round_trip",
    "replay_other",
    "replay_stale",
    "replay_vault",
    "forge",
    "hub_load",
    "trim_pool",
    "close_pool",
    "killed_writer",
)


class Route(NamedTuple):
    """One delivery: copy ``copy`` of array ``array`` of a batch goes to ``consumer``."""

    array: int
    copy: int
    consumer: int  # worker slot, or HUB
    action: str  # one of ACTIONS
    forward_to: int  # the slot a forwarded message goes on to


class Batch(NamedTuple):
    """Arrays one producer makes in a round, and where their messages go."""

    producer: int  # worker slot, or HUB
    sizes: tuple[int, ...]
    copies: int  # pickled messages per array
    then: str  # "hold", "drop", "return" (workers), "recycle", "close" (the hub's temp pool)
    routes: tuple[Route, ...]


class Event(NamedTuple):
    kind: str  # one of EVENT_KINDS
    target: int  # worker slot, or HUB
    delay_ms: int
    detail: str  # a forged field, the batch of a kill...


class Plan(NamedTuple):
    number: int
    batches: tuple[Batch, ...]
    events: tuple[Event, ...]


def make_plan(seed: int, index: int, n_workers: int) -> Plan:
    """The scenario of round ``index`` (depends only on ``seed``, ``index``, ``n_workers``)."""
    rng = random.Random(f"cupy_poolmem-chaos:{seed}:{index}")
    slots = list(range(n_workers))
    batches: list[Batch] = []
    producers = rng.sample([HUB, *slots], rng.randint(1, min(3, n_workers)))
    events: list[Event] = []
    close = rng.random() < 0.1
    if close and HUB not in producers:
        producers[0] = HUB
    for prod in producers:
        sizes = tuple(rng.choice(SIZES) for _ in range(rng.randint(1, 3)))
        if prod == HUB:
            then = "close" if close else rng.choice(("hold", "hold", "drop", "recycle", "recycle"))
        else:
            then = rng.choices(("hold", "drop", "recycle", "return"), (35, 30, 25, 10))[0]
        copies = 2 if then == "recycle" or rng.random() < 0.3 else 1
        routes = []
        for a in range(len(sizes)):
            for c in range(copies):
                # A copy not routed is kept: replayed from the vault in a later round.  A
                # recycled block's copies all go (an unclaimed one would pin its life).
                if c > 0 and then != "recycle" and rng.random() < 0.5:
                    continue
                others = [s for s in slots if s != prod] or slots
                if prod != HUB and rng.random() < 0.1:
                    consumer = HUB
                else:
                    consumer = rng.choice(others if rng.random() < 0.9 else slots)
                if then == "close":
                    action = "hold"
                elif consumer == HUB:
                    action = rng.choice(("drop", "hold"))
                elif then == "recycle":  # mostly let go, so that the block can recycle
                    action = rng.choice(("drop", "drop", "forward", "hold"))
                else:
                    action = rng.choices(ACTIONS, (45, 30, 15, 10))[0]
                fwd = rng.choice([s for s in slots if s != consumer] or slots)
                routes.append(Route(a, c, consumer, action, fwd))
        batches.append(Batch(prod, sizes, copies, then, tuple(routes)))
    if rng.random() < 0.35:
        kinds = []
        if any(b.producer != HUB and b.then != "return" for b in batches):
            kinds.append("kill_producer")
        if any(r.consumer != HUB for b in batches for r in b.routes):
            kinds.append("kill_consumer")
        if any(r.action == "forward" for b in batches for r in b.routes):
            kinds.append("kill_forwarder")
        if kinds:
            kind = rng.choice(kinds)
            if kind == "kill_producer":
                b = rng.choice([b for b in batches if b.producer != HUB and b.then != "return"])
                events.append(Event(kind, b.producer, rng.randint(0, 150), ""))
            elif kind == "kill_consumer":
                r = rng.choice([r for b in batches for r in b.routes if r.consumer != HUB])
                events.append(Event(kind, r.consumer, rng.randint(0, 300), ""))
            else:
                r = rng.choice([r for b in batches for r in b.routes if r.action == "forward"])
                events.append(Event(kind, r.consumer, rng.randint(0, 60), ""))
    if any(b.then == "hold" for b in batches) and rng.random() < 0.5:  # forged from live ones
        for _ in range(rng.randint(1, 2)):
            events.append(Event("forge", rng.choice(slots), 0, rng.choice(FORGERIES)))
    for b in batches:
        if b.then == "recycle" and rng.random() < 0.85:
            target = rng.choice([*slots, HUB] if rng.random() < 0.2 else slots)
            events.append(Event("replay_stale", target, 0, ""))
    if rng.random() < 0.3:
        for _ in range(rng.randint(1, 2)):
            target = HUB if rng.random() < 0.25 else rng.choice(slots)
            events.append(Event("replay_vault", target, 0, ""))
    if rng.random() < 0.15:
        events.append(Event("trim_pool", HUB, 0, ""))
    if rng.random() < 0.06:
        events.append(Event("killed_writer", rng.choice(slots), 0, ""))
    return Plan(index, tuple(batches), tuple(events))


def kinds_of(plan: Plan) -> set[str]:
    """The event kinds a plan exercises (its events, and what its batches and routes do)."""
    out = {e.kind for e in plan.events}
    if any(e.kind == "replay_vault" and e.target == HUB for e in plan.events):
        out.add("hub_load")
    for b in plan.batches:
        if b.then == "return":
            out.add("returning_producer")
        if b.then == "close":
            out.add("close_pool")
        for r in b.routes:
            if r.action == "forward":
                out.add("forward")
            if r.action == "return":
                out.add("round_trip")
            if r.copy > 0:
                out.add("replay_other")
            if r.consumer == HUB:
                out.add("hub_load")
    return out


def pattern_base(seed: int, key: tuple) -> int:
    """The first element of the array made for ``key``: elements are ``base + i``.

    Bases are 40 random bits shifted past any index, so two arrays never share a value.
    """
    rng = random.Random(f"cupy_poolmem-chaos-data:{seed}:{key}")
    return (rng.getrandbits(40) + 1) << 20
