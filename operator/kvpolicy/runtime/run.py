"""`kvpolicy run`: start the operator (supervisor.py runs the process).

One replica (Deployment strategy Recreate), or several with leader election on a Lease (KVPOLICY_LEADER_ELECTION_LEASE,
KVPOLICY_LEADER_ELECTION_NAMESPACE, KVPOLICY_POD_NAME; the chart's `leaderElection.enabled`): kopf's peering only
pauses operators that see a peer of higher priority, it is not leader election.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import sys

import kopf

from kvpolicy.kube.leader import LeaderElection
from kvpolicy.kube.login import ClusterLogin, CredentialsError
from kvpolicy.runtime import handlers
from kvpolicy.runtime.supervisor import RunSettings, Supervisor


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


def _not_in_the_main_thread(record: logging.LogRecord) -> bool:
    """kopf runs in a thread of its own; the supervisor handles the signals kopf says it ignores there."""
    return "OS signals are ignored" not in record.getMessage()


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        options = handlers.OperatorOptions.from_env(
            metrics_port=args.metrics_port or None, metrics_address=args.metrics_address
        )
        election = LeaderElection.from_env()
    except ValueError as error:
        _parser().error(str(error))
    try:
        # Found and loaded before kopf starts, so missing or broken credentials are one line, not a retry loop.
        login = ClusterLogin.discover()
        configuration = asyncio.run(login.configuration())
    except CredentialsError as error:
        print(f"kvpolicy run: {error}", file=sys.stderr)
        return 1
    kopf.configure(verbose=args.verbose, log_prefix=True)
    logging.getLogger("kopf._core.reactor.running").addFilter(_not_in_the_main_thread)
    if not args.verbose:
        # kopf logs every watch-event handler call at INFO: one line per status write of every policy.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    settings = RunSettings(
        clusterwide=args.all_namespaces,
        namespaces=tuple(args.namespace or ()),
        options=options,
        liveness_address=args.liveness_address,
        liveness_port=args.liveness_port or None,
        election=election,
        login=login,
    )
    asyncio.run(Supervisor(settings, configuration).serve())
    return 0
