"""The optional engine tier's probe (scripts/engines_tier.sh runs it in the engines' virtual environment with
TRITON_EP_AS_DEEP_EP=1): import each pinned engine's DeepEP classes, print one line per module, "OK <names>" or the
exact error, and a last line "SUMMARY ok=N failed=M". Exit status 0 when the probe ran (whatever imported)."""
import importlib
import traceback

TARGETS = [
    ("vllm.model_executor.layers.fused_moe.prepare_finalize.deepep_ht", ["DeepEPHTPrepareAndFinalize"]),
    ("vllm.model_executor.layers.fused_moe.prepare_finalize.deepep_ll", ["DeepEPLLPrepareAndFinalize"]),
    ("vllm.model_executor.layers.fused_moe.prepare_finalize.deepep_v2", ["DeepEPV2PrepareAndFinalize"]),
    ("vllm.distributed.device_communicators.all2all", ["DeepEPHTAll2AllManager", "DeepEPLLAll2AllManager",
                                                       "DeepEPV2All2AllManager"]),
    ("vllm.utils.import_utils", ["deep_ep_v2_unavailable_reason"]),
    ("sglang.srt.layers.moe.token_dispatcher.deepep", ["DeepEPDispatcher", "DeepEPBuffer", "use_deepep"]),
    ("sglang.srt.layers.moe.token_dispatcher.deepep_v2", ["DeepEPv2Dispatcher", "use_deepep_v2"]),
]


def main() -> int:
    import deep_ep
    print("deep_ep:", deep_ep.__file__)
    ok = failed = 0
    for mod, names in TARGETS:
        try:
            m = importlib.import_module(mod)
            got = {n: getattr(m, n) for n in names}
            extra = "".join(f" {n}={got[n]}" for n in ("use_deepep", "use_deepep_v2") if n in got)
            if "deep_ep_v2_unavailable_reason" in got:       # vLLM's deepep_v2 gate (NCCL >= 2.30.4 at run time)
                extra += f" deepep_v2 unavailable: {got['deep_ep_v2_unavailable_reason']()!r}"
            print(f"{mod}: OK {', '.join(names)}{extra}")
            ok += 1
        except BaseException as ex:   # noqa: BLE001 - reported
            tb = traceback.extract_tb(ex.__traceback__)[-1]
            print(f"{mod}: {type(ex).__name__}: {ex} (at {tb.filename}:{tb.lineno})")
            failed += 1
    print(f"SUMMARY ok={ok} failed={failed}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
