"""PyTorch DDP over NCCL on the model of cohort's ddp_bench: the baseline
its step times are printed against.

The same model (depth Linear(width, width) layers, ReLU between, the last
linear), fp32 (TF32 off, PyTorch's default for matmul), MSE against a
teacher network of the same shape, SGD with momentum 0.9, the same bucket
cap (first bucket 1 MiB, as DDP's default), the same samples per GPU. One
process per GPU:

  torchrun --standalone --nproc_per_node N scripts/anchors/torch_ddp.py \
      [--width 4096] [--depth 8] [--batch 512] [--steps 20] [--warmup 5] [--bucket-cap-mb 25]

Rank 0 prints one line, `TORCH_DDP {json}`: GPUs, the mean step time
(forward, backward with DDP's overlapped bucket all-reduces, optimizer step)
and the same step under no_sync (compute alone), in milliseconds.
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def mlp(width, depth):
    layers = []
    for i in range(depth):
        layers.append(torch.nn.Linear(width, width))
        if i + 1 < depth:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def timed(step, steps, warmup):
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / steps


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--batch", type=int, default=512, help="samples per GPU per step")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    a = p.parse_args()

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local)

    torch.manual_seed(1)
    teacher = mlp(a.width, a.depth).to(dev)
    torch.manual_seed(2)
    model = DDP(mlp(a.width, a.depth).to(dev), device_ids=[local], bucket_cap_mb=a.bucket_cap_mb)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    g = torch.Generator(device=dev).manual_seed(100 + rank)
    batches = []
    with torch.no_grad():
        for _ in range(2):
            x = torch.rand(a.batch, a.width, device=dev, generator=g) * 2 - 1
            batches.append((x, teacher(x)))
    loss_fn = torch.nn.MSELoss()
    state = {"i": 0}

    def step(sync=True):
        x, y = batches[state["i"] % 2]
        state["i"] += 1
        opt.zero_grad(set_to_none=False)
        if sync:
            loss_fn(model(x), y).backward()
        else:
            with model.no_sync():
                loss_fn(model(x), y).backward()
        opt.step()

    step_ms = timed(step, a.steps, a.warmup)
    compute_ms = timed(lambda: step(False), a.steps, a.warmup)
    dist.barrier()
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        print("TORCH_DDP " + json.dumps({"gpus": world, "params": params, "batch": a.batch, "step_ms": step_ms,
                                         "compute_ms": compute_ms, "torch": torch.__version__}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
