# The node relay under a rank that never reads its answers, as a rank of
#   cohort run -n 2 scripts/relay_probe.py MIB GETS
# Rank 0 sets a value of MIB MiB, sends GETS gets of it through its relay
# socket (COHORT_STORE_FD, the store's plain protocol) and never reads
# them; rank 1 times 200 small round trips meanwhile and prints the
# slowest. Rank 0 then prints the launcher's peak memory (VmHWM).
import os, socket, struct, sys, time
mib, gets = int(sys.argv[1]), int(sys.argv[2])
rank = int(os.environ["RANK"])
fd = int(os.environ["COHORT_STORE_FD"].split(",")[0])
s = socket.socket(fileno=os.dup(fd))
def frame(body): return struct.pack("<I", len(body)) + body
def bstr(b): return struct.pack("<I", len(b)) + b
def read_answer():
    n = struct.unpack("<I", s.recv(4, socket.MSG_WAITALL))[0]
    got = 0
    while got < n:
        chunk = s.recv(min(n - got, 1 << 20))
        if not chunk: raise SystemExit("closed")
        got += len(chunk)
def rtt(body):
    t = time.perf_counter(); s.sendall(frame(body)); read_answer(); return time.perf_counter() - t
key = b"probe/x"
if rank == 0:
    rtt(b"\x01" + bstr(key) + bstr(b"v" * (mib << 20)))
    get = frame(b"\x02" + bstr(key))
    s.setblocking(False)
    sent = 0
    deadline = time.time() + 30
    while sent < gets and time.time() < deadline:
        try:
            n = s.send(get)
        except BlockingIOError:
            time.sleep(0.01); continue
        if n < len(get):
            s.setblocking(True); s.sendall(get[n:]); s.setblocking(False)
        sent += 1
    s.setblocking(True)
    time.sleep(4)
    status = open(f"/proc/{os.getppid()}/status").read()
    hwm = [l for l in status.splitlines() if l.startswith("VmHWM")][0]
    print(f"rank 0: sent {sent} gets of {mib} MiB unread; launcher {hwm.split(':')[1].strip()}", flush=True)
else:
    time.sleep(1)
    worst = max(rtt(b"\x01" + bstr(b"probe/y") + bstr(b"1")) for _ in range(200))
    print(f"rank 1: slowest of 200 round trips {worst*1e3:.1f} ms", flush=True)
