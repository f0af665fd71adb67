"""`kubectl kvpolicy`: watch and steer KVPolicy rollouts (after `kubectl argo rollouts`).

Installed as the `kubectl-kvpolicy` console script, so kubectl runs it as `kubectl kvpolicy ...` once it is on PATH.
It talks to the API server as kubectl does: the user's kubeconfig (KUBECONFIG, --kubeconfig, --context) and the
user's RBAC. The commands that steer a rollout patch the policy's spec.rollout, each naming what it acts on:
`approve` and `retry` name the current rollout (status.rolloutId), so neither can carry over to another rollout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, NoReturn

import aiohttp
from kubernetes_asyncio import client, config
from kubernetes_asyncio.config.config_exception import ConfigException

from kvpolicy.api.v1alpha1 import GROUP, KIND, PLURAL, VERSION, Approval, KVPolicy, Phase
from kvpolicy.kube.observe import gpu_node_selector, pool_gpu_facts
from kvpolicy.planning.planner import plan
from kvpolicy.plugin import view
from kvpolicy.rollout.step_types import CustomKind
from kvpolicy.rollout.targets import target_kind
from kvpolicy.rollout.tick import CANARY_PHASES

Obj = dict[str, Any]
PROG = "kubectl kvpolicy"
CLEAR_SCREEN = "\x1b[H\x1b[2J"
MERGE_PATCH = "application/merge-patch+json"


class PluginError(Exception):
    """What went wrong, in words for the user; exits 1."""


class ApiFailure(Exception):
    """The API server refused a request; `message` is its Status message."""

    def __init__(self, status: int, text: str) -> None:
        try:
            body = json.loads(text)
        except ValueError:
            body = {}
        self.status = status
        self.reason = str(body.get("reason") or "") if isinstance(body, dict) else ""
        self.message = str(body.get("message") or text[:300]) if isinstance(body, dict) else text[:300]
        super().__init__(f"{status} {self.reason}: {self.message}")


async def _json(method: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any) -> Obj:
    """Call a generated API method and return the JSON as the API server sent it (the library's models would drop
    fields they do not know)."""
    response = await method(*args, **kwargs, _preload_content=False)
    async with response:
        text = await response.text()
        if response.status >= 400:
            raise ApiFailure(response.status, text)
    result: Obj = json.loads(text) if text else {}
    return result


@dataclass
class Session:
    """The API as the user's kubeconfig reaches it, and the namespace commands act in."""

    api: client.ApiClient
    namespace: str

    @property
    def custom(self) -> client.CustomObjectsApi:
        return client.CustomObjectsApi(self.api)

    @property
    def core(self) -> client.CoreV1Api:
        return client.CoreV1Api(self.api)

    async def policy(self, name: str) -> Obj:
        return await _json(self.custom.get_namespaced_custom_object, GROUP, VERSION, self.namespace, PLURAL, name)

    async def events(self, name: str) -> list[Obj]:
        found = await _json(
            self.core.list_namespaced_event, self.namespace, field_selector=f"involvedObject.name={name}"
        )
        return [e for e in found.get("items") or [] if (e.get("involvedObject") or {}).get("kind") == KIND]

    async def patch_rollout(self, name: str, fields: Obj) -> None:
        await _json(
            self.custom.patch_namespaced_custom_object,
            GROUP,
            VERSION,
            self.namespace,
            PLURAL,
            name,
            {"spec": {"rollout": fields}},
            _content_type=MERGE_PATCH,
        )

    async def changes(self, name: str, timeout_seconds: int) -> AsyncIterator[None]:
        """One item per watch event on the policy, until the server ends the stream."""
        response = await self.custom.list_namespaced_custom_object(
            GROUP,
            VERSION,
            self.namespace,
            PLURAL,
            field_selector=f"metadata.name={name}",
            watch=True,
            timeout_seconds=timeout_seconds,
            _preload_content=False,
        )
        async with response:
            if response.status >= 400:
                raise ApiFailure(response.status, await response.text())
            async for line in response.content:
                if line.strip():
                    yield None


def _now() -> datetime:
    return datetime.now(UTC)


def _namespace_of(kubeconfig: str | None, context: str | None) -> str:
    contexts, active = config.list_kube_config_contexts(config_file=kubeconfig)
    chosen = next((c for c in contexts if c.get("name") == context), None) if context else active
    return str(((chosen or {}).get("context") or {}).get("namespace") or "default")


async def _connect(args: argparse.Namespace) -> Session:
    configuration = client.Configuration()
    try:
        await config.load_kube_config(
            config_file=args.kubeconfig, context=args.context, client_configuration=configuration
        )
        namespace = args.namespace or _namespace_of(args.kubeconfig, args.context)
    except (ConfigException, FileNotFoundError, OSError) as error:
        raise PluginError(f"no usable kubeconfig ({error}); set KUBECONFIG or pass --kubeconfig") from None
    api = client.ApiClient(configuration)
    api.user_agent = "kubectl-kvpolicy"
    return Session(api, namespace)


# ------------------------------------------------------------------------------------------------------ commands


async def _get(session: Session, args: argparse.Namespace) -> None:
    if not args.watch:
        sys.stdout.write(view.render_get(await session.policy(args.name), await session.events(args.name), _now()))
        return
    await _watch(session, args.name, args.interval, args.timeout)


async def _watch(session: Session, name: str, interval: float, stop_after: float) -> None:
    """Redraw the view whenever the policy changes (a watch), and every `interval` seconds for the ages; stop after
    `stop_after` seconds (0: when interrupted)."""
    changed = asyncio.Event()

    async def follow() -> None:
        while True:
            with contextlib.suppress(ApiFailure, aiohttp.ClientError, TimeoutError):
                async for _ in session.changes(name, timeout_seconds=300):
                    changed.set()
            await asyncio.sleep(interval)

    tty = sys.stdout.isatty()
    follower = asyncio.ensure_future(follow())
    deadline = asyncio.get_running_loop().time() + stop_after if stop_after > 0 else None
    shown = ""
    try:
        while deadline is None or asyncio.get_running_loop().time() < deadline:
            screen = view.render_get(await session.policy(name), await session.events(name), _now())
            if tty:
                sys.stdout.write(CLEAR_SCREEN + screen)
            elif screen != shown:
                sys.stdout.write(screen + "\n")
            sys.stdout.flush()
            shown = screen
            changed.clear()
            wait = interval if deadline is None else min(interval, deadline - asyncio.get_running_loop().time())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), max(0.0, wait))
    finally:
        follower.cancel()
        await asyncio.gather(follower, return_exceptions=True)


async def _list(session: Session, args: argparse.Namespace) -> None:
    if args.all_namespaces:
        found = await _json(session.custom.list_cluster_custom_object, GROUP, VERSION, PLURAL)
    else:
        found = await _json(session.custom.list_namespaced_custom_object, GROUP, VERSION, session.namespace, PLURAL)
    sys.stdout.write(view.render_list(found.get("items") or [], _now(), args.all_namespaces))


def _parsed(raw: Obj) -> KVPolicy:
    try:
        return KVPolicy.model_validate(raw)
    except ValueError as error:
        raise PluginError(f"kvpolicy {raw['metadata']['name']} has an invalid spec: {error}") from None


async def _approve(session: Session, args: argparse.Namespace) -> None:
    policy = _parsed(await session.policy(args.name))
    status = policy.status
    if policy.spec.rollout.approval == Approval.AUTOMATIC:
        raise PluginError(f"kvpolicy {args.name} promotes without approval (spec.rollout.approval is Automatic)")
    if status.phase not in CANARY_PHASES | {Phase.PLANNING} or status.rollout_id is None:
        phase = status.phase.value if status.phase else "Pending"
        raise PluginError(f"kvpolicy {args.name} has no rollout to approve: it is {phase}")
    # approved: the deprecated flag goes, so the spec says one thing.
    await session.patch_rollout(args.name, {"approvedRollout": status.rollout_id, "approved": None})
    print(f"kvpolicy '{args.name}' rollout {status.rollout_id} approved")


async def _retry(session: Session, args: argparse.Namespace) -> None:
    policy = _parsed(await session.policy(args.name))
    status = policy.status
    if status.phase != Phase.ROLLED_BACK or status.rollout_id is None:
        phase = status.phase.value if status.phase else "Pending"
        raise PluginError(f"kvpolicy {args.name} is {phase}: only a RolledBack rollout can be retried")
    await session.patch_rollout(args.name, {"retryRollout": status.rollout_id, "abort": False})
    print(f"kvpolicy '{args.name}' rollout {status.rollout_id} retried")


def _control(
    field: str, value: bool, done: str, already: str
) -> Callable[[Session, argparse.Namespace], Awaitable[None]]:
    async def run(session: Session, args: argparse.Namespace) -> None:
        found = await session.policy(args.name)  # NotFound says so before any patch
        if bool(((found.get("spec") or {}).get("rollout") or {}).get(field, False)) == value:
            print(f"kvpolicy '{args.name}' {already}: nothing to do")
            return
        await session.patch_rollout(args.name, {field: value})
        print(f"kvpolicy '{args.name}' {done}")

    return run


async def _explain(session: Session, args: argparse.Namespace) -> None:
    """The planner's reasons for this policy on the GPUs the target's nodes have now."""
    policy = _parsed(await session.policy(args.name))
    ref = policy.spec.target_ref
    kind = target_kind(ref).object_kind
    try:
        if isinstance(kind, CustomKind):
            custom = client.CustomObjectsApi(session.api)
            read = custom.get_namespaced_custom_object
            target = await _json(read, kind.group, kind.version, session.namespace, kind.plural, ref.name)
        else:
            target = await _json(client.AppsV1Api(session.api).read_namespaced_deployment, ref.name, session.namespace)
    except ApiFailure as error:
        if error.status != 404:
            raise
        raise PluginError(f"target {ref.kind.value} {ref.name} not found in {session.namespace}") from None
    selector = gpu_node_selector(policy, target)
    label_selector = ",".join(f"{key}={value}" for key, value in sorted(selector.items()))
    nodes = await _json(session.core.list_node, label_selector=label_selector)
    facts = pool_gpu_facts(policy, target, nodes.get("items") or [])
    planned = plan(policy.spec, facts)
    lines = [
        f"Plan for {session.namespace}/{args.name} on the cluster's GPUs now",
        view.table(
            [
                ["Nodes:", f"{facts.nodes} matching {label_selector}"],
                ["GPU:", f"{facts.product or facts.generation.value} ({facts.generation.value}, {facts.source})"],
                ["KV cache:", planned.kv_cache_dtype.value],
                ["Arguments:", " ".join(planned.extra_args) or "-"],
                ["Image:", planned.image or "the target's"],
                ["Gates:", ", ".join(planned.gates) or "none"],
            ],
            "  ",
        ),
        "Reasons:",
        *[f"  {reason.severity.value:<8}{reason.code}: {reason.message}" for reason in planned.reasons],
    ]
    recorded = policy.status.plan
    if recorded is None:
        lines.append("The operator has not planned this policy yet.")
    elif recorded.model_dump(exclude={"reasons"}) == planned.model_dump(exclude={"reasons"}):
        lines.append(f"Same plan as the operator's in status (rollout {policy.status.rollout_id}).")
    else:
        lines.append(
            f"Differs from the plan in status (rollout {policy.status.rollout_id}: {recorded.kv_cache_dtype.value}, "
            f"{' '.join(recorded.extra_args) or 'no arguments'}): the spec or the GPUs changed since it was planned."
        )
    print("\n".join(line if isinstance(line, str) else "\n".join(line) for line in lines))


COMMANDS: dict[str, Callable[[Session, argparse.Namespace], Awaitable[None]]] = {
    "get": _get,
    "list": _list,
    "approve": _approve,
    "retry": _retry,
    "abort": _control("abort", True, "aborted: rolling back to BF16", "is already aborted"),
    "pause": _control("paused", True, "paused", "is already paused"),
    "resume": _control("paused", False, "resumed", "is not paused"),
    "explain": _explain,
}


def _connection_flags(default: object) -> argparse.ArgumentParser:
    flags = argparse.ArgumentParser(add_help=False)
    flags.add_argument("-n", "--namespace", default=default, help="namespace (default: the kubeconfig context's)")
    flags.add_argument("--kubeconfig", default=default, help="kubeconfig file (default: KUBECONFIG, ~/.kube/config)")
    flags.add_argument("--context", default=default, help="kubeconfig context (default: the current one)")
    return flags


def _parser() -> argparse.ArgumentParser:
    # The flags go before or after the command; after it, only a flag given keeps the value given before it.
    common = _connection_flags(argparse.SUPPRESS)
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0], parents=[_connection_flags(None)])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    get = commands.add_parser("get", parents=[common], help="show a policy's rollout: plan, gates, conditions, events")
    get.add_argument("name")
    get.add_argument("-w", "--watch", action="store_true", help="keep the view up to date until interrupted")
    get.add_argument("--interval", type=float, default=2.0, help="seconds between redraws while watching")
    get.add_argument("--timeout", type=float, default=0.0, help="stop watching after this many seconds (0: never)")
    listing = commands.add_parser("list", parents=[common], help="list policies")
    listing.add_argument("-A", "--all-namespaces", action="store_true")
    for name, text in (
        ("approve", "approve the rollout awaiting approval (it only: spec.rollout.approvedRollout)"),
        ("abort", "abort the rollout and roll back to BF16 (spec.rollout.abort)"),
        ("pause", "hold the rollout where it is (spec.rollout.paused)"),
        ("resume", "resume a paused rollout"),
        ("retry", "run a RolledBack rollout again (spec.rollout.retryRollout)"),
        ("explain", "why this plan: the planner's reasons for this policy on the cluster's GPUs now"),
    ):
        commands.add_parser(name, parents=[common], help=text).add_argument("name")
    return parser


def _fail(message: str) -> NoReturn:
    sys.stderr.write(f"error: {message}\n")
    raise SystemExit(1)


async def _run(args: argparse.Namespace) -> None:
    session = await _connect(args)
    try:
        await COMMANDS[args.command](session, args)
    finally:
        await session.api.close()


def _api_message(error: ApiFailure, args: argparse.Namespace) -> str:
    if error.status == 404 and getattr(args, "name", None):
        return f"kvpolicy {args.name} not found in namespace {args.namespace or 'of the current context'}"
    return f"{error.status} {error.reason}: {error.message}" if error.reason else f"{error.status}: {error.message}"


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        asyncio.run(_run(args))
    except KeyboardInterrupt:
        return 0
    except PluginError as error:
        _fail(str(error))
    except ApiFailure as error:
        _fail(_api_message(error, args))
    except (aiohttp.ClientError, TimeoutError) as error:
        _fail(f"cannot reach the API server: {error or type(error).__name__}")
    return 0
