"""A stock PyTorch DDP program on NCCL, unchanged from what torchrun runs:
init_process_group("nccl") with the default env:// (rank 0 serves PyTorch's
own TCPStore on MASTER_ADDR:MASTER_PORT), one GPU per rank from LOCAL_RANK,
a few training steps of a small MLP, then a check that every rank holds the
same weights.

  torchrun --nproc_per_node N scripts/anchors/torch_ddp_nccl.py [steps]
  cohort run -n gpu -- scripts/anchors/torch_ddp_nccl.py [steps]

Prints, on rank 0, `startup_s` (process start to the first all-reduce
finished: interpreter, CUDA, NCCL and the rendezvous) and `train_s`.
"""
import os
import sys
import time

T0 = time.time()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402


def main():
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 50
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 1)).cuda()
    ddp = DDP(model, device_ids=[local_rank])
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    probe = torch.ones(1, device="cuda")
    dist.all_reduce(probe)
    torch.cuda.synchronize()
    startup = time.time() - T0
    assert probe.item() == world, f"all_reduce of ones gave {probe.item()}, not {world}"
    g = torch.Generator(device="cuda").manual_seed(1000 + rank)
    t = time.time()
    for _ in range(steps):
        x = torch.randn(64, 256, device="cuda", generator=g)
        loss = ddp(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.cuda.synchronize()
    train = time.time() - t
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    first = flat.clone()
    dist.broadcast(first, 0)
    same = torch.equal(flat, first)
    ok = torch.tensor([1 if same else 0], device="cuda")
    dist.all_reduce(ok)
    if rank == 0:
        print(f"ddp nccl: world {world}, env MASTER_PORT={os.environ.get('MASTER_PORT')} "
              f"GROUP_RANK={os.environ.get('GROUP_RANK')} TORCHELASTIC_RUN_ID={os.environ.get('TORCHELASTIC_RUN_ID')} "
              f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")
        print(f"startup_s {startup:.3f} train_s {train:.3f} replicas_identical {int(ok.item()) == world}")
    dist.destroy_process_group()
    if int(ok.item()) != world:
        sys.exit(1)


if __name__ == "__main__":
    main()
