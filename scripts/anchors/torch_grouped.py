# The anchor for grouped_bench: 256 all-reduces of 4 KiB (f32 sum) in
# torch.distributed, one rank on NCCL: separate calls, one coalesced call
# (_coalescing_manager, PyTorch's grouped call) and one fused buffer (the
# tensors copied into one, all-reduced once, copied back).
# Run on a GPU machine: `python3 scripts/anchors/torch_grouped.py`.
import os, time, torch, torch.distributed as dist
os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29533")
dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda:0"))
ts = [torch.ones(1024, device="cuda") for _ in range(256)]
flat = torch.ones(256 * 1024, device="cuda")
def timeit(fn, n=20):
    for _ in range(3): fn()
    torch.cuda.synchronize(); xs = []
    for _ in range(n):
        t = time.perf_counter(); fn(); torch.cuda.synchronize(); xs.append(time.perf_counter() - t)
    xs.sort(); return xs[len(xs) // 2] * 1e6
def separate():
    for t in ts: dist.all_reduce(t)
def coalesced():
    with dist._coalescing_manager(async_ops=True) as cm:
        for t in ts: dist.all_reduce(t)
    cm.wait()
def fused():
    torch.cat(ts, out=flat); dist.all_reduce(flat)
    for i, t in enumerate(ts): t.copy_(flat[i * 1024:(i + 1) * 1024])
def fused_foreach():
    torch.cat(ts, out=flat); dist.all_reduce(flat)
    torch._foreach_copy_(ts, list(flat.split(1024)))
for name, fn in [("separate", separate), ("coalesced", coalesced), ("fused cat+copy", fused), ("fused cat+foreach_copy", fused_foreach)]:
    print(f"torch {name:24s} {timeit(fn):9.1f} us")
dist.destroy_process_group()
