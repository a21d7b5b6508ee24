"""torch.distributed (NCCL) timings of nccl-tests' five collectives, printed
like nccl-tests, as the PyTorch column beside cohort's nccl_bench.

Run on a GPU machine:
  torchrun --nproc_per_node N scripts/anchors/torch_collectives.py [min_bytes max_bytes factor collectives]
where collectives is a comma list of all_reduce, all_gather, reduce_scatter,
broadcast, all_to_all (default: all five). Sizes are nccl-tests': the largest
buffer (all-gather's output, reduce-scatter's input). Float, sum, out of
place, root 0; busbw factors as nccl-tests'.
"""
import os
import sys
import time

import torch
import torch.distributed as dist

FIVE = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"]


def factor(name, n):
    if name == "all_reduce":
        return 2 * (n - 1) / n
    if name == "broadcast":
        return 1.0
    return (n - 1) / n


def op(name, n, size):
    """A closure running one collective of `size` bytes, and the size used."""
    count = max(size // 4, 1)
    if name in ("all_gather", "reduce_scatter", "all_to_all"):
        count = max(count // n, 1) * n
    block = count // n
    if name == "all_reduce":
        x = torch.ones(count, device="cuda")
        return (lambda: dist.all_reduce(x)), count * 4
    if name == "broadcast":
        x = torch.ones(count, device="cuda")
        return (lambda: dist.broadcast(x, 0)), count * 4
    if name == "all_gather":
        src, dst = torch.ones(block, device="cuda"), torch.empty(count, device="cuda")
        return (lambda: dist.all_gather_into_tensor(dst, src)), count * 4
    if name == "reduce_scatter":
        src, dst = torch.ones(count, device="cuda"), torch.empty(block, device="cuda")
        return (lambda: dist.reduce_scatter_tensor(dst, src)), count * 4
    src, dst = torch.ones(count, device="cuda"), torch.empty(count, device="cuda")
    return (lambda: dist.all_to_all_single(dst, src)), count * 4


def main():
    lo = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    hi = int(sys.argv[2]) if len(sys.argv) > 2 else 1 << 30
    step = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    names = sys.argv[4].split(",") if len(sys.argv) > 4 else FIVE
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    n = dist.get_world_size()
    for name in names:
        if rank == 0:
            print(f"# torch {torch.__version__} {name} float sum, {n} ranks, NCCL {torch.cuda.nccl.version()}")
            print("#       size   time(us)   algbw   busbw")
        size = lo
        while size <= hi:
            run, used = op(name, n, size)
            for _ in range(5):
                run()
            torch.cuda.synchronize()
            iters = 20
            t = time.perf_counter()
            for _ in range(iters):
                run()
            torch.cuda.synchronize()
            dt = (time.perf_counter() - t) / iters
            algbw = used / dt / 1e9
            if rank == 0:
                print(f"{used:12d} {dt * 1e6:10.2f} {algbw:7.2f} {algbw * factor(name, n):7.2f}", flush=True)
            size *= step
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
