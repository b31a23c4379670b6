"""Metrics for monitoring stacks: the daemon's ``status`` as an OpenMetrics /
Prometheus text exposition, on a loopback HTTP endpoint and/or in a
node_exporter textfile (``[metrics]``, off by default).

``families``: status -> metric families (``client_families``: those of
``security`` and ``shm``); ``http``: the bounded ``GET /metrics``
server; ``exporter``: the ``inferd-metrics`` thread that owns both.
``prometheus_client`` (the ``ops`` extra) is imported only when they run.
"""

from inferd.metrics.exporter import THREAD_NAME, MetricsExporter, MetricsSource

__all__ = ["THREAD_NAME", "MetricsExporter", "MetricsSource"]
