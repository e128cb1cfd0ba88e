"""nginx as a reference hop: its configuration, written into a directory of the bench's own.

The bench never installs nginx; it runs the binary on ``PATH`` or given with
``--nginx``. One ``server`` block per port it listens on, each proxying to one
target with HTTP/1.1 keep-alive, no buffering either way (stream events pass
as they come) and every temporary path inside the bench's directory.
"""

from __future__ import annotations

import subprocess
from collections.abc import Mapping
from pathlib import Path

from bench.harness.procs import HOST


def nginx_config(
    nginx: str,
    directory: Path,
    listeners: Mapping[int, str],
    connections: int = 1024,
    keepalive: int = 64,
    workers: int = 1,
) -> Path:
    """Write nginx's configuration into ``directory`` and return its path.

    ``listeners``: each port nginx listens on, and the ``HOST:PORT`` it proxies to. ``workers``
    worker processes (1 unless given), each allowed ``connections`` connections (clients and
    upstreams together; its open-files limit raised to match), the log and every temporary path
    inside ``directory``, no access log, HTTP/1.1 keep-alive connections to each target
    (``keepalive`` kept idle) that are never closed after a number of requests (nor are the
    client's), and no buffering either way, so
    stream events pass as they come. The temporary path directives of the modules this binary
    was built without are left out (they would not parse).
    """
    built = subprocess.run([nginx, "-V"], capture_output=True, text=True, timeout=10, check=False).stderr
    temp_paths = "".join(
        f"  {module}_temp_path {directory}/{module};\n"
        for module in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
        if f"--without-http_{module}_module" not in built
    )
    servers = "".join(
        f"""  upstream t{port} {{ server {target}; keepalive {keepalive}; keepalive_requests 1000000; }}
  server {{
    listen {HOST}:{port} backlog=4096;
    location / {{
      proxy_pass http://t{port};
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_request_buffering off;
    }}
  }}
"""
        for port, target in listeners.items()
    )
    conf = directory / "nginx.conf"
    conf.write_text(
        f"""worker_processes {workers};
worker_rlimit_nofile {2 * connections + 64};
daemon off;
pid {directory}/nginx.pid;
error_log stderr warn;
events {{ worker_connections {connections}; }}
http {{
  access_log off;
{temp_paths}  keepalive_requests 1000000;
{servers}}}
"""
    )
    return conf
