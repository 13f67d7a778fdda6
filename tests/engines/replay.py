"""Replay an engine's DeepEP call sequence (``engines.vllm_calls`` / ``engines.sglang_calls``) against triton-ep,
as the engine makes it: through ``import deep_ep`` with the ``TRITON_EP_AS_DEEP_EP`` switch on, every call with the
engine's arguments, what the engine reads back checked against the plain-PyTorch reference
(``triton_ep.reference`` for normal mode, ``ll_cases``' oracle for low-latency mode). A replay, not the engine: the
experts between dispatch and combine are stand-ins (normal mode: rows times 2; low-latency: identity after the
FP8 round trip), and sizes are small (the fixtures' ``deviations``).

:func:`replay_rank` is a rank body for ``triton_ep.testing.run_ranks`` (or any launcher with a default process
group): ranks on one host, or on emulated hosts with ``TRITON_EP_RANKS_PER_HOST`` and ``TRITON_EP_RDMA=emulated``
in ``env``.
"""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List

import torch


@dataclass(frozen=True)
class Shape:
    """The replay's sizes: experts ``E``, top-k ``K``, hidden ``H``, low-latency ``N``
    (``num_max_dispatch_tokens_per_rank``), input ``seed``."""
    E: int = 8
    K: int = 3
    H: int = 256
    N: int = 8
    seed: int = 0


@dataclass
class Trace:
    """What a rank's replay did: per call ``"step/op@cite"`` in order, and the checks that passed."""
    calls: List[str] = field(default_factory=list)
    checks: List[str] = field(default_factory=list)
    deep_ep_file: str = ""


def find_sequence(module: str, backend: str):
    """The :class:`~engines.calls.Sequence` named ``backend`` in ``engines.<module>``."""
    mod = importlib.import_module(f"tests.engines.{module}")
    for s in mod.SEQUENCES:
        if s.backend == backend:
            return s
    raise ValueError(f"no sequence {backend!r} in engines.{module}: {[s.backend for s in mod.SEQUENCES]}")


#: the values of a step's inputs (engines.replay._Rank.inputs)
_INPUTS = ("all_x", "all_idx", "all_w", "x", "topk_idx", "topk_weights", "output", "mask")


class _Rank:
    """One rank's interpreter of a sequence: values by name per sub-batch, the step's inputs of every rank (the
    reference needs them all), the Buffer."""

    def __init__(self, deep_ep, rank: int, world: int, shape: Shape, per_host: int) -> None:
        import torch.distributed as dist
        self.deep_ep, self.rank, self.world, self.shape, self.per_host = deep_ep, rank, world, shape, per_host
        self.buf = None
        self.trace = Trace(deep_ep_file=deep_ep.__file__)
        E = shape.E
        self.base: Dict[str, Any] = dict(E=E, H=shape.H, N=shape.N, R=world, K=shape.K, E_local=E // world,
                                         group=dist.group.WORLD, num_sms=deep_ep.Buffer.num_sms,
                                         max_num_sms_E_local=max(deep_ep.Buffer.num_sms, E // world),
                                         ht_rdma_bytes=0 if per_host >= world else 2 << 20,
                                         ht_qps=1 if per_host >= world else 10)
        self.vals: Dict[int, Dict[str, Any]] = {0: {}, 1: {}}

    # -- values
    def resolve(self, v, sub):
        from tests.engines.calls import Ref
        if isinstance(v, Ref):
            for scope in (self.vals[sub], self.base):
                if v.name in scope:
                    return scope[v.name]
            raise KeyError(f"the replay has no value {v.name!r} (sub-batch {sub})")
        return v

    def inputs(self, step, step_no, distinct_experts=False):
        """Every rank's inputs of this step, per sub-batch (seeded by step and sub-batch, identical on all ranks);
        ``distinct_experts``: no expert twice in a token (a router's top-k, which DeepEP V2 requires)."""
        from tests.cases.ll import ll_inputs
        s = self.shape
        for sub in (0, 1):
            Ts = [step.tokens[r % len(step.tokens)] for r in range(self.world)]
            xs, idxs, ws = ll_inputs(s.seed * 1000 + step_no * 10 + sub, self.world, s.E, s.K, s.H,
                                     [min(t, s.N) for t in Ts], p_dup=0.0 if distinct_experts else 0.1)
            v = self.vals[sub]
            v.clear()
            v.update(all_x=xs, all_idx=idxs, all_w=ws, x=xs[self.rank], topk_idx=idxs[self.rank],
                     topk_weights=ws[self.rank],
                     output=torch.full((xs[self.rank].shape[0], s.H), float("nan"), dtype=torch.bfloat16, device="cpu"),
                     mask=torch.full((self.world,), -7, dtype=torch.int32, device="cpu"))

    # -- ops
    def run(self, call, where):
        sub = call.sub
        args = {k: self.resolve(v, sub) for k, v in call.args.items()}
        self.trace.calls.append(f"{where}/{call.op}@{call.cite}" if call.cite else f"{where}/{call.op}")
        B = self.deep_ep.Buffer
        op = call.op
        from tests.engines import replay_v2
        if op == "Buffer":
            self.buf = B(**args)
            assert self.buf.group_size == self.world and self.buf.low_latency_mode == args["low_latency_mode"]
            res = ()
        elif op == "ElasticBuffer":
            self.buf = self.deep_ep.ElasticBuffer(**args)
            assert self.buf.num_ranks == self.world and self.buf.rank_idx == self.rank
            res = ()
        elif op == "drop":
            res = self._drop()
        elif op == "read":
            res = replay_v2.run_read(self, self.vals[sub], **args)
        elif op in ("get_low_latency_rdma_size_hint", "get_dispatch_config", "get_combine_config", "set_num_sms"):
            res = getattr(B, op)(**args)
        elif op == "capture":
            res = B.capture()
        elif op == "size_hints":
            res = self._size_hints(**args)
        elif op == "wait":
            if args["event"].event is not None:
                args["event"].current_stream_wait()
            res = ()
        elif op == "hook":
            args["hook"]()
            res = ()
        elif op == "rdma_zero":
            t = self.buf.get_local_buffer_tensor(dtype=torch.int8, use_rdma_buffer=True)
            t.zero_()
            res = ()
        elif op == "expert" and args.get("kind") == "v2":
            res = replay_v2.run_expert(self.vals[sub], **{k: a for k, a in args.items() if k != "kind"})
        elif op == "expert":
            res = self._expert(sub, **args)
        elif op == "check":
            res = self._check(sub, **args)
        else:
            res = getattr(self.buf, op)(**args)
        if op == "low_latency_query_mask_buffer":
            assert args["mask_status"].tolist() == [0] * self.world, args["mask_status"]
        outs = call.out
        if outs:
            res = res if isinstance(res, tuple) and len(outs) > 1 else (res,)
            assert len(res) == len(outs), (op, len(res), outs)
            for name, value in zip(outs, res):
                if name is not None:
                    self.vals[sub][name] = value

    def _drop(self):
        """SGLang's ``DeepEPv2Buffer.destroy``: the last reference goes (no ``destroy()`` call); the ElasticBuffer
        and the Buffer under it must then be collected (their memory released by their finalizers). The step's
        inputs stay; every other value (handles, events: an event refers to its Buffer) goes."""
        import gc
        import weakref
        refs = [weakref.ref(self.buf), weakref.ref(self.buf._buffer)]
        self.buf = None
        for v in self.vals.values():
            for k in [k for k in v if k not in _INPUTS]:
                del v[k]
        gc.collect()
        assert all(r() is None for r in refs), "a dropped ElasticBuffer is still alive"
        return ()

    def _size_hints(self, normal, low_latency):
        B, R, H = self.deep_ep.Buffer, self.world, self.shape.H
        nvl = rdma = 0
        if normal:
            for cfg in (B.get_dispatch_config(R), B.get_combine_config(R)):
                nvl = max(cfg.get_nvl_buffer_size_hint(H * 2, R), nvl)
                rdma = max(cfg.get_rdma_buffer_size_hint(H * 2, R), rdma)
        if low_latency:
            rdma = max(B.get_low_latency_rdma_size_hint(self.shape.N, H, R, self.shape.E), rdma)
        return nvl, rdma

    def _expert(self, sub, kind, use_fp8=False):
        v = self.vals[sub]
        if kind == "normal":
            v["y"] = (v["recv_x"].float() * 2).to(torch.bfloat16)
        else:
            rx = v["recv_x"]
            if use_fp8:
                q, s = rx
                if s.dtype == torch.int32:
                    from triton_ep.kernels.fp8 import unpack_ue8m0
                    s = unpack_ue8m0(s.contiguous())
                rx = (q.float() * s.repeat_interleave(128, dim=-1)).to(torch.bfloat16)
            v["y"] = rx.clone()

    def _check(self, sub, what, use_fp8=False, round_scale=False, use_ue8m0=False, expert_alignment=1, **args):
        from triton_ep import reference as ref
        from tests.cases import ll as ll_cases
        from tests.engines import replay_v2
        v, me, s = self.vals[sub], self.rank, self.shape
        xs, idxs, ws = v["all_x"], v["all_idx"], v["all_w"]
        if what in ("normal_dispatch", "normal_combine"):
            exp = ref.dispatch(xs, idxs, ws, s.E, expert_alignment)
        if what == "normal_dispatch":
            e = exp[me]
            assert torch.equal(v["recv_x"].view(torch.int16), e["recv_x"].view(torch.int16)), "recv_x"
            assert torch.equal(v["recv_topk_idx"], e["recv_topk_idx"]), "recv_topk_idx"
            assert torch.equal(v["recv_topk_weights"], e["recv_topk_weights"]), "recv_topk_weights"
            assert v["num_recv_tokens_per_expert_list"] == e["num_recv_tokens_per_expert_list"]
        elif what == "normal_combine":
            ys = [(e["recv_x"].float() * 2).to(torch.bfloat16) for e in exp]
            n = self.per_host if self.per_host < self.world else None
            want = ref.combine(ys, exp, [x.shape[0] for x in xs], ranks_per_host=n)[me][0]
            got = v["combined_x"]
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), "combined_x"
            if "output" in v and got.shape == v["output"].shape:
                v["output"].copy_(got)
        elif what == "v2_dispatch":
            replay_v2.check_dispatch(v, me, self.world, s.E, expert_alignment=expert_alignment, **args)
        elif what == "v2_combine":
            replay_v2.check_combine(v, me, self.world, s.E // self.world,
                                    self.per_host if self.per_host < self.world else None)
        elif what == "ll_dispatch":
            ll_cases.check_dispatch(v["recv_x"], v["recv_count"], v["handle"], xs, idxs, self.world, s.E, me,
                                    use_fp8, round_scale, use_ue8m0)
        elif what == "ll_combine":
            x = xs[me]
            if use_fp8 and x.shape[0]:
                from triton_ep.kernels.fp8 import quantize_reference
                q, sc = quantize_reference(x, round_scale)
                x = (q.float() * sc.repeat_interleave(128, dim=-1)).to(torch.bfloat16)
            want = ll_cases.expected_combine(x, idxs[me], ws[me], s.E, self.world, "identity")
            got = v.get("combined_x", v["output"])
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), "combined_x"
        else:
            raise ValueError(f"unknown check {what!r}")
        self.trace.checks.append(f"{what}[{sub}]")


def replay_rank(rank, world, module, backend, shape=Shape(), env=None):
    """Rank body: turn the ``deep_ep`` switch on, import ``deep_ep`` as the engine does, replay the sequence
    ``backend`` of ``engines.<module>`` and check every result. Returns the rank's :class:`Trace`."""
    import importlib.util
    os.environ.update(env or {})
    os.environ["TRITON_EP_AS_DEEP_EP"] = "1"
    from triton_ep import deep_ep_hook
    deep_ep_hook.install()
    assert importlib.util.find_spec("deep_ep") is not None          # vLLM's has_deep_ep() look-up
    import deep_ep
    seq = find_sequence(module, backend)
    per_host = int(os.environ.get("TRITON_EP_RANKS_PER_HOST", world))
    r = _Rank(deep_ep, rank, world, shape, per_host)
    try:
        for call in seq.setup:
            r.run(call, "setup")
        for i, step in enumerate(seq.steps):
            r.inputs(step, i, distinct_experts=seq.v2)
            for call in step.calls:
                r.run(call, step.name)
        for call in seq.teardown:
            r.run(call, "teardown")
    finally:
        if r.buf is not None:
            r.buf.destroy()         # (idempotent; SGLang never destroys its process-wide Buffer)
    return r.trace


def replay_main(module: str, engine: str, default_backend: str, description: str, argv=None) -> int:
    """The command line of ``examples/replay_<engine>.py``: replay one backend's sequence of ``tests.engines.<module>``
    on CPU rank processes (``--ranks``, ``--hosts`` emulated hosts) and print its calls, or ``--list`` the backends.
    Returns the exit status (1 when a rank failed, with its traceback printed)."""
    import argparse
    import time
    from triton_ep.testing import run_ranks
    sequences = importlib.import_module(f"tests.engines.{module}").SEQUENCES
    from triton_ep.argtypes import positive_int
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--backend", default=default_backend, choices=[s.backend for s in sequences])
    p.add_argument("--ranks", type=positive_int, default=2, help="CPU rank processes (default 2)")
    p.add_argument("--hosts", type=positive_int, default=1,
                   help="emulated hosts, each of --ranks / --hosts ranks (a divisor of --ranks; default 1)")
    p.add_argument("--list", action="store_true")
    a = p.parse_args(argv)
    if a.ranks % a.hosts:       # (before any work: TRITON_EP_RANKS_PER_HOST is set from the two)
        p.error(f"--ranks {a.ranks} must be a multiple of --hosts {a.hosts} (hosts of equal size)")
    if a.list:
        for s in sequences:
            print(f"{s.backend:40s} {'V2 ElasticBuffer' if s.v2 else 'V1 Buffer':16s}", "-", "; ".join(s.deviations))
        return 0
    env = {} if a.hosts == 1 else {"TRITON_EP_RANKS_PER_HOST": str(a.ranks // a.hosts), "TRITON_EP_RDMA": "emulated"}
    print(f"replaying {a.backend} ({engine}'s calls, not {engine}) on {a.ranks} CPU ranks, {a.hosts} host(s)...")
    t = time.time()
    out = run_ranks(replay_rank, a.ranks, module, a.backend, Shape(H=512 if "ue8m0" in a.backend else 256), env)
    for r, o in enumerate(out):
        if not hasattr(o, "checks"):
            print(f"rank {r} failed: {o!r}\n{getattr(o, 'traceback', '')}")
            return 1
    print(f"rank 0 made {len(out[0].calls)} calls through {out[0].deep_ep_file}:")
    for c in out[0].calls:
        print("  ", c)
    print(f"all {a.ranks} ranks: {len(out[0].checks)} results equal to the reference ({time.time() - t:.0f} s)")
    return 0
