"""Passes in flight are bounded, and urgent ones go first (runtime/pass_slots.py): after a restart or a takeover, a
rollout in flight must not wait behind thousands of drift checks of policies at rest (issue 28 item 5)."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from fake_kube import FakeKubeApi
from kvpolicy.runtime.pass_slots import PassSlots
from kvpolicy.runtime.reconciler import Reconciler
from operator_helpers import CONFIG
from test_runtime_loops import raw_policy


async def test_urgent_waiters_go_first_and_each_kind_in_turn() -> None:
    slots = PassSlots(1)
    order: list[str] = []
    hold = asyncio.Event()

    async def one(name: str, urgent: bool) -> None:
        async with slots.slot(urgent):
            order.append(name)
            if name == "first":
                await hold.wait()

    tasks = [asyncio.create_task(one("first", False))]
    await asyncio.sleep(0)
    for name, urgent in (("rest-1", False), ("rest-2", False), ("urgent-1", True), ("urgent-2", True)):
        tasks.append(asyncio.create_task(one(name, urgent)))
        await asyncio.sleep(0)
    assert slots.waiting == 4
    hold.set()
    await asyncio.gather(*tasks)
    assert order == ["first", "urgent-1", "urgent-2", "rest-1", "rest-2"]
    assert slots.waiting == 0


async def test_never_more_in_flight_than_the_slots() -> None:
    slots = PassSlots(3)
    in_flight, most = 0, 0

    async def one(urgent: bool) -> None:
        nonlocal in_flight, most
        async with slots.slot(urgent):
            in_flight += 1
            most = max(most, in_flight)
            await asyncio.sleep(0.001)
            in_flight -= 1

    await asyncio.gather(*(one(index % 3 == 0) for index in range(40)))
    assert most == 3


async def test_a_cancelled_waiter_neither_keeps_nor_loses_a_slot() -> None:
    slots = PassSlots(1)
    hold = asyncio.Event()
    done: list[str] = []

    async def one(name: str, urgent: bool) -> None:
        async with slots.slot(urgent):
            done.append(name)
            if name == "first":
                await hold.wait()

    first = asyncio.create_task(one("first", True))
    await asyncio.sleep(0)
    cancelled = asyncio.create_task(one("cancelled", True))
    later = asyncio.create_task(one("later", False))
    await asyncio.sleep(0)
    cancelled.cancel()
    await asyncio.sleep(0)
    hold.set()
    await asyncio.gather(first, later)
    assert cancelled.cancelled() and done == ["first", "later"]
    async with slots.slot(False):  # the slot came back
        pass
    assert slots.waiting == 0


def body(generation: int, **status: Any) -> dict[str, Any]:
    raw = raw_policy("a")
    raw["metadata"]["generation"] = generation
    if status:
        raw["status"] = status
    return raw


def test_only_a_policy_at_rest_waits_behind_the_others() -> None:
    reconciler = Reconciler(FakeKubeApi(), CONFIG)
    cases = {
        "new": (body(1), True),
        "in flight": (body(1, phase="LatencyAnalysis", observedGeneration=1), True),
        "decided": (body(1, phase="Promoted", observedGeneration=1), False),
        "decided, then edited": (body(2, phase="Promoted", observedGeneration=1), True),
        "held BF16": (body(3, phase="HeldBF16", observedGeneration=3), False),
    }
    for what, (raw, urgent) in cases.items():
        reconciler._known["uid-a"] = raw
        assert reconciler._urgent("uid-a") is urgent, what
    del reconciler._known["uid-a"]
    reconciler._phases["uid-a"] = "Promoted"
    assert reconciler._urgent("uid-a") is False, "its last pass left it at rest"
    reconciler._loops["uid-a"] = cast(Any, "its loop runs")
    reconciler._generations["uid-a"] = 1
    reconciler.notice("uid-a", 2, deleting=False)  # a spec change since its last pass
    assert reconciler._urgent("uid-a") is True
