"""Checks, without torch, what a torch.distributed program needs from its
launcher: torchrun's variables are set and consistent, and rank 0 can listen
on MASTER_ADDR:MASTER_PORT (where PyTorch's TCPStore listens) while cohort's
own store is elsewhere (COHORT_STORE_ADDR, when launched by cohort). The
other ranks connect to rank 0 there, as TCPStore clients do. Under torchrun
(TORCHELASTIC_USE_AGENT_STORE=True) the agent's own store holds the port and
PyTorch connects to it, so the bind is skipped there.

  cohort run -n 4 -- scripts/anchors/env_check.py
  torchrun --nproc_per_node 4 scripts/anchors/env_check.py
"""
import os
import socket
import sys
import time

NEEDED = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
          "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
          "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS"]


def main():
    missing = [v for v in NEEDED if v not in os.environ]
    if missing:
        print(f"missing: {' '.join(missing)}")
        return 1
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    assert 0 <= rank < world and 0 <= local < local_world, (rank, world, local, local_world)
    assert os.environ["ROLE_RANK"] == str(rank), os.environ["ROLE_RANK"]
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = os.environ.get("COHORT_STORE_ADDR")
    if store is not None:
        assert store != f"{addr}:{port}", f"cohort's store sits on MASTER_PORT: {store}"
    if local_world > 1:
        assert os.environ.get("OMP_NUM_THREADS"), "OMP_NUM_THREADS unset with several ranks on a node"
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's agent already serves its own TCPStore on MASTER_PORT and
        # PyTorch connects to it there: nothing else may bind that port.
        print(f"rank {rank}/{world}: environment ok, MASTER_PORT {port} held by the launcher's agent store, "
              f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, python {sys.executable}")
        return 0
    if rank == 0:
        server = socket.create_server((addr, port))
        for _ in range(world - 1):
            conn, _ = server.accept()
            conn.sendall(b"ok")
            conn.close()
        server.close()
    else:
        end = time.time() + 30
        while True:
            try:
                conn = socket.create_connection((addr, port), timeout=5)
                break
            except OSError:
                if time.time() > end:
                    raise
                time.sleep(0.05)
        assert conn.recv(2) == b"ok"
        conn.close()
    print(f"rank {rank}/{world}: environment ok, MASTER_PORT {port} free for the program, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, python {sys.executable}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
