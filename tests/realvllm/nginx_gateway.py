"""nginx (Debian's) as a gateway's data plane, configured from an HTTPRoute's weights by the test harness.

What a Gateway API implementation does with a route whose backendRefs are InferencePools, reduced to what the share
test needs: the first rule's refs become one nginx upstream, each pool's endpoints a `server` whose weight is the
ref's weight split over the pool's endpoints (a ref at weight 0 gets no server, as a gateway sends it nothing).
nginx balances an upstream by smooth weighted round-robin, so the split is the route's over any run of requests.
Each `configure` restarts nginx on the same port (a reload would finish old requests on old workers).
"""

from __future__ import annotations

import getpass
import os
import shutil
import socket
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from analysis.live_fleet import free_port, wait_until

NGINX = shutil.which("nginx") or (os.path.exists("/usr/sbin/nginx") and "/usr/sbin/nginx") or None


def upstream_servers(route: Mapping[str, Any], endpoints: Mapping[str, Sequence[str]]) -> list[tuple[str, int]]:
    """(host:port, weight) for the route's first rule: each InferencePool ref's weight over its pool's endpoints."""
    servers = []
    for ref in route["spec"]["rules"][0]["backendRefs"]:
        weight, pool = int(ref.get("weight", 1)), endpoints[ref["name"]]
        servers += [(endpoint, weight) for endpoint in pool if weight > 0]
    return servers


def nginx_config(workdir: Path, port: int, servers: Sequence[tuple[str, int]]) -> str:
    upstream = "\n".join(f"    server {address} weight={weight};" for address, weight in servers)
    temp = " ".join(
        f"{kind}_temp_path {workdir}/{kind};" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    return f"""
user {getpass.getuser()};
worker_processes 1;
daemon off;
pid {workdir}/nginx.pid;
error_log {workdir}/error.log warn;
events {{ worker_connections 64; }}
http {{
  access_log off;
  {temp}
  upstream route_rule_0 {{
{upstream}
  }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://route_rule_0;
      proxy_http_version 1.1;
      proxy_buffering off;
      proxy_read_timeout 120s;
    }}
  }}
}}
"""


class NginxGateway:
    def __init__(self, workdir: Path) -> None:
        assert NGINX is not None, "nginx is not installed: `make nginx` installs Debian's nginx-light"
        self.workdir, self.port = workdir, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None

    def configure(self, route: Mapping[str, Any], endpoints: Mapping[str, Sequence[str]]) -> list[tuple[str, int]]:
        """Serve the route's weights; returns the upstream's (server, weight)s."""
        servers = upstream_servers(route, {pool: [url.removeprefix("http://") for url in urls]
                                           for pool, urls in endpoints.items()})  # fmt: skip
        self.stop()
        config = self.workdir / "nginx.conf"
        config.write_text(nginx_config(self.workdir, self.port, servers))
        self.process = subprocess.Popen([NGINX, "-p", str(self.workdir), "-c", str(config)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)  # fmt: skip
        wait_until(self._listening, 10, f"nginx on {self.url} ({self._log()})")
        return servers

    def _listening(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            raise AssertionError(f"nginx exited with {self.process.returncode}: {self._log()}")
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
        except OSError:
            return False
        return True

    def _log(self) -> str:
        log = self.workdir / "error.log"
        return log.read_text(errors="replace")[-1000:] if log.exists() else ""

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)
        self.process = None
