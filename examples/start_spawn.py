"""Ranks started by torch.multiprocessing (no torchrun): one per GPU over NCCL; on CPU, or ranks sharing a GPU,
over gloo.

    python examples/start_spawn.py 2      # the number of ranks (default 2)
"""
import argparse
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import triton_ep as deep_ep   # on CPU it sets TRITON_INTERPRET=1 itself (Triton's interpreter)
from triton_ep.argtypes import positive_int


def rank_main(rank: int, R: int, port: int) -> None:
    if torch.cuda.is_available():
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "nccl" if R <= torch.cuda.device_count() else "gloo"   # NCCL refuses 2 ranks on 1 GPU
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=R)
    group = dist.group.WORLD

    # A tiny round trip: 8 tokens of 128 bf16 values, each to 2 of 4 * R experts; experts return rows unchanged.
    T, hidden, E = 8, 128, 4 * R
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(T, hidden, generator=g).to(device, torch.bfloat16)
    topk_idx = torch.rand(T, E, generator=g).topk(2).indices.to(device, deep_ep.topk_idx_t)
    topk_weights = torch.rand(T, 2, generator=g).to(device)

    num_nvl_bytes = max(deep_ep.Buffer.get_dispatch_config(R).get_nvl_buffer_size_hint(hidden * 2, R),
                        deep_ep.Buffer.get_combine_config(R).get_nvl_buffer_size_hint(hidden * 2, R))
    buffer = deep_ep.Buffer(group, num_nvl_bytes)
    num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, _ = \
        buffer.get_dispatch_layout(topk_idx, E)
    recv_x, recv_topk_idx, recv_topk_weights, _, handle, _ = buffer.dispatch(
        x, num_tokens_per_rank=num_tokens_per_rank, num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
        is_token_in_rank=is_token_in_rank, num_tokens_per_expert=num_tokens_per_expert, topk_idx=topk_idx,
        topk_weights=topk_weights)
    combined_x, _, _ = buffer.combine(recv_x, handle)
    buffer.destroy()

    # combine sums what comes back from each rank a token went to: here x times that number of ranks
    ok = torch.equal(combined_x, (x.float() * is_token_in_rank.sum(1, keepdim=True)).to(torch.bfloat16))
    print(f"rank {rank}/{R} ({backend}, {device}): sent {T} tokens, received {recv_x.shape[0]}, "
          f"round trip {'correct' if ok else 'WRONG'}\n", end="", flush=True)   # one write: ranks' lines never mix
    dist.destroy_process_group()
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="a dispatch + combine round trip on ranks started by spawn")
    p.add_argument("ranks", nargs="?", type=positive_int, default=2, help="the number of ranks (default 2)")
    R = p.parse_args().ranks   # (argparse refuses 0 or text: exit 2, before any process starts)
    with socket.socket() as s:   # a free port for the ranks' rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank_main, args=(R, port), nprocs=R)   # start method "spawn"; raises if a rank fails
