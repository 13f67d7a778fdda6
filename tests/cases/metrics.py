"""Rank bodies for the Prometheus exporter's multi-process test (module-level: spawned processes import them)."""
import os

import torch

import triton_ep


def exported_traffic(rank, world, env, T, H):
    """On a low-latency Buffer that serves both modes (DeepEP's one Buffer): one dispatch and combine of ``T``
    tokens of ``H`` bf16 each, every token to the other host's experts, then (after
    ``clean_low_latency_buffer``) one low-latency dispatch and combine of the same rows; then (after a barrier of
    the ranks) a scrape of
    ``triton_ep.metrics``'s exporter in a fresh registry (label ``job="test"``).

    Returns:
        ``{"first": get_rdma_stats() right after the barrier, "stats": get_rdma_stats(), "text": the exposition,
        "stats_after": get_rdma_stats() after the scrape, "tries": scrapes made until "stats" and "stats_after"
        were equal (at most 20), "destroyed": the exposition after Buffer.destroy()}``.
    """
    import prometheus_client
    from triton_ep.metrics import start_prometheus_exporter
    os.environ.update(env)
    registry = prometheus_client.CollectorRegistry()
    E = 2 * world
    hint = triton_ep.Buffer.get_low_latency_rdma_size_hint(T, H, world, E)
    buf = triton_ep.Buffer(None, 4 << 20, hint, low_latency_mode=True, num_qps_per_rank=2, timeout_s=60)
    try:
        exporter = start_prometheus_exporter(buf, registry=registry, labels={"job": "test"})
        other = (rank + world // 2) % world
        idx = torch.tensor([[other * 2, other * 2 + 1]]).repeat(T, 1)
        per_rank, per_host, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
        x = torch.randn(T, H).to(torch.bfloat16)
        rx, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_host,
                                              is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                                              topk_idx=idx)
        buf.combine(rx, handle)
        buf.clean_low_latency_buffer(T, H, E)
        recv, _, ll_handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)
        buf.low_latency_combine(recv, idx, torch.ones(T, 2), ll_handle)
        # a call returns once its own rows arrived, maybe before this rank's proxy posted the peer's: once the
        # peer's calls returned too, every byte is counted
        torch.distributed.barrier()
        out = {"first": buf.get_rdma_stats()}
        # the proxies' liveness probes (every scheduler.PROBE_S) move their time counters now and then: scrape
        # between two equal reads, within 20 tries
        for out["tries"] in range(1, 21):
            out["stats"] = buf.get_rdma_stats()
            out["text"] = prometheus_client.generate_latest(registry).decode()
            out["stats_after"] = buf.get_rdma_stats()
            if out["stats"] == out["stats_after"]:
                break
    finally:
        buf.destroy()
    out["destroyed"] = prometheus_client.generate_latest(registry).decode()
    exporter.close()
    return out
