"""SGLang v0.5.23's DeepEP calls (``--moe-a2a-backend deepep --deepep-mode normal|low_latency|auto``, and
``--moe-a2a-backend deepep_v2``: ``sglang/srt/layers/moe/token_dispatcher/deepep_v2.py``), read from
the wheel ``sglang-0.5.23`` (it records no commit): ``sglang/srt/layers/moe/token_dispatcher/deepep.py``
(``DeepEPBuffer`` sizes and builds one process-wide Buffer; ``_DeepEPDispatcherImplNormal`` /
``_DeepEPDispatcherImplLowLatency`` call it in ``dispatch_a/b`` and ``combine_a/b``), and the two-batch-overlap
order of ``sglang/srt/batch_overlap/operations.py`` / ``operations_strategy.py``.

The MoE layers of fused_moe_triton/layer.py:211 build the dispatcher with ``async_finish=True,
return_recv_hook=True``; that is what is replayed. DeepGEMM (``expert_alignment=128``) and FP8 are the flags of
an FP8 DeepSeek deployment (``deep_gemm_wrapper.ENABLE_JIT_DEEPGEMM``); the bf16 path passes 1 and no FP8.
"""
from __future__ import annotations

from .calls import SGLANG, Call, Ref, Sequence, Step

D = f"sglang/srt/layers/moe/token_dispatcher/deepep.py@{SGLANG}"
OPS = f"sglang/srt/batch_overlap/operations.py@{SGLANG}"
STRAT = f"sglang/srt/batch_overlap/operations_strategy.py@{SGLANG}"


def _normal_a(sub):
    return (Call("capture", {}, f"{D}:574", out=("previous_event",), sub=sub,
                 note="dispatch_a: Buffer.capture() as async_finish is True"),)


def _normal_b(sub, alignment):
    return (
        Call("get_dispatch_layout", dict(topk_idx=Ref("topk_idx"), num_experts=Ref("E"),
                                         previous_event=Ref("previous_event"), async_finish=True,
                                         allocate_on_comm_stream=True), f"{D}:648",
             out=("num_tokens_per_rank", "num_tokens_per_rdma_rank", "num_tokens_per_expert", "is_token_in_rank",
                  "previous_event"), sub=sub),
        Call("dispatch", dict(x=Ref("x"), topk_idx=Ref("topk_idx"), topk_weights=Ref("topk_weights"),
                              num_tokens_per_rank=Ref("num_tokens_per_rank"),
                              num_tokens_per_rdma_rank=Ref("num_tokens_per_rdma_rank"),
                              is_token_in_rank=Ref("is_token_in_rank"), num_tokens_per_expert=Ref("num_tokens_per_expert"),
                              previous_event=Ref("previous_event"), async_finish=True, allocate_on_comm_stream=True,
                              expert_alignment=alignment, config=None), f"{D}:668",
             out=("recv_x", "recv_topk_idx", "recv_topk_weights", "num_recv_tokens_per_expert_list", "handle", "event"),
             sub=sub, note="config: DeepEPConfig's normal_dispatch_config, None without --deepep-config"),
        Call("wait", dict(event=Ref("event")), f"{D}:619", sub=sub),
        Call("check", dict(what="normal_dispatch", expert_alignment=alignment), sub=sub),
        Call("expert", dict(kind="normal"), sub=sub),
        Call("capture", {}, f"{D}:710", out=("previous_event",), sub=sub, note="combine_a"),
    )


def _normal_combine(sub):
    return (
        Call("combine", dict(x=Ref("y"), handle=Ref("handle"), async_finish=True, previous_event=Ref("previous_event"),
                             allocate_on_comm_stream=True, config=None), f"{D}:723", out=("combined_x", None, "event"),
             sub=sub),
        Call("wait", dict(event=Ref("event")), f"{D}:715", sub=sub),
        Call("check", dict(what="normal_combine"), sub=sub),
    )


def _ll_dispatch(sub, use_fp8, switch_from_normal):
    pre = (Call("clean_low_latency_buffer", dict(num_max_dispatch_tokens_per_rank=Ref("N"), hidden=Ref("H"),
                                                 num_experts=Ref("E")), f"{D}:312", sub=sub,
                note="set_dispatch_mode_as_low_latency after a normal-mode call, low_latency_mode only"),) \
        if switch_from_normal else ()
    fp8_opts = dict(round_scale=False, use_ue8m0=False) if use_fp8 else {}
    return pre + (
        Call("low_latency_dispatch", dict(x=Ref("x"), topk_idx=Ref("topk_idx"), num_max_dispatch_tokens_per_rank=Ref("N"),
                                          num_experts=Ref("E"), use_fp8=use_fp8, async_finish=False,
                                          return_recv_hook=True, **fp8_opts), f"{D}:843",
             out=("recv_x", "recv_count", "handle", "event", "hook"), sub=sub,
             note="dispatch_a; also reads buffer.group_size for expected_m (deepep.py:769); round_scale/use_ue8m0 "
                  "True only with DeepGEMM on Blackwell"),
    )


def _ll_dispatch_b(sub, use_fp8):
    return (Call("hook", dict(hook=Ref("hook")), f"{D}:797", sub=sub),
            Call("check", dict(what="ll_dispatch", use_fp8=use_fp8), sub=sub),
            Call("expert", dict(kind="ll", use_fp8=use_fp8), sub=sub),
            Call("low_latency_combine", dict(x=Ref("y"), topk_idx=Ref("topk_idx"), topk_weights=Ref("topk_weights"),
                                             handle=Ref("handle"), async_finish=False, return_recv_hook=True),
                 f"{D}:950", out=("combined_x", "event", "hook"), sub=sub, note="combine_a"))


def _ll_combine_b(sub, use_fp8):
    return (Call("hook", dict(hook=Ref("hook")), f"{D}:908", sub=sub),
            Call("check", dict(what="ll_combine", use_fp8=use_fp8), sub=sub))


def _setup(mode):
    enable_normal, enable_ll = mode in ("normal", "auto"), mode in ("low_latency", "auto")
    qps = {"normal": Ref("num_sms"), "low_latency": Ref("E_local"), "auto": Ref("max_num_sms_E_local")}[mode]
    return (
        Call("size_hints", dict(normal=enable_normal, low_latency=enable_ll), f"{D}:226",
             out=("num_nvl_bytes", "num_rdma_bytes"),
             note="max of get_dispatch_config/get_combine_config(R).get_nvl/rdma_buffer_size_hint(H*2, R) "
                  "(deepep.py:224-237) and get_low_latency_rdma_size_hint(N, H, R, E) (deepep.py:244)"),
        Call("Buffer", dict(group=Ref("group"), num_nvl_bytes=Ref("num_nvl_bytes"), num_rdma_bytes=Ref("num_rdma_bytes"),
                            low_latency_mode=enable_ll, num_qps_per_rank=qps, allow_mnnvl=False), f"{D}:304",
             note="num_qps_per_rank: deepep.py:256-265 (num_sms is Buffer.num_sms, deepep.py:359)"),
    )


def sequence(mode, use_fp8=False, deepgemm=False, tbo=False):
    """``--deepep-mode`` ``mode``; ``tbo``: ``--enable-two-batch-overlap`` (two dispatchers, one Buffer)."""
    alignment = 128 if deepgemm else 1
    subs = (0, 1) if tbo else (0,)
    steps = []
    if mode in ("normal", "auto"):
        if tbo:   # prefill strategy: delta 0, stages [.. dispatch_a] [dispatch_b .. combine_a] [.. combine_b ..]
            calls = (_normal_a(0) + _normal_a(1) + _normal_b(0, alignment) + _normal_b(1, alignment)
                     + _normal_combine(0) + _normal_combine(1))
        else:
            calls = _normal_a(0) + _normal_b(0, alignment) + _normal_combine(0)
        steps.append(Step("prefill", calls, (7, 0, 5, 3)))
    if mode in ("low_latency", "auto"):
        switch = mode == "auto"
        if tbo:   # decode strategy: delta 2 -> A dispatch_a, A dispatch_b/combine_a, A combine_b, B ... (operations.py:60-68)
            calls = (_ll_dispatch(0, use_fp8, switch) + _ll_dispatch_b(0, use_fp8) + _ll_combine_b(0, use_fp8)
                     + _ll_dispatch(1, use_fp8, False) + _ll_dispatch_b(1, use_fp8) + _ll_combine_b(1, use_fp8))
        else:
            calls = _ll_dispatch(0, use_fp8, switch) + _ll_dispatch_b(0, use_fp8) + _ll_combine_b(0, use_fp8)
        steps.append(Step("decode", calls, (1, 2, 0, 1)))
    if mode == "auto":   # prefill again after decode, then decode: the switch back and forth
        steps += [Step("prefill_again", steps[0].calls, (2, 6, 1, 0)), Step("decode_again", steps[1].calls, (3, 0, 2, 2))]
    name = f"deepep_{mode}" + ("_fp8" if use_fp8 else "") + ("_deepgemm" if deepgemm else "") + ("_tbo" if tbo else "")
    return Sequence(SGLANG, name, setup=_setup(mode), steps=tuple(steps),
                    deviations=("hidden 256 and num_max_dispatch_tokens_per_rank 8 (SGLang: the model's hidden, "
                                "SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK default 128)",
                                f"two-batch overlap: sub-batches {subs}" if tbo else "one batch"))


# --------------------------------------------------------------------------------------------- deepep_v2
V2 = f"sglang/srt/layers/moe/token_dispatcher/deepep_v2.py@{SGLANG}"
V2_ALIGNMENT = 128      # _EXPERT_ALIGNMENT (deepep_v2.py:35): DeepGEMM's contiguous alignment


def _v2_buffer(use_fp8, hybrid):
    return Call("ElasticBuffer", dict(group=Ref("group"), num_max_tokens_per_rank=Ref("N"), hidden=Ref("H"),
                                      num_topk=Ref("K"), use_fp8_dispatch=use_fp8, allow_hybrid_mode=hybrid, sl_idx=0,
                                      prefer_overlap_with_compute=False), f"{V2}:192",
                note="DeepEPv2Buffer.get_buffer (:160-217): built on the first dispatch (or prebuild, :269), cached "
                     "by (group, hidden, topk, N, use_fp8, hybrid, R); EP_REUSE_NCCL_COMM defaulted to 0 first (:191); "
                     "N = SGLANG_DEEPEP_V2_NUM_MAX_DISPATCH_TOKENS_PER_RANK; hybrid = --deepep-v2-mode hybrid")


def _v2_step(name, tokens, decode, expand, use_fp8, ue8m0=False):
    """One MoE layer of ``_DeepEPv2Impl``: dispatch (deepep_v2.py:331-461), DeepGEMM's permutes around the experts,
    combine (:463-487). Decode (``not get_is_extend_in_batch()``): masked, expanded, no host wait; prefill: host
    wait, expanded unless ``SGLANG_DEEPEP_V2_ENABLE_PREFILL_EXPAND=0`` (or UE8M0 scales)."""
    calls = []
    if not decode:
        calls.append(Call("read", dict(what="sglang_pad_empty"), f"{V2}:348",
                          note="an idle rank sends one zero row to experts 0..K-1 with zero weights"))
    if use_fp8:
        calls.append(Call("read", dict(what="quantize_fp8", ue8m0=ue8m0), f"{V2}:{363 if expand else 372}",
                          note="sglang_per_token_group_quant_fp8(x, 128): row-major fp32 scales (Hopper), or "
                               "packed UE8M0 column-major (DeepGEMM's UE8M0 scales)"))
    sync = not decode
    calls += [
        Call("dispatch", dict(x=Ref("x"), topk_idx=Ref("topk_idx"), topk_weights=Ref("topk_weights"),
                              num_experts=Ref("E"), num_max_tokens_per_rank=Ref("N"), expert_alignment=V2_ALIGNMENT,
                              num_sms=0, use_tma_aligned_col_major_sf=ue8m0, do_cpu_sync=sync, do_expand=expand),
             f"{V2}:385", out=("recv_x", "recv_topk_idx", "recv_topk_weights", "handle", "event"),
             note="num_sms: SGLANG_DEEPEP_V2_NUM_SMS (default 0); topk_idx cast to int64 (:341); no handle passed "
                  "(no cached dispatch); the handle is held until combine (:447)"),
        Call("check", dict(what="v2_dispatch", num_max_tokens_per_rank=Ref("N"), expert_alignment=V2_ALIGNMENT,
                           do_expand=expand, do_cpu_sync=sync, col_major_sf=ue8m0)),
        Call("wait", dict(event=Ref("event")), f"{V2}:398"),
        Call("read", dict(what="sglang_dispatch_output", expanded=expand, masked=decode,
                          num_max_tokens_per_rank=Ref("N"), num_ranks=Ref("R")), f"{V2}:407",
             note="reads handle.psum_num_recv_tokens_per_scaleup_rank[-1].item() (not expanded, :416) and passes "
                  "handle.psum_num_recv_tokens_per_expert to DeepGEMM (:453)"),
        Call("expert", dict(kind="v2", engine="sglang", expert_alignment=V2_ALIGNMENT),
             note="moe_runner/deep_gemm.py:1715 (pre-permute from the psum), the GEMM, :1864 (post-permute)"),
        Call("combine", dict(x=Ref("y"), handle=Ref("handle"), topk_weights=Ref("combine_w")), f"{V2}:475",
             out=("combined_x", "combined_topk_weights", "event"),
             note="x positional in SGLang; topk_weights None for the expanded layouts (weights fused before)"),
        Call("wait", dict(event=Ref("event")), f"{V2}:481"),
        Call("read", dict(what="sglang_combine_output"), f"{V2}:482"),
        Call("check", dict(what="v2_combine")),
    ]
    return Step(name, tuple(calls), tokens)


def sequence_v2(prefill_expand=True, use_fp8=False, hybrid=False, rebuild=False, ue8m0=False):
    """``--moe-a2a-backend deepep_v2`` (``--moe-runner-backend deep_gemm``; no two-batch overlap: SGLang rejects
    it, arg_groups/moe_hook.py:420). ``prefill_expand=False``: ``SGLANG_DEEPEP_V2_ENABLE_PREFILL_EXPAND=0`` (the
    default on Blackwell's UE8M0 scales); ``hybrid``: ``--deepep-v2-mode hybrid`` (required across nodes);
    ``rebuild``: the process-wide buffer dropped and built again (a cache-key change), then another decode step;
    ``ue8m0``: FP8 with DeepGEMM's UE8M0 scales (Blackwell: prefill not expanded unless the variable says so).
    SGLang never calls ``ElasticBuffer.destroy``: the buffer goes when its last reference does."""
    steps = [_v2_step("prefill", (7, 0, 5, 3), False, prefill_expand, use_fp8, ue8m0),
             _v2_step("decode", (1, 2, 0, 1), True, True, use_fp8, ue8m0)]
    if rebuild:
        again = _v2_step("decode_after_rebuild", (2, 0, 3, 1), True, True, use_fp8)
        steps.append(Step(again.name, (Call("drop", {}, f"{V2}:188", note="DeepEPv2Buffer.destroy (:220-223)"),
                                       _v2_buffer(use_fp8, hybrid)) + again.calls, again.tokens))
    name = "deepep_v2" + ("" if prefill_expand else "_prefill_not_expanded") + ("_fp8" if use_fp8 else "") + \
        ("_ue8m0" if ue8m0 else "") + ("_hybrid" if hybrid else "") + ("_rebuild" if rebuild else "")
    setup = (_v2_buffer(use_fp8, hybrid), Call("read", dict(what="attr", name="num_bytes"), f"{V2}:215",
                                               out=("num_bytes",), note="logged"))
    return Sequence(SGLANG, name, setup=setup, steps=tuple(steps),
                    teardown=(Call("drop", {}, f"{V2}:220", note="DeepEPv2Buffer.destroy: drops the reference"),),
                    deviations=("hidden 256 and num_max_tokens_per_rank 8 (SGLang: the model's hidden, "
                                "SGLANG_DEEPEP_V2_NUM_MAX_DISPATCH_TOKENS_PER_RANK default 128)",
                                "masked_max_m = N * R (_masked_token_capacity's bound with attention DP)"))


DEEPEP_V2 = sequence_v2()
SEQUENCES = (sequence("normal"), sequence("low_latency"), sequence("auto"), sequence("auto", tbo=True),
             sequence("normal", deepgemm=True, tbo=True), sequence("low_latency", use_fp8=True, tbo=True),
             DEEPEP_V2, sequence_v2(prefill_expand=False, rebuild=True), sequence_v2(use_fp8=True, hybrid=True),
             sequence_v2(prefill_expand=False, use_fp8=True), sequence_v2(False, use_fp8=True, ue8m0=True))
