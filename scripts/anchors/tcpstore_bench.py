"""PyTorch's TCPStore (libuv backend) as the anchor of examples/rendezvous_bench.rs.

`--serve` starts a TCPStore server on a free loopback port, prints the port,
and serves until stdin closes. rendezvous_bench starts it, one fresh server
per count, and drives it with the same simulated ranks (non-blocking
sockets on a few threads) that it runs against cohort's store, speaking
TCPStore's own wire format, so that only the servers differ:

    cargo build --release --example rendezvous_bench
    target/release/examples/rendezvous_bench \
        --tcpstore "python3 scripts/anchors/tcpstore_bench.py --serve" 1024 4096 16384

Without `--serve` it prints the torch version and whether the libuv backend
is there.
"""

import sys
from datetime import timedelta

import torch
import torch.distributed as dist


def serve():
    sys.stdin.readline()  # the bench's secret line: TCPStore has none
    server = dist.TCPStore(
        "127.0.0.1", 0, None, True, timedelta(seconds=300), wait_for_workers=False, use_libuv=True
    )
    print(server.port, flush=True)
    while sys.stdin.readline():
        pass
    del server


def main():
    if "--serve" in sys.argv[1:]:
        serve()
        return
    server = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False, use_libuv=True)
    print(f"torch {torch.__version__}; TCPStore libuv backend: {getattr(server, 'libuvBackend', 'unknown')}")


if __name__ == "__main__":
    main()
