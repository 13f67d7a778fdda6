"""Rank bodies for the internode mode's multi-process tests (module-level: spawned processes import them)."""
import os

import torch

import triton_ep


def _error(ex: BaseException) -> list:
    return [type(ex).__name__, str(ex)]


def layout_and_checks(rank, world, env, E, K, T, seed):
    """Build a Buffer with ``env`` set in this rank; return what get_dispatch_layout gives, the reference
    per-host counts, and the errors dispatch / combine raise for a few argument shapes."""
    os.environ.update(env)
    buf = triton_ep.Buffer(None, 1 << 20, timeout_s=30)
    try:
        g = torch.Generator().manual_seed(seed + rank)
        idx = torch.randint(-1, E, (T, K), generator=g)
        per_rank, per_host, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
        x = torch.randn(T, 64).to(torch.bfloat16)
        out = {"idx": idx, "per_host": per_host, "in_rank": in_rank, "per_rank": per_rank}
        calls = {
            "missing": dict(num_tokens_per_rdma_rank=None),
            "int64": dict(num_tokens_per_rdma_rank=per_host.long() if per_host is not None else None),
            "shape": dict(num_tokens_per_rdma_rank=torch.zeros(7, dtype=torch.int32)),
            "ok": dict(num_tokens_per_rdma_rank=per_host),
        }
        for name, kw in calls.items():
            try:
                buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                             num_tokens_per_expert=per_expert, topk_idx=idx, **kw)
                out[name] = None
            except Exception as ex:   # noqa: BLE001 - the test compares the errors
                out[name] = _error(ex)
        try:
            buf.combine(x, handle=None)
            out["combine"] = None
        except Exception as ex:   # noqa: BLE001
            out["combine"] = _error(ex)
        return out
    finally:
        buf.destroy()


def build_only(rank, world, env, kwargs):
    """Build a Buffer with ``env`` (a dict, or one per rank) set in this rank and ``kwargs``; the error it
    raises, or None."""
    os.environ.update(env[rank] if isinstance(env, list) else env)
    try:
        buf = triton_ep.Buffer(None, 1 << 20, timeout_s=20, **kwargs)
    except Exception as ex:   # noqa: BLE001
        return _error(ex)
    buf.destroy()
    return None
