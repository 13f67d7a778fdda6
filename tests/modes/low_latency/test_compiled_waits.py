"""The low-latency kernels' waits compile for an H200 (sm_90) on this CPU machine, with and without the network leg:
across hosts every wait also reads the RDMA proxy's abort word (``kernels.ll_net.abort_word``: a pointer with
``NET``, ``None`` without, where the wait reads nothing more). The interpreter runs the kernels untyped, so a
compiled-only fault (a wait's loop-carried status, the ``None`` branch) would show first on a GPU."""
import textwrap

from tests.cases.helpers import compiles_for_the_gpu


def test_low_latency_kernels_compile_for_sm90_with_and_without_the_network_leg():
    """The low-latency kernels with waits (the unpack of the network's chunks, the send with its ring slots, the
    receive and the fence with ``NET`` on and off) compile to a cubin for sm_90; with ``NET`` the receive's and the
    fence's waits each read one word more than without (the abort word), and nothing more."""
    code = textwrap.dedent('''
        import os
        os.environ["TRITON_INTERPRET"] = "0"
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from triton_ep.kernels import ll_dispatch, ll_fence, ll_net
        I64 = ("ctl", "ring_ctl", "hdr", "hdr_delta", "host", "cost_ptr", "layout", "idx_ptr")
        PTR = ("area_w", "area_q", "area_f", "area_h", "remote", "out_w", "out_s", "src_info", "ret_slot", "count",
               "stats_ptr", "x_ptr", "xw_ptr", "slot_ptr", "cnt_ptr", "delta_w", "w_ptr", "out_ptr", "ltab")
        base = dict(R=4, SHRINK=False, USE_CLOCK=True, USE_ASM=True, COST=True)
        cases = [
            (ll_net._ll_unpack_kernel, dict(base, COMBINE=False, REC=68, CW=4, RW=68, ARRIVAL_WORD=False, BLOCK_R=4,
                                            BLOCK_W=64, BLOCK_C=2)),
            (ll_dispatch._ll_dispatch_send_kernel, dict(base, NET=True, CW=4, BLOCK_C=2, K=2, H=128, PW=64, SW=0,
                                                        REC=68, FP8=False, ROUND_SCALE=False, NATIVE=False,
                                                        DEFER=False, BLOCK_T=4, BLOCK_H=128, BLOCK_K=2,
                                                        BLOCK_E=1024)),
        ]
        for net in (False, True):
            cases += [
                (ll_dispatch._ll_dispatch_recv_kernel, dict(base, NET=net, K=2, PW=64, SW=0, REC=68, UE8M0=False,
                                                            STATS=False, DEFER=False, BLOCK_R=4, BLOCK_W=64,
                                                            BLOCK_S=4, BLOCK_F=64)),
                (ll_fence._ll_fence_kernel, dict(R=4, SHRINK=False, USE_CLOCK=True, NET=net)),
            ]
        loads = {}
        for fn, consts in cases:
            names = [p.name for p in fn.params]
            types = {n: "constexpr" if n in consts else "*i64" if n in I64 else "*i32" if n in PTR else "i64"
                     for n in names}
            k = triton.compile(ASTSource(fn=fn, signature=types,
                                         constexprs={(names.index(c),): v for c, v in consts.items() if c in names}),
                               target=GPUTarget("cuda", 90, 32))
            assert "cubin" in k.asm, list(k.asm)
            if "NET" in consts and fn is not ll_dispatch._ll_dispatch_send_kernel:
                loads[(fn.fn.__name__, consts["NET"])] = k.asm["ttir"].count("tt.load")
        for name in ("_ll_dispatch_recv_kernel", "_ll_fence_kernel"):     # (one wait per peer: R = 4, unrolled)
            assert loads[(name, True)] == loads[(name, False)] + 4, loads
        print("ok")
    ''')
    compiles_for_the_gpu(code)


def test_low_latency_waits_compile_for_sm90_with_rank_masking():
    """With ``SHRINK`` (``enable_shrink``) every low-latency wait also reads the peer's ``GAVEUP`` word (a peer that
    gave up on this rank is masked at once: ``flags.wait_at_least``'s ``gave_ptr``), and a wait that masks a peer
    tells it (``ll_flags.ll_give_up``; across hosts the unpack's and the send slots' waits read the ``GAVE`` ring word
    and ``ll_net.mask_peer`` stores ``GSRC``). The receive, the fence and the send (whose waits the one-launch calls
    share), and the unpack and the send with the network leg, compile to a cubin for sm_90 with and without it; within
    one host, per peer (R = 4, unrolled) ``SHRINK`` adds four loads to a
    wait, no more: the word after the flag's acquire (the only one on the path where the flag is there), the word at a
    look while the flag is short, and, where the wait masks the peer, its block's address and its word there."""
    code = textwrap.dedent('''
        import os
        os.environ["TRITON_INTERPRET"] = "0"
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from triton_ep.kernels import ll_dispatch, ll_fence, ll_net
        I64 = ("ctl", "ring_ctl", "hdr", "hdr_delta", "host", "cost_ptr", "layout", "idx_ptr")
        PTR = ("area_w", "area_q", "area_f", "area_h", "remote", "out_w", "out_s", "src_info", "ret_slot", "count",
               "stats_ptr", "x_ptr", "xw_ptr", "slot_ptr", "cnt_ptr", "delta_w", "w_ptr", "out_ptr", "ltab")
        loads = {}
        for shrink in (False, True):
            base = dict(R=4, SHRINK=shrink, USE_CLOCK=True, USE_ASM=True, COST=True)
            cases = [
                (ll_dispatch._ll_dispatch_recv_kernel, dict(base, NET=False, K=2, PW=64, SW=0, REC=68, UE8M0=False,
                                                            STATS=False, DEFER=False, BLOCK_R=4, BLOCK_W=64,
                                                            BLOCK_S=4, BLOCK_F=64)),
                (ll_fence._ll_fence_kernel, dict(R=4, SHRINK=shrink, USE_CLOCK=True, NET=False)),
                (ll_dispatch._ll_dispatch_send_kernel, dict(base, NET=False, CW=4, BLOCK_C=2, K=2, H=128, PW=64,
                                                            SW=0, REC=68, FP8=False, ROUND_SCALE=False, NATIVE=False,
                                                            DEFER=False, BLOCK_T=4, BLOCK_H=128, BLOCK_K=2,
                                                            BLOCK_E=1024)),
                # across hosts: the network waits read the GAVE ring word (counted for the others only)
                (ll_net._ll_unpack_kernel, dict(base, COMBINE=False, REC=68, CW=4, RW=68, ARRIVAL_WORD=False,
                                                BLOCK_R=4, BLOCK_W=64, BLOCK_C=2)),
                (ll_dispatch._ll_dispatch_send_kernel, dict(base, NET=True, CW=4, BLOCK_C=2, K=2, H=128, PW=64,
                                                            SW=0, REC=68, FP8=False, ROUND_SCALE=False, NATIVE=False,
                                                            DEFER=False, BLOCK_T=4, BLOCK_H=128, BLOCK_K=2,
                                                            BLOCK_E=1024)),
            ]
            for fn, consts in cases:
                names = [p.name for p in fn.params]
                types = {n: "constexpr" if n in consts else "*i64" if n in I64 else "*i32" if n in PTR else "i64"
                         for n in names}
                k = triton.compile(ASTSource(fn=fn, signature=types,
                                             constexprs={(names.index(c),): v for c, v in consts.items()
                                                         if c in names}),
                                   target=GPUTarget("cuda", 90, 32))
                assert "cubin" in k.asm, list(k.asm)
                if consts.get("NET") is False:
                    loads[(fn.fn.__name__, shrink)] = k.asm["ttir"].count("tt.load")
        print(loads)
        for name in ("_ll_dispatch_recv_kernel", "_ll_fence_kernel", "_ll_dispatch_send_kernel"):
            assert loads[(name, True)] == loads[(name, False)] + 4 * 4, loads
        print("ok")
    ''')
    compiles_for_the_gpu(code)
