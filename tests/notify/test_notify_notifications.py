"""Notifications: the payloads, and delivery to real HTTP receivers on loopback (one that works, one that answers 500,
one that hangs): in order, retried with backoff, bounded, never waiting, and never showing the URL."""

from __future__ import annotations

import asyncio
import base64
import itertools
import logging
from datetime import UTC, datetime, timedelta

import pytest
from fake_kube import FakeKubeApi
from kvpolicy.api.v1alpha1 import Decision, NotificationEvent, NotificationSpec, Phase, WebhookFormat
from kvpolicy.kube.api import SECRETS
from kvpolicy.notify import metrics
from kvpolicy.notify.notifier import (
    DeliverySettings,
    Notifier,
    NotifierConfig,
    Receiver,
    Source,
    payload,
    receivers,
)
from kvpolicy.rollout.step_types import Notice
from operator_helpers import NAMESPACE, make_policy
from webhooks import Receivers, loopback_receivers

AT = datetime(2026, 12, 1, 10, 0, tzinfo=UTC)
SOURCE = Source(name="llama-fp8", namespace=NAMESPACE, uid="uid-1", generation=3, target="llama")
TOKEN = "T0KEN-s3cret"  # part of every receiver URL: must never show up in logs or events
FAST = DeliverySettings(attempts=3, timeout_seconds=0.5, backoff_seconds=0.05)
PHASES = [None, Phase.PLANNING, Phase.CANARY_STARTING, Phase.ACCURACY_GATE, Phase.LATENCY_ANALYSIS, Phase.PROMOTING]


def phase_changes(count: int = 5) -> list[Notice]:
    return [
        Notice(
            kind=NotificationEvent.PHASE_CHANGED,
            phase=after,
            previous_phase=before,
            rollout_id="3-0a1b2c",
            message=f"now {after}",
            at=AT + timedelta(seconds=index),
        )
        for index, (before, after) in enumerate(itertools.pairwise(PHASES))
    ][:count]


def secret(name: str, url: str) -> dict[str, object]:
    return {"metadata": {"name": name}, "data": {"url": base64.b64encode(url.encode()).decode()}}


def receiver(name: str, format_: str = "CloudEvents", secret_name: str | None = None) -> dict[str, object]:
    return {"name": name, "format": format_, "urlSecretRef": {"name": secret_name or name, "key": "url"}}


def api_with_secrets(hooks: Receivers) -> FakeKubeApi:
    api = FakeKubeApi()
    for kind in ("ok", "fail", "hang"):
        api.put(SECRETS, NAMESPACE, secret(kind, f"{hooks.url}/{kind}/{TOKEN}"))
    return api


def sent(format_: str, result: str) -> float:
    value = metrics.OPERATOR_METRICS.registry.get_sample_value(
        "kvpolicy_notifications_total", {"format": format_, "result": result}
    )
    return value or 0.0


# -------------------------------------------------------------------------------------------------------- payloads


def test_a_cloudevent_carries_the_phase_change_and_a_stable_id() -> None:
    notice = phase_changes(2)[1]
    body, content_type = payload(WebhookFormat.CLOUD_EVENTS, notice, SOURCE)
    assert content_type == "application/cloudevents+json"
    assert body["specversion"] == "1.0" and body["type"] == "dev.kvpolicy.rollout.phase.changed"
    assert body["source"] == f"/apis/kvpolicy.dev/v1alpha1/namespaces/{NAMESPACE}/kvpolicies/llama-fp8"
    assert body["time"] == "2026-12-01T10:00:01.000Z" and body["subject"] == "llama-fp8"
    assert body["data"]["phase"] == "CanaryStarting" and body["data"]["previousPhase"] == "Planning"
    assert body["data"]["rolloutId"] == "3-0a1b2c"
    assert body["id"] == payload(WebhookFormat.CLOUD_EVENTS, notice, SOURCE)[0]["id"]
    assert body["id"] != payload(WebhookFormat.CLOUD_EVENTS, phase_changes(1)[0], SOURCE)[0]["id"]


def test_slack_and_teams_payloads_say_what_was_decided() -> None:
    decision = Decision(
        result="Promoted", reason="GatesPassed", message="llama runs FP8 KV", time="2026-12-01T10:00:00Z"
    )
    notice = Notice(NotificationEvent.DECIDED, Phase.PROMOTED, Phase.PROMOTED, "3-0a1b2c", "done", AT, decision)
    slack, _ = payload(WebhookFormat.SLACK, notice, SOURCE)
    assert slack["text"].startswith(f"*KVPolicy {NAMESPACE}/llama-fp8: Promoted (GatesPassed)*")
    assert slack["blocks"][0]["text"]["type"] == "mrkdwn"
    teams, content_type = payload(WebhookFormat.TEAMS, notice, SOURCE)
    card = teams["attachments"][0]
    assert teams["type"] == "message" and content_type == "application/json"
    assert card["contentType"] == "application/vnd.microsoft.card.adaptive"
    assert card["content"]["type"] == "AdaptiveCard" and "Promoted (GatesPassed)" in card["content"]["body"][0]["text"]


def test_a_policy_without_receivers_uses_the_operators_defaults() -> None:
    defaults = (Receiver("kvpolicy-system", NotificationSpec.model_validate(receiver("ops", "Slack"))),)
    assert receivers(make_policy(), defaults) == list(defaults)
    own = make_policy(notifications=[receiver("team")])
    assert [(r.namespace, r.spec.name) for r in receivers(own, defaults)] == [(NAMESPACE, "team")]


@pytest.mark.parametrize(
    ("text", "namespace", "error"),
    [
        ('[{"name": "ops"}]', "ops", "KVPOLICY_NOTIFICATIONS: Field required at 0.urlSecretRef"),
        ('{"name": "ops"}', "ops", "KVPOLICY_NOTIFICATIONS: Input should be a valid array at the top"),
        (f"[{receiver('ops')}]".replace("'", '"'), "", "needs KVPOLICY_NAMESPACE"),
    ],
)
def test_operator_default_receivers_that_are_wrong_say_so(text: str, namespace: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        NotifierConfig.parse(text, namespace, DeliverySettings())


# -------------------------------------------------------------------------------------------------------- delivery


async def test_a_working_receiver_gets_every_notice_in_order_while_others_fail_and_hang(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    with loopback_receivers() as hooks:
        api = api_with_secrets(hooks)
        policy = make_policy(notifications=[receiver("ok"), receiver("fail"), receiver("hang")])
        notifier = Notifier(api, settings=FAST)
        failed_before = sent("CloudEvents", "failed")
        notifier.submit(policy, phase_changes())  # returns at once: delivery is the workers'
        ok_queue = next(q for key, q in notifier._queues.items() if "ok" in key)
        await asyncio.wait_for(ok_queue.join(), 10)
        assert [r.body["data"]["phase"] for r in hooks.of("ok")] == [
            "Planning",
            "CanaryStarting",
            "AccuracyGate",
            "LatencyAnalysis",
            "Promoting",
        ]
        assert hooks.hanging_now == 1, "the hanging receiver still holds its first notice"
        await asyncio.wait_for(notifier.drained(), 60)
        await notifier.close()
    assert len(hooks.of("fail")) == 5 * FAST.attempts, "every notice retried to the limit"
    assert len(hooks.of("hang")) == 5 * FAST.attempts, "every attempt timed out and was retried"
    assert sent("CloudEvents", "failed") - failed_before == 10
    failures = [e for e in api.events if e["reason"] == "NotificationFailed"]
    assert len(failures) == 2, "one event per failing receiver, not one per notice"
    assert {"HTTP 500", "no answer within 0.5 s"} <= {m for e in failures for m in [e["message"].split("(")[-1][:-1]]}
    operator_logs = [r.getMessage() for r in caplog.records if r.name.startswith("kvpolicy")]
    assert any("gave up" in line for line in operator_logs)
    for text in [*(e["message"] for e in api.events), *operator_logs]:
        assert TOKEN not in text and hooks.url not in text
        assert "never reach" not in text, "a receiver's answer is never copied"


async def test_a_full_queue_drops_the_oldest_notices() -> None:
    with loopback_receivers() as hooks:
        api = api_with_secrets(hooks)
        settings = DeliverySettings(attempts=1, timeout_seconds=5, queue_size=2)
        notifier = Notifier(api, settings=settings)
        dropped_before = sent("CloudEvents", "dropped")
        notifier.submit(make_policy(notifications=[receiver("hang")]), phase_changes())
        assert sent("CloudEvents", "dropped") - dropped_before == 3
        await asyncio.sleep(0.5)
        assert [r.body["data"]["phase"] for r in hooks.of("hang")] == ["LatencyAnalysis"], "newest kept, in order"
        await notifier.close()


async def test_a_missing_secret_or_a_value_that_is_no_url_fails_without_showing_the_value() -> None:
    api = FakeKubeApi()
    api.put(SECRETS, NAMESPACE, secret("notaurl", f"ftp://example/{TOKEN}"))
    notifier = Notifier(api, settings=DeliverySettings(attempts=1))
    policy = make_policy(notifications=[receiver("gone"), receiver("bad", secret_name="notaurl")])
    notifier.submit(policy, phase_changes(1))
    await asyncio.wait_for(notifier.drained(), 10)
    await notifier.close()
    messages = sorted(e["message"] for e in api.events)
    assert messages == [
        f"receiver bad (Secret {NAMESPACE}/notaurl, key url): gave up after 1 attempts (Secret {NAMESPACE}/notaurl "
        "key url is not an http(s) URL)",
        f"receiver gone (Secret {NAMESPACE}/gone, key url): gave up after 1 attempts (Secret {NAMESPACE}/gone not "
        "found)",
    ]


async def test_receivers_only_get_the_events_they_ask_for() -> None:
    with loopback_receivers() as hooks:
        api = api_with_secrets(hooks)
        notifier = Notifier(api, settings=FAST)
        decision = Decision(result="RolledBack", reason="Aborted", message="aborted", time="2026-12-01T10:00:00Z")
        decided = Notice(NotificationEvent.DECIDED, Phase.ROLLING_BACK, Phase.PLANNING, "3-0a1b2c", "m", AT, decision)
        only_decisions = {**receiver("ok", "Slack"), "events": ["Decided"]}
        notifier.submit(make_policy(notifications=[only_decisions]), [*phase_changes(2), decided])
        await asyncio.wait_for(notifier.drained(), 10)
        await notifier.close()
    assert [r.body["text"].split("*")[1] for r in hooks.of("ok")] == [
        f"KVPolicy {NAMESPACE}/llama-fp8: RolledBack (Aborted)"
    ]
