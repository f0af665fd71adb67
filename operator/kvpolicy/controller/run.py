"""`kvpolicy run`: start the operator.

Run exactly one replica (Deployment strategy Recreate): kopf's peering only pauses operators that see a peer of higher
priority, it is not leader election, so two replicas could both act on a policy during a rollout of the operator.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import sys

import kopf

from kvpolicy.controller import handlers
from kvpolicy.controller.login import ClusterLogin, CredentialsError


def _ip_address(text: str) -> str:
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an IP address (0.0.0.0 = every IPv4 address, :: = every address)"
        ) from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpolicy run", description="Run the KVPolicy operator (kopf).")
    scope = parser.add_mutually_exclusive_group(required=True)
    scope.add_argument("-n", "--namespace", action="append", help="watch this namespace (repeatable)")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace")
    parser.add_argument("--liveness-port", type=int, default=8080, help="serve /healthz on this port (0: off)")
    parser.add_argument("--metrics-port", type=int, default=9090, help="serve /metrics on this port (0: off)")
    # The kubelet probes /healthz on the pod IP, so the liveness address must include it; /metrics may be loopback
    # only when a sidecar proxies the scrape.
    parser.add_argument(
        "--liveness-address", type=_ip_address, default="0.0.0.0", help="IP address /healthz listens on (all: 0.0.0.0)"
    )
    parser.add_argument(
        "--metrics-address", type=_ip_address, default="0.0.0.0", help="IP address /metrics listens on (all: 0.0.0.0)"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
    return parser


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        options = handlers.OperatorOptions.from_env(
            metrics_port=args.metrics_port or None, metrics_address=args.metrics_address
        )
    except ValueError as error:
        _parser().error(str(error))
    try:
        # Found and loaded before kopf starts, so missing or broken credentials are one line, not a retry loop.
        login = ClusterLogin.discover()
        asyncio.run(login.configuration())
    except CredentialsError as error:
        print(f"kvpolicy run: {error}", file=sys.stderr)
        return 1
    kopf.configure(verbose=args.verbose, log_prefix=True)
    if not args.verbose:
        # kopf logs every watch-event handler call at INFO: one line per status write of every policy.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    host = f"[{args.liveness_address}]" if ":" in args.liveness_address else args.liveness_address
    liveness = f"http://{host}:{args.liveness_port}/healthz" if args.liveness_port else None
    asyncio.run(
        kopf.operator(
            registry=handlers.registry,
            standalone=True,
            clusterwide=args.all_namespaces,
            namespaces=args.namespace or (),
            liveness_endpoint=liveness,
            memo=kopf.Memo(options=options, login=login),
        )
    )
    return 0
