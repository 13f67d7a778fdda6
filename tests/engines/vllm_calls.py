"""vLLM v0.33.0's DeepEP calls (``--all2all-backend deepep_high_throughput``, ``deepep_low_latency`` and
``deepep_v2``), read from the wheel ``vllm-0.33.0`` (commit 4ba787ec9): the managers in
``vllm/distributed/device_communicators/all2all.py`` build the Buffer (the ElasticBuffer for V2),
``vllm/model_executor/layers/fused_moe/prepare_finalize/deepep_{ht,ll,v2}.py`` call it.

What vLLM passes that the replay changes (CPU interpreter sizes): ``num_nvl_bytes`` is
``VLLM_DEEPEP_BUFFER_SIZE_MB`` MiB (default 1024), replayed with 2 MiB; low-latency hidden sizes are rounded up to
one of 2048..8192 (deepep_ll.py:57), replayed with 256; HT hidden sizes are rounded to 512 bytes (deepep_ht.py:59),
256 bf16 is one such. Without DBO (micro-batching) ``previous_event`` is ``None`` (``dbo_get_previous_event``
returns None) and ``async_finish`` is True in HT; that is the path replayed.
"""
from __future__ import annotations

from .calls import VLLM, Call, Ref, Sequence, Step

A2A = f"vllm/distributed/device_communicators/all2all.py@{VLLM}"
HT = f"vllm/model_executor/layers/fused_moe/prepare_finalize/deepep_ht.py@{VLLM}"
LL = f"vllm/model_executor/layers/fused_moe/prepare_finalize/deepep_ll.py@{VLLM}"
UB = f"vllm/v1/worker/ubatch_utils.py@{VLLM}"

NVL_BYTES = 2 << 20     # VLLM_DEEPEP_BUFFER_SIZE_MB * 1024 * 1024 in vLLM (all2all.py:263), scaled down


def _ht_step(name, tokens, async_combine):
    return Step(name, (
        Call("get_dispatch_layout", dict(topk_idx=Ref("topk_idx"), num_experts=Ref("E"), previous_event=None,
                                         async_finish=False, allocate_on_comm_stream=False), f"{HT}:155",
             out=("num_tokens_per_rank", "num_tokens_per_rdma_rank", "num_tokens_per_expert", "is_token_in_rank",
                  None)),
        Call("get_dispatch_config", dict(num_ranks=Ref("R")), f"{HT}:115", out=("dispatch_config",),
             note="only for R in (2, 4, 8, 16, 24, 32, 64, 128, 144, 160), else config=None (deepep_ht.py:113)"),
        Call("dispatch", dict(x=Ref("x"), handle=None, num_tokens_per_rank=Ref("num_tokens_per_rank"),
                              num_tokens_per_rdma_rank=Ref("num_tokens_per_rdma_rank"),
                              is_token_in_rank=Ref("is_token_in_rank"), num_tokens_per_expert=Ref("num_tokens_per_expert"),
                              topk_idx=Ref("topk_idx"), topk_weights=Ref("topk_weights"), expert_alignment=1,
                              config=Ref("dispatch_config"), previous_event=None, async_finish=True,
                              allocate_on_comm_stream=False), f"{HT}:174",
             out=("recv_x", "recv_topk_idx", "recv_topk_weights", "num_recv_tokens_per_expert_list", "handle",
                  "event")),
        Call("wait", dict(event=Ref("event")), f"{HT}:227",
             note="then reads recv_x, recv_topk_idx (-1 -> an expert elsewhere), the per-expert list (deepep_ht.py:249-259)"),
        Call("check", dict(what="normal_dispatch")),
        Call("expert", dict(kind="normal"), note="the experts and TopKWeightAndReduceContiguous (deepep_ht.py:388)"),
        Call("get_combine_config", dict(num_ranks=Ref("R")), f"{HT}:120", out=("combine_config",)),
        Call("combine", dict(x=Ref("y"), handle=Ref("handle"), topk_weights=None, config=Ref("combine_config"),
                             previous_event=None, async_finish=async_combine, allocate_on_comm_stream=False),
             f"{HT}:402", out=("combined_x", None, "event")),
        Call("wait", dict(event=Ref("event")), f"{HT}:421", note="then output.copy_(combined_x) (deepep_ht.py:423)"),
        Call("check", dict(what="normal_combine")),
    ), tokens)


HIGH_THROUGHPUT = Sequence(
    VLLM, "deepep_high_throughput",
    setup=(
        Call("Buffer", dict(group=Ref("group"), num_nvl_bytes=NVL_BYTES, num_rdma_bytes=Ref("ht_rdma_bytes"),
                            low_latency_mode=False, num_qps_per_rank=Ref("ht_qps"), explicitly_destroy=True),
             f"{A2A}:278", note="num_rdma_bytes/num_qps_per_rank: 0/1 on one host, buffer size/num_sms//2 across hosts (all2all.py:267-272)"),
        Call("set_num_sms", dict(new_num_sms=20), f"{A2A}:311", note="under DBO only (ubatch_utils.py:115), clamped to 20"),
    ),
    steps=(_ht_step("prefill", (7, 0, 5, 3), async_combine=False), _ht_step("decode", (1, 2, 0, 1), async_combine=True)),
    teardown=(Call("destroy", {}, f"{A2A}:251"),),
    deviations=("num_nvl_bytes 2 MiB (vLLM: VLLM_DEEPEP_BUFFER_SIZE_MB, default 1024 MiB)",),
)


def _ll_step(name, tokens, use_fp8, ue8m0, async_combine):
    calls = [
        Call("low_latency_dispatch", dict(x=Ref("x"), topk_idx=Ref("topk_idx"), num_max_dispatch_tokens_per_rank=Ref("N"),
                                          num_experts=Ref("E"), use_fp8=use_fp8, round_scale=ue8m0, use_ue8m0=ue8m0,
                                          async_finish=False, return_recv_hook=True), f"{LL}:294",
             out=("recv_x", "recv_count", "handle", None, "hook")),
        Call("hook", dict(hook=Ref("hook")), f"{LL}:365", note="prepare(): hook() then the receiver reads recv_x, recv_count"),
        Call("check", dict(what="ll_dispatch", use_fp8=use_fp8, round_scale=ue8m0, use_ue8m0=ue8m0)),
        Call("expert", dict(kind="ll", use_fp8=use_fp8)),
        Call("low_latency_combine", dict(x=Ref("y"), topk_idx=Ref("topk_idx"), topk_weights=Ref("topk_weights"),
                                         handle=Ref("handle"), async_finish=False, zero_copy=False,
                                         return_recv_hook=async_combine, out=Ref("output")), f"{LL}:395",
             out=(None, None, "hook")),
    ]
    if async_combine:
        calls.append(Call("hook", dict(hook=Ref("hook")), f"{LL}:394",
                          note="finalize_async: the modular kernel runs the returned hook (dbo_maybe_run_recv_hook)"))
    calls.append(Call("check", dict(what="ll_combine", use_fp8=use_fp8, round_scale=ue8m0)))
    return Step(name, tuple(calls), tokens)


def low_latency(use_fp8=False, ue8m0=False, fault_tolerance=True):
    """``deepep_low_latency``: bf16 or FP8 dispatch (``use_fp8_dispatch``: block-quantised FP8 models;
    ``ue8m0``: an expert kernel that takes packed UE8M0 scales, deepep_ll.py:118-127), with vLLM's fault-tolerance
    path (``--enable-fault-tolerance``: enable_shrink, then clean_buffers between two decode steps)."""
    ft = ()
    if fault_tolerance:
        ft = (Step("fault_tolerance_clean", (
            Call("low_latency_query_mask_buffer", dict(mask_status=Ref("mask")), f"{A2A}:395"),
            Call("rdma_zero", {}, f"{A2A}:409"),
            Call("low_latency_clean_mask_buffer", {}, f"{A2A}:411"),
        ), (0,)), _ll_step("decode_after_clean", (2, 1, 0, 3), use_fp8, ue8m0, async_combine=True))
    return Sequence(
        VLLM, "deepep_low_latency" + ("_fp8" if use_fp8 else "") + ("_ue8m0" if ue8m0 else ""),
        setup=(
            Call("get_low_latency_rdma_size_hint", dict(num_max_dispatch_tokens_per_rank=Ref("N"), hidden=Ref("H"),
                                                        num_ranks=Ref("R"), num_experts=Ref("E")), f"{A2A}:347",
                 out=("num_rdma_bytes",)),
            Call("Buffer", dict(group=Ref("group"), num_nvl_bytes=NVL_BYTES, num_rdma_bytes=Ref("num_rdma_bytes"),
                                low_latency_mode=True, num_qps_per_rank=Ref("E_local"),
                                allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False, explicitly_destroy=True,
                                enable_shrink=fault_tolerance), f"{A2A}:357"),
        ),
        steps=(_ll_step("prefill", (7, 0, 5, 3), use_fp8, ue8m0, async_combine=False),
               _ll_step("decode", (1, 2, 0, 1), use_fp8, ue8m0, async_combine=True)) + ft,
        teardown=(Call("destroy", {}, f"{A2A}:251"),),
        deviations=("num_nvl_bytes 2 MiB (vLLM: default 1024 MiB)",
                    "hidden 256 (vLLM rounds up to 2048..8192, deepep_ll.py:57)"),
    )


LOW_LATENCY = low_latency()

# --------------------------------------------------------------------------------------------- deepep_v2
V2 = f"vllm/model_executor/layers/fused_moe/prepare_finalize/deepep_v2.py@{VLLM}"
UTILS = f"vllm/model_executor/layers/fused_moe/all2all_utils.py@{VLLM}"


def _v2_step(name, tokens, use_cudagraph, use_fp8):
    """One MoE layer of ``DeepEPV2PrepareAndFinalize``: prepare_async -> _do_dispatch -> _receiver, the experts,
    finalize_async -> _finalize -> its receiver. ``use_cudagraph`` (``not enforce_eager``, all2all_utils.py:301) is
    fixed per process, so prefill and decode take the same path: worst case, not expanded (CUDA graphs) or exact,
    expanded (``--enforce-eager``)."""
    calls = []
    if use_fp8:
        calls.append(Call("read", dict(what="quantize_fp8"), f"{V2}:397",
                          note="_quantize_before_dispatch (block FP8): moe_kernel_quantize_input, row-major scales"))
    nmax = None
    if use_cudagraph:
        calls.append(Call("read", dict(what="vllm_num_max_tokens"), f"{V2}:212", out=("num_max_tokens_per_rank",),
                          note="max(dp_metadata.num_tokens_across_dp_cpu) (/ sp_size) rounded up to a power of 2"))
        nmax = Ref("num_max_tokens_per_rank")
    exact = not use_cudagraph
    calls += [
        Call("dispatch", dict(x=Ref("x"), topk_idx=Ref("topk_idx"), topk_weights=Ref("topk_weights"),
                              num_experts=Ref("E"), num_max_tokens_per_rank=nmax, do_expand=exact, do_cpu_sync=exact,
                              async_with_compute_stream=False), f"{V2}:220",
             out=("recv_x", "recv_topk_idx", "recv_topk_weights", "handle", "event"),
             note="x is (x, scales) with FP8; handle kept per DBO micro-batch (self.handles[a2a_idx], :231-232)"),
        Call("check", dict(what="v2_dispatch", num_max_tokens_per_rank=nmax or Ref("N"), do_expand=exact,
                           do_cpu_sync=exact)),
        Call("wait", dict(event=Ref("event")), f"{V2}:262"),
        Call("read", dict(what="vllm_receiver", num_experts=Ref("E")), f"{V2}:270",
             note="reads handle.num_recv_tokens_per_expert_list (:240, :270-303) and "
                  "handle.psum_num_recv_tokens_per_scaleup_rank (:242, :319, :340: psum[-1] in the kernel, :567)"),
        Call("expert", dict(kind="v2", engine="vllm"),
             note="the experts, then TopKWeightAndReduceContiguous (:468-477)"),
        Call("combine", dict(x=Ref("y"), handle=Ref("handle"), topk_weights=None, async_with_compute_stream=True,
                             allocate_on_comm_stream=True), f"{V2}:488",
             out=("combined_x", None, "event"), note="finalize_async without DBO: combine_async = True (:487)"),
        Call("wait", dict(event=Ref("event")), f"{V2}:503"),
        Call("read", dict(what="vllm_copy_output"), f"{V2}:504"),
        Call("check", dict(what="v2_combine")),
    ]
    return Step(name, tuple(calls), tokens)


def deepep_v2(use_cudagraph=True, use_fp8=False):
    """``--all2all-backend deepep_v2``: ``DeepEPV2All2AllManager`` (all2all.py:1040-1128) builds one ElasticBuffer
    per argument set and destroys it at shutdown; ``use_cudagraph=False`` is ``--enforce-eager``; ``use_fp8``: a
    block-FP8 model (all2all_utils.py:287-291). vLLM never passes a handle to dispatch (no cached dispatch)."""
    return Sequence(
        VLLM, "deepep_v2" + ("" if use_cudagraph else "_eager") + ("_fp8" if use_fp8 else ""),
        setup=(
            Call("ElasticBuffer", dict(group=Ref("group"), num_max_tokens_per_rank=Ref("N"), hidden=Ref("H"),
                                       num_topk=Ref("K"), use_fp8_dispatch=use_fp8, allow_hybrid_mode=True,
                                       prefer_overlap_with_compute=False, allow_multiple_reduction=False,
                                       explicitly_destroy=True), f"{A2A}:1111",
                 note="handle_cache.get_or_create(_make_all2all_kwargs(...), deep_ep.ElasticBuffer) (:1053-1072): "
                      "num_max_tokens_per_rank=moe.max_num_tokens, hidden, num_topk from all2all_utils.py:289-295; "
                      "VLLM_DEEPEP_V2_ALLOW_HYBRID_MODE=1, _PREFER_OVERLAP=0, _ALLOW_MULTIPLE_REDUCTION=0 (defaults); "
                      "group: the device group (here the default group). Before it: _check_gin_support (:1074), "
                      "no deep_ep call"),
            Call("get_theoretical_num_sms", dict(num_experts=Ref("E"), num_topk=Ref("K")), f"{A2A}:1115",
                 out=("num_sms",), note="kept as max_sms_used() (:1121)"),
        ),
        steps=(_v2_step("prefill", (7, 0, 5, 3), use_cudagraph, use_fp8),
               _v2_step("decode", (1, 2, 0, 1), use_cudagraph, use_fp8)),
        teardown=(Call("destroy", {}, f"{A2A}:1127"),),
        deviations=("num_max_tokens_per_rank 8 (vLLM: max_num_batched_tokens) and hidden 256",
                    "group: the default (gloo) group, vLLM's device (NCCL) group"),
    )


DEEPEP_V2 = deepep_v2()
SEQUENCES = (HIGH_THROUGHPUT, LOW_LATENCY, low_latency(use_fp8=True), low_latency(use_fp8=True, ue8m0=True),
             DEEPEP_V2, deepep_v2(use_cudagraph=False), deepep_v2(use_fp8=True),
             deepep_v2(use_cudagraph=False, use_fp8=True))
