#!/usr/bin/env python3
"""PyTorch anchor for examples/cuda_runtime_bench.rs: the same figures timed
with PyTorch on the same GPU, for a second column.

Run: python3 scripts/anchors/torch_runtime.py
"""
import statistics
import time

import torch

ROUNDS = 7
MIB = 1 << 20


def median(fn):
    fn()
    return statistics.median(fn() for _ in range(ROUNDS))


def main():
    dev = torch.device("cuda:0")
    props = torch.cuda.get_device_properties(dev)
    print(f"torch {torch.__version__} on {props.name}")
    x = torch.ones(256, device=dev)
    rows = []

    n = 20_000

    def launches():
        t = time.perf_counter()
        for _ in range(n):
            x.mul_(1.0)
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / n * 1e6

    rows.append(("launch enqueue per kernel", median(launches), "µs"))

    four = torch.tensor([7], dtype=torch.int32, device=dev)
    m = 2_000

    def read4():
        t = time.perf_counter()
        for _ in range(m):
            four.cpu()
        return (time.perf_counter() - t) / m * 1e6

    rows.append(("4-byte read round trip", median(read4), "µs"))

    def alloc():
        t = time.perf_counter()
        for _ in range(n):
            del_me = torch.empty(MIB, dtype=torch.uint8, device=dev)
            del del_me
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / n * 1e6

    rows.append(("alloc+free 1 MiB (caching allocator)", median(alloc), "µs"))

    size = 256 * MIB
    host = torch.empty(size, dtype=torch.uint8).pin_memory()
    host.copy_(torch.arange(size, dtype=torch.int64).remainder_(251).to(torch.uint8))
    big = torch.empty(size, dtype=torch.uint8, device=dev)

    def upload():
        torch.cuda.synchronize()
        t = time.perf_counter()
        big.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        return size / (time.perf_counter() - t) / 1e9

    def read():
        torch.cuda.synchronize()
        t = time.perf_counter()
        host.copy_(big, non_blocking=True)
        torch.cuda.synchronize()
        return size / (time.perf_counter() - t) / 1e9

    def read_new():
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = big.cpu()
        e = time.perf_counter() - t
        del out
        return size / e / 1e9

    rows.append(("256 MiB upload (pinned)", median(upload), "GB/s"))
    rows.append(("256 MiB read (into pinned)", median(read), "GB/s"))
    rows.append(("256 MiB read (.cpu(), pageable)", median(read_new), "GB/s"))

    k, r = 100, 200
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            x.mul_(1.0)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(k):
            x.mul_(1.0)

    def replay():
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(r):
            g.replay()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / (r * k) * 1e6

    rows.append(("graph replay per kernel", median(replay), "µs"))

    print(f"{'measure':<40} {'torch':>10}")
    for what, value, unit in rows:
        print(f"{what:<40} {value:>8.3f} {unit}")


if __name__ == "__main__":
    main()
