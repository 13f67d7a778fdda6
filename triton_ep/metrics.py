"""Prometheus exporter of a :class:`~triton_ep.Buffer`'s traffic between hosts (``Buffer.get_rdma_stats()``).

Optional: it needs ``prometheus_client`` (``pip install prometheus-client``, or ``pip install
'triton-ep[metrics]'``), imported only when an exporter is made, never by ``import triton_ep``.

    from triton_ep.metrics import start_prometheus_exporter
    exporter = start_prometheus_exporter(buffer, port=9400)   # http://<host>:9400/metrics
    ...
    exporter.close()

The exporter is a custom collector in prometheus_client's sense: each scrape calls ``get_rdma_stats()`` once
and turns it into metric families; nothing runs between scrapes (no thread of ours). Metric names, labels
and units: docs/metrics.md.
"""
from __future__ import annotations

import re
import weakref
from typing import Iterable, Iterator, Mapping, Optional, Sequence, Tuple

from .errors import EPError

__all__ = ["PrometheusExporter", "start_prometheus_exporter"]

#: the labels the exporter sets itself; ``labels=`` may not use them
RESERVED_LABELS = frozenset({"rank", "mode", "peer", "qp", "channel", "port", "transport"})
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")

#: per-QP counters: (metric name without ``_total``, ``qps`` field, unit, help)
_QP_COUNTERS = (
    ("triton_ep_rdma_qp_sent_bytes", "bytes", "bytes", "Payload bytes this rank's RDMA proxy wrote on the QP."),
    ("triton_ep_rdma_qp_work_requests", "wrs", "", "RDMA work requests this rank's proxy posted on the QP."),
    ("triton_ep_rdma_qp_chunks", "chunks", "", "Ring chunks this rank's proxy posted on the QP."),
)
#: per-channel counters: (name, ``channels`` field, unit, help)
_CHANNEL_COUNTERS = (
    ("triton_ep_rdma_channel_sent_bytes", "bytes", "bytes", "Payload bytes this rank's proxy wrote on the "
                                                            "channel's QPs."),
    ("triton_ep_rdma_channel_chunks", "chunks", "", "Ring chunks this rank's proxy posted on the channel's QPs."),
)
#: this rank's totals: (name, top-level field, unit, help)
_RANK_COUNTERS = (
    ("triton_ep_rdma_work_requests", "wrs", "", "RDMA work requests this rank's proxy posted."),
    ("triton_ep_rdma_chunks", "chunks", "", "Ring chunks this rank's proxy posted."),
    ("triton_ep_rdma_proxy_busy_seconds", "proxy_busy_s", "seconds",
     "Seconds (wall clock) this rank's RDMA proxy threads spent in sweeps that moved something (its host cost)."),
    ("triton_ep_rdma_proxy_transport_seconds", "proxy_transport_s", "seconds",
     "Of the proxy's busy seconds, those inside transport calls (posts, polls, credits)."),
    ("triton_ep_rdma_proxy_cpu_seconds", "proxy_cpu_s", "seconds",
     "CPU seconds of this rank's RDMA proxy threads in sweeps that moved something (no GIL waits)."),
    ("triton_ep_rdma_proxy_transport_cpu_seconds", "proxy_transport_cpu_s", "seconds",
     "Of the proxy's CPU seconds, those inside transport calls (the rest is its own Python)."),
    ("triton_ep_rdma_network_seconds", "network_s", "seconds",
     "Seconds this rank's calls spent in the network leg, waits included."),
    ("triton_ep_rdma_exchanges", "exchanges", "", "Exchanges with the RDMA peers this rank's calls made."),
)


def _prometheus_core():
    """``prometheus_client.core`` (the metric family classes), imported on first use.

    Raises:
        ImportError: prometheus_client is not installed; the message says how to install it.
    """
    try:
        from prometheus_client import core
    except ImportError as ex:
        raise ImportError("triton_ep.metrics needs prometheus_client: pip install prometheus-client "
                          "(or pip install 'triton-ep[metrics]')") from ex
    return core


class PrometheusExporter:
    """A prometheus_client collector of one Buffer's ``get_rdma_stats()``: register it into a registry
    (``registry.register(exporter)``), or use :func:`start_prometheus_exporter`.

    Each scrape (``collect()``) reads a fresh ``get_rdma_stats()``; the counters are cumulative since the
    Buffer was built. Every counter has a ``mode`` label: ``normal`` (normal mode's network leg, always) and,
    for a low-latency Buffer across hosts, ``low_latency`` (that mode's own leg, ``get_rdma_stats()
    ["low_latency"]``). The exporter holds the Buffer weakly: it does not keep a dropped Buffer's memory alive.
    Once the Buffer was destroyed (or collected), a scrape gives ``triton_ep_buffer_live 0`` and no counter
    samples (never an error, never counters reset to zero). On one host every counter family is there with
    its ``mode="normal"`` series at 0 and no per-QP, per-port or per-channel series.

    Args:
        buffer: a :class:`triton_ep.Buffer` (anything with ``rank`` and ``get_rdma_stats()``).
        labels: constant labels added to every sample, e.g. ``{"job": "moe"}``: names match
            ``[a-zA-Z_][a-zA-Z0-9_]*``, do not start with ``__`` and are none of :data:`RESERVED_LABELS`;
            values are converted with ``str``.

    Attributes:
        rank: the Buffer's rank (the ``rank`` label).
        registry: the registry :func:`start_prometheus_exporter` registered it into (else ``None``).
        server: what ``prometheus_client.start_http_server`` returned when :func:`start_prometheus_exporter`
            started one: ``(server, thread)`` (prometheus_client >= 0.17), ``None`` with older versions or
            without a port.

    Raises:
        ImportError: prometheus_client is not installed (``pip install prometheus-client``).
        TypeError: ``buffer`` has no ``get_rdma_stats``.
        ValueError: a bad or reserved label name in ``labels``.
    """

    def __init__(self, buffer, labels: Optional[Mapping[str, object]] = None) -> None:
        self._core = _prometheus_core()
        if not callable(getattr(buffer, "get_rdma_stats", None)):
            raise TypeError(f"PrometheusExporter needs a triton_ep.Buffer, got {type(buffer).__name__}")
        extra = dict(labels or {})
        for name in extra:
            if not isinstance(name, str) or not _LABEL_NAME.match(name) or name.startswith("__"):
                raise ValueError(f"label name {name!r} is not a valid Prometheus label name")
            if name in RESERVED_LABELS:
                raise ValueError(f"label name {name!r} is set by the exporter itself ({sorted(RESERVED_LABELS)})")
        self._buffer = weakref.ref(buffer)
        self.rank = int(buffer.rank)
        self._names = ("rank",) + tuple(extra)
        self._values = (str(self.rank),) + tuple(str(v) for v in extra.values())
        self.registry = self.server = None

    def describe(self) -> Iterator:
        """The metric families without samples: lets a registry refuse a second exporter of the same names
        (prometheus_client raises ``ValueError``, "Duplicated timeseries")."""
        return self._families(None, describe=True)

    def collect(self) -> Iterator:
        """This scrape's metric families, from one fresh ``get_rdma_stats()`` (see docs/metrics.md)."""
        buffer = self._buffer()
        stats = None
        if buffer is not None:
            try:
                stats = buffer.get_rdma_stats()
            except EPError:          # destroyed
                pass
        return self._families(stats)

    def close(self) -> None:
        """Undo :func:`start_prometheus_exporter`: stop its HTTP server (prometheus_client >= 0.17; older
        versions' server runs until the process exits) and unregister from its registry. Idempotent."""
        server, registry = self.server, self.registry
        self.server = self.registry = None
        if server is not None:
            httpd, thread = server
            httpd.shutdown()
            httpd.server_close()
            thread.join()
        if registry is not None:
            registry.unregister(self)

    # ------------------------------------------------------------------ families
    def _families(self, stats: Optional[dict], describe: bool = False) -> Iterator:
        """Every family, with samples from ``stats`` (``None``: a destroyed Buffer; only ``triton_ep_buffer_live``
        has a sample, 0); ``describe``: no samples at all."""
        core, live = self._core, stats is not None
        yield self._family(core.GaugeMetricFamily, "triton_ep_buffer_live", "", "1 while the Buffer is live, "
                           "0 once it was destroyed (its counters are then no longer exported).", (),
                           [] if describe else [((), int(live))])
        yield self._family(core.GaugeMetricFamily, "triton_ep_rdma_hosts", "", "Hosts the Buffer's group spans; "
                           "transport: verbs, emulated, or none on one host.", ("transport",),
                           [((stats["transport"] or "none",), stats["num_hosts"])] if live else [])
        # the network legs: normal mode's, and low-latency mode's own where it has one (label ``mode``)
        legs = [("normal", stats)] if live else []
        if live and stats.get("low_latency") is not None:
            legs.append(("low_latency", stats["low_latency"]))
        qps = [((mode,) + key, q) for mode, leg in legs for key, q in _qp_rows(leg["qps"])]
        for name, field, unit, doc in _QP_COUNTERS:
            yield self._counter(name, unit, doc, ("mode", "peer", "qp", "channel", "port"),
                                [(key, q[field]) for key, q in qps])
        yield self._counter("triton_ep_rdma_port_sent_bytes", "bytes",
                            "Payload bytes this rank's RDMA proxy wrote through the port.", ("mode", "port"),
                            [((mode, str(p)), n) for mode, leg in legs for p, n in sorted(leg["ports"].items())])
        for name, field, unit, doc in _CHANNEL_COUNTERS:
            yield self._counter(name, unit, doc, ("mode", "channel"),
                                [((mode, str(c)), v[field]) for mode, leg in legs
                                 for c, v in sorted(leg["channels"].items())])
        for name, field, unit, doc in _RANK_COUNTERS:
            yield self._counter(name, unit, doc, ("mode",), [((mode,), leg[field]) for mode, leg in legs])

    def _counter(self, name: str, unit: str, doc: str, label_names: Sequence[str],
                 rows: Iterable[Tuple[Tuple[str, ...], float]]):
        return self._family(self._core.CounterMetricFamily, name, unit, doc, label_names, rows)

    def _family(self, cls, name: str, unit: str, doc: str, label_names: Sequence[str],
                rows: Iterable[Tuple[Tuple[str, ...], float]]):
        """A ``cls`` family named ``name`` (``unit`` appended where missing) whose labels are this exporter's
        (``rank``, then ``labels=``) followed by ``label_names``; one sample per ``(label values, value)``."""
        fam = cls(name, doc, labels=self._names + tuple(label_names), unit=unit)
        for values, value in rows:
            fam.add_metric(self._values + tuple(values), value)
        return fam


def _qp_rows(qps: Mapping[str, dict]):
    """``(("peer", "qp", "channel", "port"), counters)`` per QP of ``get_rdma_stats()["qps"]`` (keys
    ``"<peer>/<qp index>"``: the peer host in normal mode, the peer rank in low-latency mode), ordered by peer
    then QP."""
    rows = [(key.split("/", 1), q) for key, q in qps.items()]
    return [((peer, qp, str(q["channel"]), str(q["port"])), q)
            for (peer, qp), q in sorted(rows, key=lambda r: (int(r[0][0]), int(r[0][1])))]


def start_prometheus_exporter(buffer, port: Optional[int] = None, registry=None,
                              labels: Optional[Mapping[str, object]] = None, addr: str = "0.0.0.0"
                              ) -> PrometheusExporter:
    """Export ``buffer.get_rdma_stats()`` to Prometheus: register a :class:`PrometheusExporter` into
    ``registry`` and, with ``port``, serve that registry over HTTP (``prometheus_client.start_http_server``:
    ``http://<addr>:<port>/metrics``, in prometheus_client's own daemon thread).

    Args:
        buffer: a :class:`triton_ep.Buffer`.
        port: TCP port to serve ``/metrics`` on; ``None``: no server (the caller serves or pushes ``registry``
            itself, e.g. ``prometheus_client.generate_latest(registry)``).
        registry: a ``prometheus_client.CollectorRegistry``; ``None``: prometheus_client's default ``REGISTRY``.
        labels: constant labels added to every sample (see :class:`PrometheusExporter`).
        addr: the address the server binds (with ``port``).

    Returns:
        the exporter; ``exporter.close()`` stops the server and unregisters it.

    Raises:
        ImportError: prometheus_client is not installed (``pip install prometheus-client``, or the
            ``metrics`` extra: ``pip install 'triton-ep[metrics]'``).
        TypeError: ``buffer`` is not a Buffer.
        ValueError: ``port`` is not an int in ``[0, 65535]`` (a bool is none; checked first, nothing is
            registered), a bad label name, or ``registry`` already holds an exporter of these metric names
            (prometheus_client's "Duplicated timeseries").
        OSError: the server could not bind ``addr:port`` (the exporter is then unregistered again).
    """
    if port is not None:
        from .runtime.checks import int_arg
        port = int_arg("port", port, 0, 65535, "a TCP port (0: one the system picks)")
    exporter = PrometheusExporter(buffer, labels)
    import prometheus_client
    registry = prometheus_client.REGISTRY if registry is None else registry
    registry.register(exporter)
    exporter.registry = registry
    if port is not None:
        try:
            exporter.server = prometheus_client.start_http_server(port, addr=addr, registry=registry)
        except BaseException:
            exporter.close()
            raise
    return exporter
