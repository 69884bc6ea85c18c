"""The supervisor's own Prometheus /metrics: which children are up, how often each restarted, and which
is crash-looping (tokenmill.cluster.restart_monitor), read from Supervisor.child_states() at scrape time.

    server = serve_supervisor_metrics(supervisor, "127.0.0.1", 9403)   # `tokenmill serve --supervisor-metrics-port`
    server.shutdown()

Each child's own /metrics disappears while it is down, so a gateway that one hostile request keeps
crashing would show on no dashboard but as a gap; the process that restarts it is the one that can say
so. Served on a thread (prometheus_client's WSGI server), nothing on the restart monitor's path.
"""
from __future__ import annotations

from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from tokenmill.cluster.supervisor import Supervisor


class ChildStatesCollector(Collector):
    def __init__(self, supervisor: Supervisor) -> None:
        self._supervisor = supervisor

    def collect(self):
        up = GaugeMetricFamily("tokenmill:child_up", "1 while the child process runs, 0 while it is down",
                               labels=["child"])
        looping = GaugeMetricFamily("tokenmill:child_crash_looping",
                                    "1 while the child has crashed more than its restart policy's max_restarts in "
                                    "its window: restarted every backoff_max_s while the others keep serving",
                                    labels=["child"])
        restarts = CounterMetricFamily("tokenmill:child_restarts", "Restarts of the child after a crash",
                                       labels=["child"])
        for name, state in self._supervisor.child_states().items():
            up.add_metric([name], 1.0 if state.alive else 0.0)
            looping.add_metric([name], 1.0 if state.crash_looping else 0.0)
            restarts.add_metric([name], float(state.restarts))
        yield from (up, looping, restarts)


def serve_supervisor_metrics(supervisor: Supervisor, host: str, port: int) -> WSGIServer:
    """Starts the endpoint (port 0: a free one, server.server_port); shut it down with server.shutdown()."""
    registry = CollectorRegistry()
    registry.register(ChildStatesCollector(supervisor))
    server, _ = start_http_server(port, addr=host, registry=registry)
    return server
