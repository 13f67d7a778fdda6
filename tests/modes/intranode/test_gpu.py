"""GPU tests (marker ``gpu``): the compiled kernels and CUDA IPC between processes sharing one GPU."""
import pytest
import torch

from tests.cases import mp as mp_cases
from tests.cases.helpers import check_round_trip_virtual
from triton_ep.testing import run_ranks

pytestmark = pytest.mark.gpu


def _ok(results):
    bad = [r for r in results if not isinstance(r, int)]
    assert not bad, "\n".join(getattr(b, "traceback", repr(b)) for b in bad)
    return results


@pytest.mark.parametrize("R,Ts,nbytes", [(1, [33], 1 << 20), (4, [40, 0, 17, 65], 1 << 20), (3, [50, 70, 9], 2048)])
def test_virtual_round_trip_cuda(R, Ts, nbytes):
    """Compiled kernels, ranks simulated in one process on cuda (2048 bytes forces several rounds)."""
    check_round_trip_virtual(R=R, E=8 * R, K=4, H=128, Ts=Ts, seed=R, num_nvl_bytes=nbytes, device="cuda")


@pytest.mark.parametrize("R", [2, 4])
def test_processes_share_one_gpu(R):
    """Real processes on one GPU (gloo bootstrap, CUDA IPC buffers): bitwise against the reference."""
    _ok(run_ranks(mp_cases.round_trip, R, 7, 8 * R, 8, 256, [64 + 13 * r for r in range(R)], 1 << 20, False, "cuda"))


def test_cached_calls_replay_their_plan_gpu():
    """modes/intranode_replay.py with compiled kernels (3 processes sharing the GPU): cached dispatches and combines
    replay the compiled launch of their handle's last call, bit for bit against the reference; every case that
    takes the general path or the bound launch (an x off the plan's 16-byte alignment) as on CPU."""
    out = run_ranks(mp_cases.replayed_calls, 3, 4, "cuda")
    bad = [r for r in out if hasattr(r, "traceback")]
    assert not bad, "\n".join(b.traceback or b.message for b in bad)
    for rank, (seen, err) in enumerate(out):
        assert seen == [0, 6, 7, 8, 10 if rank == 1 else 11, 11 if rank == 1 else 12], (rank, seen)
        assert err == ("ValueError" if rank == 1 else "EPRemoteError"), (rank, err)


def test_processes_fp8_and_rounds_gpu():
    _ok(run_ranks(mp_cases.round_trip, 2, 8, 16, 4, 256, [100, 3], 8192, True, "cuda"))


@pytest.mark.xdist_group("big_memory")
def test_large_rows_64bit_offsets():
    """One rank, rows x H past 2^31 elements in the receive buffer: offsets must be 64-bit."""
    import triton_ep
    T, H, E = 300_000, 7168 + 128, 8   # 300k x 7296 = 2.19e9 elements > 2^31
    x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    idx = torch.zeros(T, 1, dtype=torch.int64, device="cuda")
    from triton_ep.transport.ipc import LocalWorld
    world = LocalWorld(1, T * H * 2 + (1 << 20), device="cuda")
    buf = triton_ep.Buffer(world.comm(0))
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    from triton_ep.testing import lockstep, steps
    (res,) = lockstep([steps(buf, "dispatch", x=x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                             num_tokens_per_expert=per_expert, topk_idx=idx)])
    if isinstance(res, Exception):
        raise res
    recv_x = res[0]
    assert torch.equal(recv_x[-5:], x[-5:]) and torch.equal(recv_x[:5], x[:5])
    assert torch.equal(res[4][3][-3:].cpu(), torch.arange(T - 3, T, dtype=torch.int32))


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_one_rank_per_gpu_nccl_bootstrap():
    """Each rank on its own GPU, NCCL group: peer buffers on other GPUs (CUDA IPC plus peer access)."""
    _ok(run_ranks(mp_cases.round_trip, 2, 9, 16, 8, 512, [300, 77], 1 << 20, False, "cuda:rank", backend="nccl"))


@pytest.mark.parametrize("name", ["default_device_cuda", "default_dtype_bfloat16", "deterministic_algorithms",
                                  "side_stream", "inference_mode"])
def test_ambient_state_cuda(name):
    """Invariant 12 on GPU: a default device 'cuda' (DeepEP's tests set it), a default dtype, deterministic
    algorithms (NaN-filled ``torch.empty``), inference mode or a non-default current stream change no bit."""
    import contextlib
    from test_ambient import AMBIENT, _default_device, check_ambient

    @contextlib.contextmanager
    def side_stream():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            yield
        torch.cuda.current_stream().wait_stream(s)

    ctx = {"default_device_cuda": lambda: _default_device("cuda"), "side_stream": side_stream}.get(name) or AMBIENT[name]
    check_ambient(ctx, name, "cuda")


def test_processes_default_device_cuda_float32():
    """Two processes on one GPU with ``torch.set_default_device('cuda')`` before the Buffer is built (the
    DeepEP test that crashed with 'cannot pin torch.cuda.LongTensor'), float32 payload."""
    out = run_ranks(mp_cases.ambient_float32, 2, "cuda", "cuda")
    assert out == ["ok", "ok"], out
