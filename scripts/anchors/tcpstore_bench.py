"""PyTorch's TCPStore (libuv server) doing the rendezvous key pattern of
examples/rendezvous_bench.rs: N simulated ranks, each a thread with its own
client, publish an entry (append to a directory), pass a barrier, read the
job key and the whole directory (multi_get), and pass a second barrier.
TCPStore has no barrier; each one is torch's own store-based pattern: add
to a counter, the last to arrive sets a key, everyone waits for it.

Prints, per count, the time from the threads' release until all connected,
published, joined and were ready, in the same format as rendezvous_bench.

Run: python3 scripts/anchors/tcpstore_bench.py [counts...]   (default 1024 4096)
"""

import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

TIMEOUT = timedelta(seconds=300)


def barrier(store, name, n):
    if store.add(f"{name}/count", 1) == n:
        store.set(f"{name}/done", b"1")
    store.wait([f"{name}/done"])


def simulate(n):
    server = dist.TCPStore("127.0.0.1", 0, None, True, TIMEOUT, wait_for_workers=False, use_libuv=True)
    port = server.port
    go = threading.Barrier(n + 1)
    start = [0.0]
    steps = [None] * n
    errors = []

    def rank(r):
        try:
            go.wait()
            t0 = start[0]
            store = dist.TCPStore("127.0.0.1", port, None, False, TIMEOUT, use_libuv=True)
            connected = time.perf_counter() - t0
            if r == 0:
                store.set("c/1/job", b"0123456789abcdef 00112233445566778899aabbccddeeff")
            line = f"{r}\thost-{r // 8}/boot-id-0000-1111-2222/0\t127.0.0.1:{20000 + r}\t1\n"
            store.append("c/1/peers", line.encode())
            published = time.perf_counter() - t0
            barrier(store, "c/1/joined", n)
            joined = time.perf_counter() - t0
            job, listing = store.multi_get(["c/1/job", "c/1/peers"])
            lines = [l for l in listing.split(b"\n") if l]
            assert len(lines) == n, f"rank {r} read {len(lines)} entries of {n}"
            barrier(store, "c/1/ready", n)
            ready = time.perf_counter() - t0
            steps[r] = (connected, published, joined, ready, store)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"rank {r}: {e}")

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    start[0] = time.perf_counter()
    go.wait()
    for t in threads:
        t.join()
    if errors:
        raise SystemExit(f"{len(errors)} ranks failed, first: {errors[0]}")
    last = [max(s[i] for s in steps) for i in range(4)]
    del steps
    return last


def main():
    # Both ends of every connection live in this process: raise the soft
    # descriptor limit to the hard one.
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    counts = [int(a) for a in sys.argv[1:]] or [1024, 4096]
    print("tcpstore_bench: PyTorch TCPStore (libuv), simulated ranks as threads")
    print(f"{'ranks':>7} {'connected':>12} {'published':>12} {'joined':>12} {'ready':>12}")
    for n in counts:
        c, p, j, r = simulate(n)
        print(f"{n:>7} {c * 1e3:>10.1f}ms {p * 1e3:>10.1f}ms {j * 1e3:>10.1f}ms {r * 1e3:>10.1f}ms", flush=True)


if __name__ == "__main__":
    main()
