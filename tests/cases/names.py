"""Rank bodies of the kernel-name tests (module-level, so rank processes can import them): every call of every mode
made with a log of the kernels it launches, by the names profilers show (``triton_ep.kernels.names``)."""
import contextlib
import os

import torch

import triton_ep


@contextlib.contextmanager
def launched_names(log: list):
    """Append to ``log`` the profile name of every kernel launched inside the block (under Triton's interpreter,
    where every launch goes through ``InterpretedFunction.run``; a kernel without a profile name logs its Python
    name, so an unnamed kernel shows up)."""
    from triton.runtime.interpreter import InterpretedFunction
    real = InterpretedFunction.run

    def run(self, *args, **kwargs):
        log.append(getattr(self, "profile_name", self.fn.__name__))
        return real(self, *args, **kwargs)
    InterpretedFunction.run = run
    try:
        yield log
    finally:
        InterpretedFunction.run = real


def _step(steps: dict, log: list, tag: str, fn):
    del log[:]
    out = fn()
    steps[tag] = list(log)
    return out


def by_form(fn, rank, world, *args) -> dict:
    """``fn(rank, world, *args)`` once per launch form: ``TRITON_EP_FUSED=1`` (one launch a phase) and ``0`` (split
    launches); returns ``{"one launch": fn's result, "split": ...}``."""
    out = {}
    for form, value in (("one launch", "1"), ("split", "0")):
        os.environ["TRITON_EP_FUSED"] = value
        out[form] = fn(rank, world, *args)
    return out


def _normal_mode_calls(rank, world, T=6, H=64, E=8, K=2):
    """Layout, dispatch, cached dispatch and combine (normal mode; across emulated hosts where the environment
    says so), each with the names it launched. Returns ``{call: [names in launch order]}``; the round trip is
    checked against its meaning (identity experts: x times the ranks a token reaches)."""
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    idx = torch.rand(T, E, generator=g).topk(K).indices
    w = torch.rand(T, K, generator=g)
    steps, log = {}, []
    buf = triton_ep.Buffer(None, 1 << 20, 0, timeout_s=60)
    try:
        with launched_names(log):
            lay = _step(steps, log, "get_dispatch_layout", lambda: buf.get_dispatch_layout(idx, E))
            out = _step(steps, log, "dispatch", lambda: buf.dispatch(
                x, num_tokens_per_rank=lay[0], num_tokens_per_rdma_rank=lay[1], is_token_in_rank=lay[3],
                num_tokens_per_expert=lay[2], topk_idx=idx, topk_weights=w))
            recv_x, handle = out[0], out[4]
            for i in range(2):     # the second cached call replays the first's plan
                _step(steps, log, f"cached dispatch {i}", lambda: buf.dispatch(x, handle=handle))
            for i in range(2):
                comb = _step(steps, log, f"combine {i}", lambda: buf.combine(recv_x, handle))
        reach = torch.zeros(T, dtype=torch.float32)
        El = E // world
        for t in range(T):
            reach[t] = len({int(e) // El for e in idx[t]})
        want = (x.float() * reach[:, None]).to(torch.bfloat16)
        assert torch.equal(comb[0], want), "round trip"
        return steps
    finally:
        buf.destroy()


def _low_latency_calls(rank, world, T=5, N=8, H=128, E=4, K=2):
    """Low-latency dispatch and combine without and with a receive hook, each with the names it launched (the
    hook's launches under ``"... hook"``). Returns ``{call: [names]}``."""
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    idx = torch.rand(T, E, generator=g).topk(K).indices
    w = torch.rand(T, K, generator=g)
    hint = triton_ep.Buffer.get_low_latency_rdma_size_hint(N, H, world, E)
    buf = triton_ep.Buffer(None, 0, hint, low_latency_mode=True, num_qps_per_rank=E // world, timeout_s=60)
    steps, log = {}, []
    try:
        with launched_names(log):
            buf.low_latency_dispatch(x, idx, N, E, use_fp8=False)       # the first call of these sizes: its fence
            for i in range(2):
                o, c, h, _, _ = _step(steps, log, f"dispatch {i}",
                                      lambda: buf.low_latency_dispatch(x, idx, N, E, use_fp8=False))
            _, _, h2, _, hook = _step(steps, log, "dispatch with hook", lambda: buf.low_latency_dispatch(
                x, idx, N, E, use_fp8=False, return_recv_hook=True))
            _step(steps, log, "dispatch with hook: hook", hook)
            for i in range(2):
                _step(steps, log, f"combine {i}", lambda: buf.low_latency_combine(o, idx, w, h))
            _, _, hook = _step(steps, log, "combine with hook", lambda: buf.low_latency_combine(
                o, idx, w, h, return_recv_hook=True))
            _step(steps, log, "combine with hook: hook", hook)
        return steps
    finally:
        buf.destroy()


def normal_mode_calls(rank, world):
    """:func:`_normal_mode_calls` in both launch forms (:func:`by_form`)."""
    return by_form(_normal_mode_calls, rank, world)


def low_latency_calls(rank, world):
    """:func:`_low_latency_calls` in both launch forms (:func:`by_form`)."""
    return by_form(_low_latency_calls, rank, world)


def profiler_lookup(fn, words, hook_phases: bool = False, calls: int = 4) -> dict:
    """DeepEP's lookup of a call's kernels (its ``tests/utils.py``, ``bench_kineto``, restated): run ``fn`` ``calls``
    times under ``torch.profiler`` (CUDA activity), then find, per word of ``words``, the lines of the profiler's
    table (sorted by CUDA time, names cut at 100 characters) that contain it; with ``hook_phases`` also the trace's
    events whose name contains ``"::" + word``. Returns ``{word: (lines, events)}``: DeepEP needs one line per word
    and, with a hook, an even, non-zero number of events (send phase, receive phase)."""
    import json
    import tempfile

    import torch.profiler as tp
    fn()
    torch.cuda.synchronize()
    with tp.profile(activities=[tp.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", max_name_column_width=100).split("\n")
    events = []
    if hook_phases:
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            prof.export_chrome_trace(f.name)
            events = [e.get("name", "") for e in json.load(open(f.name))["traceEvents"]]
    return {w: ([line.strip() for line in table if w in line], sum(f"::{w}" in e for e in events)) for w in words}


def gpu_profiled_calls(rank, world, T=64, N=64, H=512, E=8, K=2):
    """On a GPU (ranks sharing it, gloo): :func:`profiler_lookup` of every mode's calls this group can make.
    Normal mode: dispatch (dispatch, notify), cached dispatch (dispatch; across hosts also notify), combine
    (combine; across hosts also notify); low-latency mode within one host: dispatch + combine, without and with
    receive hooks. Returns ``{call: lookup}``."""
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(T, H, generator=g).to(dev, torch.bfloat16)
    idx = torch.rand(T, E, generator=g).topk(K).indices.to(dev)
    w = torch.rand(T, K, generator=g).to(dev)
    across = os.environ.get("TRITON_EP_RANKS_PER_HOST") == "1"
    hint = triton_ep.Buffer.get_low_latency_rdma_size_hint(N, H, world, E)
    buf = triton_ep.Buffer(None, 1 << 26, hint, low_latency_mode=not across, num_qps_per_rank=E // world,
                           timeout_s=60)
    out = {}
    try:
        lay = buf.get_dispatch_layout(idx, E)

        def dispatch():
            return buf.dispatch(x, num_tokens_per_rank=lay[0], num_tokens_per_rdma_rank=lay[1],
                                is_token_in_rank=lay[3], num_tokens_per_expert=lay[2], topk_idx=idx, topk_weights=w)
        recv_x, _, _, _, handle, _ = dispatch()
        extra = ("notify",) if across else ()
        out["dispatch"] = profiler_lookup(dispatch, ("dispatch", "notify", "combine"))
        out["cached dispatch"] = profiler_lookup(lambda: buf.dispatch(x, handle=handle), ("dispatch", "combine") + extra)
        out["combine"] = profiler_lookup(lambda: buf.combine(recv_x, handle), ("combine", "dispatch") + extra)
        if not across:
            def ll(hook: bool):
                o, _, h, _, hk = buf.low_latency_dispatch(x, idx, N, E, use_fp8=True, return_recv_hook=hook)
                if hook:
                    hk()
                y = torch.zeros(o[0].shape, dtype=torch.bfloat16, device=dev)
                _, _, hk = buf.low_latency_combine(y, idx, w, h, return_recv_hook=hook)
                if hook:
                    hk()
            out["low-latency"] = profiler_lookup(lambda: ll(False), ("dispatch", "combine"))
            out["low-latency with hooks"] = profiler_lookup(lambda: ll(True), ("dispatch", "combine"), hook_phases=True)
        return out
    finally:
        buf.destroy()
