"""`kubectl kvpolicy`: watch and steer KVPolicy rollouts (after `kubectl argo rollouts`).

Installed as the `kubectl-kvpolicy` console script, so kubectl runs it as `kubectl kvpolicy ...` once it is on PATH.
It talks to the API server as kubectl does: the user's kubeconfig (KUBECONFIG, --kubeconfig, --context) and the
user's RBAC. The commands that steer a rollout patch the policy's spec.rollout, each naming what it acts on:
`approve` and `retry` name the current rollout (status.rolloutId), so neither can carry over to another rollout.

Exit codes (api/exit_codes.py, as `kvpolicy plan` and `kvpolicy gate`): 0 done (`status`: Promoted or HeldBF16),
1 refused or failed (`status`: RolledBack), 2 `status --timeout` over before a decision, 64 usage error, 69 no usable
kubeconfig or the API server cannot be reached.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import aiohttp
import yaml
from kubernetes_asyncio import client, config
from kubernetes_asyncio.config.config_exception import ConfigException

from kvpolicy import __version__
from kvpolicy.api.exit_codes import (
    EXIT_FAILED,
    EXIT_INCONCLUSIVE,
    EXIT_OK,
    EXIT_UNAVAILABLE,
    UsageParser,
)
from kvpolicy.api.v1alpha1 import GROUP, KIND, PLURAL, VERSION, Approval, KVPolicy, Phase
from kvpolicy.kube.observe import gpu_node_selector, pool_gpu_facts
from kvpolicy.planning.planner import plan
from kvpolicy.plugin import view
from kvpolicy.rollout.tick import CANARY_PHASES

Obj = dict[str, Any]
PROG = "kubectl kvpolicy"
CLEAR_SCREEN = "\x1b[H\x1b[2J"
MERGE_PATCH = "application/merge-patch+json"


class PluginError(Exception):
    """What went wrong, in words for the user; exits EXIT_FAILED."""


class Unavailable(Exception):
    """No usable kubeconfig, or no API server answering; exits EXIT_UNAVAILABLE."""


# What loading a kubeconfig raises besides ConfigException: unreadable files, YAML that does not parse, YAML of the
# wrong shape (a list where a map belongs: TypeError, AttributeError, KeyError), bad base64 certificate data.
KUBECONFIG_ERRORS = (ConfigException, OSError, yaml.YAMLError, TypeError, AttributeError, KeyError, ValueError)


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


def _kubeconfig_problem(error: Exception) -> str:
    """One line saying what is wrong with a kubeconfig (a YAML error's first line and where; a wrongly shaped file
    is said to be one, with Python's words for what it tripped on)."""
    if isinstance(error, yaml.MarkedYAMLError) and error.problem_mark is not None:
        return f"not YAML: {error.problem} at line {error.problem_mark.line + 1}"
    if isinstance(error, (TypeError, AttributeError, KeyError)):
        return f"not a kubeconfig ({type(error).__name__}: {error})"
    return str(error).splitlines()[0] if str(error) else type(error).__name__


async def _connect(args: argparse.Namespace) -> Session:
    configuration = client.Configuration()
    where = args.kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"
    try:
        await config.load_kube_config(
            config_file=args.kubeconfig, context=args.context, client_configuration=configuration
        )
        namespace = args.namespace or _namespace_of(args.kubeconfig, args.context)
    except KUBECONFIG_ERRORS as error:
        problem = _kubeconfig_problem(error)
        raise Unavailable(f"no usable kubeconfig ({where}: {problem}); set KUBECONFIG or pass --kubeconfig") from None
    api = client.ApiClient(configuration)
    api.user_agent = "kubectl-kvpolicy"
    return Session(api, namespace)


# ------------------------------------------------------------------------------------------------------ commands

# A command: its exit code.
Command = Callable[[Session, argparse.Namespace], Awaitable[int]]


def _print_json(document: Any) -> None:
    sys.stdout.write(json.dumps(document, indent=2) + "\n")


async def _get(session: Session, args: argparse.Namespace) -> int:
    if args.output == "json":
        _print_json(await session.policy(args.name))  # as the API server has it: spec, status, conditions
    elif not args.watch:
        sys.stdout.write(view.render_get(await session.policy(args.name), await session.events(args.name), _now()))
    else:
        await _watch(session, args.name, args.interval, args.timeout)
    return EXIT_OK


# How `status` exits on each decided phase.
DECIDED = {Phase.PROMOTED: EXIT_OK, Phase.HELD_BF16: EXIT_OK, Phase.ROLLED_BACK: EXIT_FAILED}


def rollout_status(raw: Obj) -> Obj:
    """What `status` reports of a policy: its phase, decision and whether that decision is for the current spec."""
    meta, status = raw.get("metadata") or {}, raw.get("status") or {}
    decision = status.get("decision") or {}
    current = status.get("observedGeneration") == meta.get("generation")
    phase = status.get("phase") or ""
    decided = current and phase in DECIDED and bool(decision)
    return {
        "name": meta.get("name"),
        "namespace": meta.get("namespace"),
        "generation": meta.get("generation"),
        "observedGeneration": status.get("observedGeneration"),
        "phase": phase,
        "rolloutId": status.get("rolloutId"),
        "decided": decided,
        "result": decision.get("result") if decided else None,
        "reason": decision.get("reason") if decided else None,
        "message": (decision.get("message") if decided else status.get("message")) or "",
    }


async def _status(session: Session, args: argparse.Namespace) -> int:
    """Wait until the policy's rollout for its current spec is decided; exit by the decision (for CI)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + args.timeout if args.timeout > 0 else None
    changed = asyncio.Event()

    async def follow() -> None:
        while True:
            with contextlib.suppress(ApiFailure, aiohttp.ClientError, TimeoutError):
                async for _ in session.changes(args.name, timeout_seconds=300):
                    changed.set()
            await asyncio.sleep(args.interval)

    follower = asyncio.ensure_future(follow())
    said = ""
    try:
        while True:
            report = rollout_status(await session.policy(args.name))
            if report["decided"]:
                break
            line = f"kvpolicy '{args.name}' {report['phase'] or 'Pending'}: {report['message'] or 'waiting'}"
            if line != said:
                sys.stderr.write(line + "\n")
                said = line
            left = None if deadline is None else deadline - loop.time()
            if left is not None and left <= 0:
                break
            changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), args.interval if left is None else min(args.interval, left))
    finally:
        follower.cancel()
        await asyncio.gather(follower, return_exceptions=True)
    if args.output == "json":
        _print_json(report)
    elif report["decided"]:
        print(f"kvpolicy '{args.name}' {report['result']} ({report['reason']}): {report['message']}")
    else:
        print(f"kvpolicy '{args.name}' not decided within {args.timeout:g} s: {report['phase'] or 'Pending'}")
    return DECIDED[Phase(report["phase"])] if report["decided"] else EXIT_INCONCLUSIVE


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


async def _list(session: Session, args: argparse.Namespace) -> int:
    if args.all_namespaces:
        found = await _json(session.custom.list_cluster_custom_object, GROUP, VERSION, PLURAL)
    else:
        found = await _json(session.custom.list_namespaced_custom_object, GROUP, VERSION, session.namespace, PLURAL)
    if args.output == "json":
        _print_json(found)
    else:
        sys.stdout.write(view.render_list(found.get("items") or [], _now(), args.all_namespaces))
    return EXIT_OK


def _parsed(raw: Obj) -> KVPolicy:
    try:
        return KVPolicy.model_validate(raw)
    except ValueError as error:
        raise PluginError(f"kvpolicy {raw['metadata']['name']} has an invalid spec: {error}") from None


async def _approve(session: Session, args: argparse.Namespace) -> int:
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
    return EXIT_OK


async def _retry(session: Session, args: argparse.Namespace) -> int:
    policy = _parsed(await session.policy(args.name))
    status = policy.status
    if status.phase != Phase.ROLLED_BACK or status.rollout_id is None:
        phase = status.phase.value if status.phase else "Pending"
        raise PluginError(f"kvpolicy {args.name} is {phase}: only a RolledBack rollout can be retried")
    await session.patch_rollout(args.name, {"retryRollout": status.rollout_id, "abort": False})
    print(f"kvpolicy '{args.name}' rollout {status.rollout_id} retried")
    return EXIT_OK


def _control(field: str, value: bool, done: str, already: str) -> Command:
    async def run(session: Session, args: argparse.Namespace) -> int:
        found = await session.policy(args.name)  # NotFound says so before any patch
        if bool(((found.get("spec") or {}).get("rollout") or {}).get(field, False)) == value:
            print(f"kvpolicy '{args.name}' {already}: nothing to do")
            return EXIT_OK
        await session.patch_rollout(args.name, {field: value})
        print(f"kvpolicy '{args.name}' {done}")
        return EXIT_OK

    return run


async def _explain(session: Session, args: argparse.Namespace) -> int:
    """The planner's reasons for this policy on the GPUs the target's nodes have now."""
    policy = _parsed(await session.policy(args.name))
    apps = client.AppsV1Api(session.api)
    try:
        target = await _json(apps.read_namespaced_deployment, policy.spec.target_ref.name, session.namespace)
    except ApiFailure as error:
        if error.status != 404:
            raise
        raise PluginError(f"target Deployment {policy.spec.target_ref.name} not found in {session.namespace}") from None
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
    return EXIT_OK


COMMANDS: dict[str, Command] = {
    "get": _get,
    "status": _status,
    "list": _list,
    "approve": _approve,
    "retry": _retry,
    "abort": _control("abort", True, "aborted: rolling back to BF16", "is already aborted"),
    "pause": _control("paused", True, "paused", "is already paused"),
    "resume": _control("paused", False, "resumed", "is not paused"),
    "explain": _explain,
}


def _connection_flags(default: object) -> UsageParser:
    flags = UsageParser(add_help=False)
    flags.add_argument("-n", "--namespace", default=default, help="namespace (default: the kubeconfig context's)")
    flags.add_argument("--kubeconfig", default=default, help="kubeconfig file (default: KUBECONFIG, ~/.kube/config)")
    flags.add_argument("--context", default=default, help="kubeconfig context (default: the current one)")
    return flags


def _parser() -> argparse.ArgumentParser:
    # The flags go before or after the command; after it, only a flag given keeps the value given before it.
    common = _connection_flags(argparse.SUPPRESS)
    parser = UsageParser(prog=PROG, description=__doc__.split("\n\n")[0], parents=[_connection_flags(None)])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=UsageParser)
    output = UsageParser(add_help=False)
    output.add_argument("-o", "--output", choices=("text", "json"), default="text", help="text (default) or json")
    get = commands.add_parser(
        "get", parents=[common, output], help="show a policy's rollout: plan, gates, conditions, events"
    )
    get.add_argument("name")
    get.add_argument("-w", "--watch", action="store_true", help="keep the view up to date until interrupted")
    get.add_argument("--interval", type=float, default=2.0, help="seconds between redraws while watching")
    get.add_argument("--timeout", type=float, default=0.0, help="stop watching after this many seconds (0: never)")
    status = commands.add_parser(
        "status",
        parents=[common, output],
        help="wait until the rollout of the policy's current spec is decided; exit 0 Promoted or HeldBF16, "
        "1 RolledBack, 2 when --timeout ends first (for CI)",
    )
    status.add_argument("name")
    status.add_argument("--timeout", type=float, default=0.0, help="give up after this many seconds (0: never)")
    status.add_argument("--interval", type=float, default=2.0, help="seconds between looks without a watch event")
    listing = commands.add_parser("list", parents=[common, output], help="list policies")
    listing.add_argument("-A", "--all-namespaces", action="store_true")
    commands.add_parser("version", parents=[output], help="the plugin's version and the KVPolicy API it speaks")
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


def _fail(message: str, code: int = EXIT_FAILED) -> int:
    sys.stderr.write(f"error: {message}\n")
    return code


def _version(args: argparse.Namespace) -> int:
    """Needs no cluster: what this plugin is and which KVPolicy API version it reads and writes."""
    if args.output == "json":
        _print_json({"plugin": "kubectl-kvpolicy", "version": __version__, "apiVersion": f"{GROUP}/{VERSION}"})
    else:
        print(f"kubectl-kvpolicy {__version__} ({GROUP}/{VERSION})")
    return EXIT_OK


async def _run(args: argparse.Namespace) -> int:
    session = await _connect(args)
    try:
        return await COMMANDS[args.command](session, args)
    finally:
        await session.api.close()


def _api_message(error: ApiFailure, args: argparse.Namespace) -> str:
    if error.status == 404 and getattr(args, "name", None):
        return f"kvpolicy {args.name} not found in namespace {args.namespace or 'of the current context'}"
    return f"{error.status} {error.reason}: {error.message}" if error.reason else f"{error.status}: {error.message}"


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "version":
        return _version(args)
    try:
        return asyncio.run(_run(args))
    except KeyboardInterrupt:
        return EXIT_OK
    except PluginError as error:
        return _fail(str(error))
    except ApiFailure as error:
        return _fail(_api_message(error, args))
    except Unavailable as error:
        return _fail(str(error), EXIT_UNAVAILABLE)
    except (aiohttp.ClientError, TimeoutError) as error:
        return _fail(f"cannot reach the API server: {error or type(error).__name__}", EXIT_UNAVAILABLE)
