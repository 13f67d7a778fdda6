"""triton_ep.metrics: the Prometheus exporter of Buffer.get_rdma_stats(). The exposition holds the stats' very
numbers with the right labels (2 emulated hosts); one host exports zeros; a destroyed Buffer scrapes without
error; the HTTP server serves /metrics; prometheus_client stays optional (lazy import, a clear ImportError)."""
import gc
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from tests.cases import metrics as metrics_cases
from triton_ep.testing import RankFailure, VirtualGroup, run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: the counters of one rank, by metric (sample) name -> get_rdma_stats() field
RANK_COUNTERS = {"triton_ep_rdma_work_requests_total": "wrs", "triton_ep_rdma_chunks_total": "chunks",
                 "triton_ep_rdma_proxy_busy_seconds_total": "proxy_busy_s",
                 "triton_ep_rdma_proxy_transport_seconds_total": "proxy_transport_s",
                 "triton_ep_rdma_proxy_cpu_seconds_total": "proxy_cpu_s",
                 "triton_ep_rdma_proxy_transport_cpu_seconds_total": "proxy_transport_cpu_s",
                 "triton_ep_rdma_network_seconds_total": "network_s", "triton_ep_rdma_exchanges_total": "exchanges"}


@pytest.fixture
def prom():
    return pytest.importorskip("prometheus_client")


def samples(text: str) -> dict:
    """The exposition ``text`` parsed: ``{(sample name, frozenset of label items): value}``."""
    from prometheus_client.parser import text_string_to_metric_families
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def expected(stats: dict, base: dict, live: bool = True) -> dict:
    """What :func:`samples` must give for ``get_rdma_stats()`` ``stats`` with constant labels ``base``: normal
    mode's leg under ``mode="normal"``, and ``stats["low_latency"]`` (where there is one) under
    ``mode="low_latency"``."""
    def key(name, **labels):
        return name, frozenset({**base, **labels}.items())
    if not live:
        return {key("triton_ep_buffer_live"): 0}
    out = {key("triton_ep_buffer_live"): 1,
           key("triton_ep_rdma_hosts", transport=stats["transport"] or "none"): stats["num_hosts"]}
    legs = [("normal", stats)] + ([("low_latency", stats["low_latency"])] if "low_latency" in stats else [])
    for mode, leg in legs:
        for name, field in RANK_COUNTERS.items():
            out[key(name, mode=mode)] = leg[field]
        for k, q in leg["qps"].items():
            peer, qp = k.split("/")
            labels = dict(mode=mode, peer=peer, qp=qp, channel=str(q["channel"]), port=str(q["port"]))
            for name, field in (("sent_bytes", "bytes"), ("work_requests", "wrs"), ("chunks", "chunks")):
                out[key(f"triton_ep_rdma_qp_{name}_total", **labels)] = q[field]
        for port, n in leg["ports"].items():
            out[key("triton_ep_rdma_port_sent_bytes_total", mode=mode, port=str(port))] = n
        for ch, c in leg["channels"].items():
            out[key("triton_ep_rdma_channel_sent_bytes_total", mode=mode, channel=str(ch))] = c["bytes"]
            out[key("triton_ep_rdma_channel_chunks_total", mode=mode, channel=str(ch))] = c["chunks"]
    return out


def moved(before: dict, after: dict, path: str = "") -> list:
    """The keys (``a/b/c`` paths) whose values differ between two ``get_rdma_stats()`` dicts, with both values."""
    out = []
    for k in sorted(set(before) | set(after), key=str):
        a, b = before.get(k), after.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += moved(a, b, f"{path}{k}/")
        elif a != b:
            out.append((f"{path}{k}", a, b))
    return out


def traffic(stats: dict) -> dict:
    """The traffic counters of ``get_rdma_stats()`` (bytes, work requests, chunks per QP, port and channel, of each
    leg): what the calls moved, without the proxies' time counters and liveness probes, which move on their own."""
    keys = ("qps", "ports", "channels", "wrs", "chunks")
    out = {k: stats.get(k) for k in keys}
    if "low_latency" in stats:
        out["low_latency"] = {k: stats["low_latency"].get(k) for k in keys}
    return out


@pytest.mark.multiprocess
def test_exposition_holds_the_rdma_stats_of_two_emulated_hosts(prom):
    """2 ranks, one per emulated host, a low-latency Buffer serving both modes (4 QPs per peer over a
    dual-port NIC and 4 KiB chunks in normal mode, 2 QPs per peer in low-latency mode): every series of the
    exposition is one number of get_rdma_stats() with its labels (rank, job, mode, peer, qp, channel, port),
    each leg under its own mode, and nothing else (a scrape between two equal reads: the proxies' liveness probes move
    their time counters now and then); no traffic is counted once every rank's calls returned; after destroy() the
    scrape gives triton_ep_buffer_live 0 and no counters."""
    env = {"TRITON_EP_RANKS_PER_HOST": "1", "TRITON_EP_RDMA": "emulated", "TRITON_EP_RDMA_CHUNK_BYTES": "4096"}
    out = run_ranks(metrics_cases.exported_traffic, 2, env, 64, 256, timeout_s=180)
    bad = [o for o in out if isinstance(o, RankFailure)]
    assert not bad, "\n".join(o.traceback or str(o) for o in bad)
    for rank, o in enumerate(out):
        st = o["stats"]
        assert st == o["stats_after"], f"no quiet scrape in {o['tries']} tries: {moved(st, o['stats_after'])}"
        assert traffic(o["first"]) == traffic(st), f"traffic after the calls: {moved(o['first'], st)}"
        assert st["transport"] == "emulated" and st["num_hosts"] == 2
        assert len(st["qps"]) == 4 and all(q["chunks"] > 0 for q in st["qps"].values()), st["qps"]
        assert {k.split("/")[0] for k in st["qps"]} == {str(1 - rank)}, st["qps"]
        assert len(st["ports"]) == 2 and min(st["ports"].values()) > 0, st["ports"]
        ll = st["low_latency"]
        assert ll["chunks"] >= 2 and ll["wrs"] > 0 and sum(ll["ports"].values()) > 0, ll
        assert {k.split("/")[0] for k in ll["qps"]} == {str(1 - rank)}, ll["qps"]
        base = {"rank": str(rank), "job": "test"}
        got = samples(o["text"])
        assert got == expected(st, base), o["text"]
        for mode, leg in (("normal", st), ("low_latency", ll)):
            port_sum = sum(v for (n, lab), v in got.items()
                           if n == "triton_ep_rdma_port_sent_bytes_total" and ("mode", mode) in lab)
            qp_sum = sum(v for (n, lab), v in got.items()
                         if n == "triton_ep_rdma_qp_sent_bytes_total" and ("mode", mode) in lab)
            assert port_sum == qp_sum == sum(leg["ports"].values()) > 0, mode
        assert samples(o["destroyed"]) == expected(st, base, live=False), o["destroyed"]


class StandIn:
    """A Buffer's face as the exporter sees it: ``rank`` and ``get_rdma_stats()``."""

    def __init__(self, rank, stats):
        self.rank, self.stats = rank, stats

    def get_rdma_stats(self):
        return self.stats


def test_labels_name_each_field_of_a_qp(prom):
    """Fields that differ everywhere (channel != qp, 3 hosts, a bonded port, 12 QPs per peer) land each under
    its own label, and exactly once."""
    from triton_ep.metrics import PrometheusExporter
    qps = {f"{p}/{q}": dict(channel=q // 3, port=f"mlx5_bond_0:1/lag{q % 2 + 1}", bytes=1000 * p + q, wrs=7 * q,
                            chunks=q + p) for p in (0, 2) for q in range(12)}
    ports, channels = {}, {}
    for q in qps.values():
        ports[q["port"]] = ports.get(q["port"], 0) + q["bytes"]
        c = channels.setdefault(q["channel"], {"bytes": 0, "chunks": 0})
        c["bytes"], c["chunks"] = c["bytes"] + q["bytes"], c["chunks"] + q["chunks"]
    st = {"transport": "verbs", "num_hosts": 3, "qps": qps, "ports": ports, "channels": channels, "wrs": 999,
          "chunks": sum(q["chunks"] for q in qps.values()), "proxy_busy_s": 0.25, "proxy_transport_s": 0.125,
          "proxy_cpu_s": 0.2, "proxy_transport_cpu_s": 0.0625, "network_s": 1.5, "exchanges": 4}
    buf = StandIn(5, st)
    registry = prom.CollectorRegistry()
    registry.register(PrometheusExporter(buf, labels={"job": "x"}))
    text = prom.generate_latest(registry).decode()
    assert samples(text) == expected(st, {"rank": "5", "job": "x"}), text
    assert ('triton_ep_rdma_qp_work_requests_total{channel="3",job="x",mode="normal",peer="2",'
            'port="mlx5_bond_0:1/lag2",qp="11",rank="5"} 77.0') in text
    # low-latency mode's own leg (peers are ranks there): its numbers under mode="low_latency", nothing mixed
    st["low_latency"] = {**st, "qps": {"7/0": dict(channel=0, port="mlx5_0:2", bytes=4096, wrs=3, chunks=1)},
                         "ports": {"mlx5_0:2": 4096}, "channels": {0: {"bytes": 4096, "chunks": 1}}, "wrs": 5,
                         "chunks": 1, "proxy_busy_s": 0.5, "network_s": 0.75, "exchanges": 2}
    text = prom.generate_latest(registry).decode()
    assert samples(text) == expected(st, {"rank": "5", "job": "x"}), text
    assert 'triton_ep_rdma_proxy_busy_seconds_total{job="x",mode="low_latency",rank="5"} 0.5' in text
    assert 'triton_ep_rdma_proxy_busy_seconds_total{job="x",mode="normal",rank="5"} 0.25' in text


def test_one_host_exports_zeros_and_a_destroyed_or_dropped_buffer_scrapes(prom):
    """A Buffer whose ranks share one host: live 1, hosts 1 (transport "none"), every total 0, no QP, port or
    channel series. Destroyed: live 0 alone. Dropped and collected (the exporter holds it weakly): the same."""
    from triton_ep.metrics import PrometheusExporter
    vg = VirtualGroup(2, 1 << 16)
    registry = prom.CollectorRegistry()
    registry.register(PrometheusExporter(vg.buffers[1]))
    st = vg.buffers[1].get_rdma_stats()
    assert st["transport"] is None and st["num_hosts"] == 1 and st["qps"] == {} and st["wrs"] == 0
    got = samples(prom.generate_latest(registry).decode())
    assert got == expected(st, {"rank": "1"})
    assert {v for (n, _), v in got.items() if n.endswith("_total")} == {0}
    for buf in vg.buffers:
        buf.destroy()
    assert samples(prom.generate_latest(registry).decode()) == expected(st, {"rank": "1"}, live=False)
    del vg, buf
    gc.collect()
    assert samples(prom.generate_latest(registry).decode()) == expected(st, {"rank": "1"}, live=False)


def test_bad_arguments(prom):
    from triton_ep.metrics import PrometheusExporter, start_prometheus_exporter
    vg = VirtualGroup(1, 1 << 16)
    try:
        for labels in ({"rank": "7"}, {"port": "x"}, {"a-b": "x"}, {"__x": "y"}):
            with pytest.raises(ValueError, match="label name"):
                PrometheusExporter(vg.buffers[0], labels)
        with pytest.raises(TypeError, match="Buffer"):
            PrometheusExporter(object())
        registry = prom.CollectorRegistry()
        start_prometheus_exporter(vg.buffers[0], registry=registry)
        with pytest.raises(ValueError, match="Duplicated"):
            start_prometheus_exporter(vg.buffers[0], registry=registry)
    finally:
        vg.buffers[0].destroy()


@pytest.mark.parametrize("port", [-1, 65536, True, 1.5, "9400"])
def test_a_bad_port_is_a_value_error_naming_it_before_anything_is_registered(prom, port):
    """(A new user's find: ``port=-1`` raised ``socket.gaierror: Servname not supported for ai_socktype``, naming no
    port.) ``port`` is an int in [0, 65535] (not a bool), checked first: a ValueError naming it and the value, and
    the registry is left empty."""
    from triton_ep.metrics import start_prometheus_exporter
    vg = VirtualGroup(1, 1 << 16)
    registry = prom.CollectorRegistry()
    try:
        with pytest.raises(ValueError, match=r"port must be an int in \[0, 65535\].*, got " + re.escape(repr(port))):
            start_prometheus_exporter(vg.buffers[0], port=port, registry=registry, addr="127.0.0.1")
        assert prom.generate_latest(registry) == b""
    finally:
        vg.buffers[0].destroy()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_http_server_serves_metrics_and_close_stops_it(prom):
    """start_prometheus_exporter(port=...) serves /metrics; close() stops the server, joins its thread and
    unregisters the exporter (prometheus_client >= 0.17, where start_http_server returns the server)."""
    from importlib.metadata import version
    from triton_ep.metrics import start_prometheus_exporter
    if tuple(int(p) for p in version("prometheus-client").split(".")[:2]) < (0, 17):
        pytest.skip("prometheus_client < 0.17 gives no server to stop")
    threads0 = set(threading.enumerate())
    vg = VirtualGroup(1, 1 << 16)
    registry = prom.CollectorRegistry()
    port, st = _free_port(), vg.buffers[0].get_rdma_stats()
    exporter = start_prometheus_exporter(vg.buffers[0], port=port, registry=registry, addr="127.0.0.1",
                                         labels={"job": "http"})
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            assert r.status == 200
            body = r.read().decode()
    finally:
        exporter.close()
        vg.buffers[0].destroy()
    assert 'triton_ep_buffer_live{job="http",rank="0"} 1.0' in body, body
    assert samples(body) == expected(st, {"rank": "0", "job": "http"})
    assert prom.generate_latest(registry) == b""
    exporter.close()                                   # idempotent
    deadline = time.monotonic() + 5                    # the request's handler thread, on its way out
    while [t for t in threading.enumerate() if t not in threads0] and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_without_prometheus_client_the_exporter_says_what_to_install(monkeypatch):
    from triton_ep.metrics import PrometheusExporter, start_prometheus_exporter
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    for make in (lambda: PrometheusExporter(object()), lambda: start_prometheus_exporter(object(), port=1)):
        with pytest.raises(ImportError, match="pip install prometheus-client"):
            make()


def test_importing_triton_ep_does_not_import_prometheus_client():
    code = ("import sys, triton_ep, triton_ep.metrics; "
            "assert 'prometheus_client' not in sys.modules, 'prometheus_client was imported'")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
