"""A stock torch.distributed program on gloo (CPU), unchanged from what
torchrun runs: init_process_group("gloo") with the default env://, an
all-reduce, an all-gather and a barrier, checked.

  torchrun --nproc_per_node 4 scripts/anchors/torch_gloo.py
  cohort run -n 4 -- scripts/anchors/torch_gloo.py

Prints, on rank 0, `startup_s`: process start to the first all-reduce
finished (interpreter, import torch and the rendezvous). With FAIL_RANK=R,
rank R raises after the first all-reduce (for the launcher's failure
summary).
"""
import os
import sys
import time

T0 = time.time()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert rank == int(os.environ["RANK"]) and world == int(os.environ["WORLD_SIZE"])
    x = torch.ones(4)
    dist.all_reduce(x)
    if os.environ.get("FAIL_RANK") == str(rank):
        raise RuntimeError(f"rank {rank} failing on purpose (FAIL_RANK)")
    startup = time.time() - T0
    assert torch.equal(x, torch.full((4,), float(world))), x
    out = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(out, torch.tensor([float(rank)]))
    assert [int(t.item()) for t in out] == list(range(world)), out
    dist.barrier()
    if rank == 0:
        print(f"gloo: world {world}, MASTER_ADDR={os.environ['MASTER_ADDR']} MASTER_PORT={os.environ['MASTER_PORT']} "
              f"LOCAL_WORLD_SIZE={os.environ.get('LOCAL_WORLD_SIZE')} OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")
        print(f"startup_s {startup:.3f} ok True")
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
