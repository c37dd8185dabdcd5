"""nginx in front of several replicas: the shipped locations (`ampwatch-locations.conf`), the compose profile's
`nginx.conf`, and the one place that writes a loopback nginx configuration over replicas on this machine (what
tests/test_replicas.py and bench/scale.py start), so the two cannot drift apart."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

LOCATIONS = Path(__file__).resolve().with_name("ampwatch-locations.conf")
_TEMP = ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")


def write_loopback_nginx(folder: Path, port: int, replica_ports: Sequence[int]) -> Path:
    """Write `folder`/nginx.conf and return its path: nginx on 127.0.0.1:`port` balancing over the replicas on
    127.0.0.1:`replica_ports` with the shipped locations, a replica that fails taken out for 5 s as the compose
    profile does. nginx's pid, logs and temporary files stay in `folder`, so it runs without installing anything:
    `nginx -p FOLDER -c FOLDER/nginx.conf -g "daemon off;"`."""
    upstreams = "\n".join(f"server 127.0.0.1:{p} max_fails=1 fail_timeout=5s;" for p in replica_ports)
    temp = " ".join(f"{kind}_temp_path {folder}/{kind};" for kind in _TEMP)
    config = folder / "nginx.conf"
    config.write_text(f"""
        {"user root;" if os.geteuid() == 0 else ""}
        worker_processes 1; pid {folder}/nginx.pid; error_log {folder}/error.log warn;
        events {{ worker_connections 1024; }}
        http {{
            access_log off; {temp}
            upstream ampwatch {{ {upstreams} keepalive 16; }}
            server {{ listen 127.0.0.1:{port}; include {LOCATIONS}; }}
        }}
    """)
    return config
