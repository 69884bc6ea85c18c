"""A free local port, for the processes that pick their own (a cluster's children, a worker group's rendezvous)."""
from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS considers free right now (another process may still take it before we do)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
