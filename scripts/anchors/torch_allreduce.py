"""torch.distributed (NCCL) all-reduce timing, printed like nccl-tests, as
the PyTorch column beside cohort's all_reduce_bench / nccl_bench.

Run on a GPU machine: torchrun --nproc_per_node N scripts/anchors/torch_allreduce.py [min_bytes max_bytes factor]
"""
import os
import sys
import time

import torch
import torch.distributed as dist


def main():
    lo = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    hi = int(sys.argv[2]) if len(sys.argv) > 2 else 1 << 30
    factor = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    rank = int(os.environ["RANK"])
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    n = dist.get_world_size()
    if rank == 0:
        print(f"# torch {torch.__version__} all_reduce float sum, {n} ranks, NCCL {torch.cuda.nccl.version()}")
        print("#       size   time(us)   algbw   busbw")
    size = lo
    while size <= hi:
        x = torch.ones(max(size // 4, 1), device="cuda")
        for _ in range(5):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        iters = 20
        t = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t) / iters
        algbw = x.numel() * 4 / dt / 1e9
        if rank == 0:
            print(f"{x.numel() * 4:12d} {dt * 1e6:10.2f} {algbw:7.2f} {algbw * 2 * (n - 1) / n:7.2f}", flush=True)
        size *= factor
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
