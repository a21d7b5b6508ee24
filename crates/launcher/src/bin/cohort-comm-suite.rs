//! The collective suite across processes: every collective of a
//! `Communicator`, for several element types, operators, roots and sizes
//! (small ones take recursive halving-doubling, large ones the ring),
//! checked against the host reference. Run under `cohort run`, `mpirun` or
//! `srun` (any number of ranks; CPU devices, or CUDA ones with `--backend
//! cuda`, which take NCCL where libnccl loads):
//!
//! ```text
//! cohort run -n 4 -- cohort-comm-suite                  # the suite
//! cohort run -n gpu -- cohort-comm-suite --backend cuda full   # every collective × type × op, 0 B to 1 GiB
//! cohort run -n 2 -- cohort-comm-suite full 64MiB       # the same, up to 64 MiB (sizes: 4096, 4K, 64MiB, 1GiB)
//! cohort run -n 4 -- cohort-comm-suite --devices 2      # two devices per rank
//! cohort run -n 1 -- cohort-comm-suite --backend cuda   # GPU LOCAL_RANK × devices + l
//! mpirun -n 4 cohort-comm-suite                         # no launcher
//! cohort run -n 8 -- cohort-comm-suite barrier          # join, barrier, exit
//! cohort run -n 4 -- cohort-comm-suite crash 2          # rank 2 dies inside an all_reduce
//! cohort run -n 4 -- cohort-comm-suite mismatch 1       # rank 1 calls broadcast, the rest all_reduce
//! COHORT_TIMEOUT=2 cohort run -n 4 -- cohort-comm-suite skip 3   # rank 3 never calls
//! cohort run -n 4 -- cohort-comm-suite latency 64 5000 # mean of 5000 all-reduces of 64 bytes
//! cohort run -n 4 -- cohort-comm-suite latency 16777216 20 broadcast   # (or reduce)
//! cohort run -n 4 -- cohort-comm-suite loop             # all-reduces until something fails
//! cohort run -n 4 -- cohort-comm-suite kill9 2          # rank 2 SIGKILLs itself inside an all-reduce
//! cohort run -n 4 -- cohort-comm-suite stop 2           # rank 2 SIGSTOPs itself inside the loop
//! cohort run -n 4 -- cohort-comm-suite slow 2 5         # rank 2 comes 5 s late (must pass)
//! cohort run -n 4 -- cohort-comm-suite desync dtype 1   # rank 1 differs: kind|count|dtype|op|root
//! cohort run -n 4 -- cohort-comm-suite secret 1         # rank 1 brings a wrong job secret
//! cohort run -n 2 -- cohort-comm-suite leave 1          # rank 1 exits 0 at once, rank 0 all-reduces
//! cohort run -n 2 -- cohort-comm-suite --set-env RANK=7 barrier   # a malformed environment
//! ```
//!
//! `--set-env K=V` and `--unset-env K` change this process's environment
//! before it joins the job (fault injection); `--rank-env R K=V` sets it on
//! rank R only; `--rank-mem-limit R MIB` lets rank R map only MIB MiB more
//! than it has (RLIMIT_AS), so a large shared-memory ring fails to map.
//!
//! `--pid-dir DIR` writes `DIR/rank<R>.pid` first (for tests that check no
//! process is left). Exits 0 when every check passed; prints `rank R: error: ...` and exits 1
//! on the first failure; an argument it cannot read (a size that is not one,
//! a rank that is not a number) is `error: ...` and exit 2, before joining.

use std::process::ExitCode;
use std::time::Instant;

use cohort_comm::op::Collective;
use cohort_comm::verify::{count_wrong, expected, pattern};
use cohort_comm::{Communicator, DType, ReduceOp};
use cohort_runtime::{Client, CpuRuntime, CudaRuntime, Handle, Runtime};

/// Fault-injection modes.
mod faults {
    use std::time::Duration;

    use cohort_comm::{Communicator, DType, ReduceOp};

    fn read(comm: &Communicator, h: &cohort_runtime::Handle) -> Result<(), String> {
        comm.clients()[0].read_one(h.clone()).map(|_| ()).map_err(|e| e.to_string())
    }

    /// All-reduces of 1 MiB until one fails. `kill9`: rank `who` SIGKILLs
    /// itself from another thread while its all-reduces run; `stop`: rank
    /// `who` SIGSTOPs itself after 20 of them.
    pub fn looping(comm: &Communicator, mode: &str, who: usize) -> Result<(), String> {
        let buf = comm.clients()[0].create_from_slice(&vec![0u8; 1 << 20]);
        let bufs = vec![buf.clone(); comm.local_devices()];
        if mode == "kill9" && comm.rank() == who {
            std::thread::spawn(|| {
                std::thread::sleep(Duration::from_millis(300));
                eprintln!("killing myself with SIGKILL inside an all_reduce");
                // SAFETY: raise(3) has no memory-safety preconditions.
                unsafe { libc::raise(libc::SIGKILL) };
            });
        }
        for i in 0u64.. {
            if mode == "stop" && comm.rank() == who && i == 20 {
                eprintln!("stopping myself with SIGSTOP");
                // SAFETY: raise(3) has no memory-safety preconditions.
                unsafe { libc::raise(libc::SIGSTOP) };
            }
            comm.all_reduce_handles(&bufs, &bufs, DType::F32, ReduceOp::Sum).map_err(|e| e.to_string())?;
            read(comm, &buf)?;
        }
        Ok(())
    }

    /// Rank `who` calls the all-reduce `secs` seconds after the others.
    pub fn slow(comm: &Communicator, who: usize, secs: usize) -> Result<(), String> {
        let buf = comm.clients()[0].create_from_slice(&[0u8; 4096]);
        let bufs = vec![buf.clone(); comm.local_devices()];
        if comm.rank() == who {
            std::thread::sleep(Duration::from_secs(secs as u64));
        }
        comm.all_reduce_handles(&bufs, &bufs, DType::F32, ReduceOp::Sum).map_err(|e| e.to_string())?;
        read(comm, &buf)?;
        comm.barrier().map_err(|e| e.to_string())
    }

    /// Rank `who` leaves the job at once and exits 0 (closing its
    /// communicator) while the others call an all-reduce and wait for it.
    pub fn leave(comm: &Communicator, who: usize) -> Result<(), String> {
        if comm.rank() == who {
            println!("leaving the job early, on purpose");
            return Ok(());
        }
        let buf = comm.clients()[0].create_from_slice(&[0u8; 4096]);
        let bufs = vec![buf.clone(); comm.local_devices()];
        comm.all_reduce_handles(&bufs, &bufs, DType::F32, ReduceOp::Sum).map_err(|e| e.to_string())?;
        read(comm, &buf)
    }

    /// Every rank calls an all-reduce of 1024 f32 (sum) or, for a rooted
    /// `what`, a reduce to root 0; rank `who` changes `what`: kind
    /// (all_gather), count (512), dtype (i32), op (max) or root (1).
    pub fn desync(comm: &Communicator, what: &str, who: usize) -> Result<(), String> {
        let c = &comm.clients()[0];
        let odd = comm.rank() == who;
        let count = if odd && what == "count" { 512 } else { 1024 };
        let dtype = if odd && what == "dtype" { DType::I32 } else { DType::F32 };
        let op = if odd && what == "op" { ReduceOp::Max } else { ReduceOp::Sum };
        let buf = c.create_from_slice(&vec![0u8; count * 4]);
        let bufs = vec![buf.clone(); comm.local_devices()];
        let queued = match what {
            "root" => comm.reduce_handles(&bufs, &buf, dtype, op, usize::from(odd)),
            "kind" if odd => {
                let all = c.empty(count * 4 * comm.members());
                comm.all_gather_handles(&bufs, &vec![all; comm.local_devices()], dtype)
            }
            "kind" | "count" | "dtype" | "op" => comm.all_reduce_handles(&bufs, &bufs, dtype, op),
            other => return Err(format!("desync: unknown '{other}' (kind, count, dtype, op or root)")),
        };
        queued.map_err(|e| e.to_string())?;
        read(comm, &buf)
    }
}

/// Queues collective `op` (not send/recv) over this rank's `src` and `dst`;
/// rooted ones take the root's buffers from `root_slot`.
#[allow(clippy::too_many_arguments)]
fn queue(
    c: &Communicator,
    op: Collective,
    src: &[Handle],
    dst: &[Handle],
    dtype: DType,
    rop: ReduceOp,
    root: usize,
    root_slot: usize,
) -> Result<(), cohort_comm::CommError> {
    let work = match op {
        Collective::AllReduce => c.all_reduce_handles(src, dst, dtype, rop),
        Collective::Reduce => c.reduce_handles(src, &dst[root_slot], dtype, rop, root),
        Collective::Broadcast => c.broadcast_handles(&src[root_slot], dst, dtype, root),
        Collective::AllGather => c.all_gather_handles(src, dst, dtype),
        Collective::ReduceScatter => c.reduce_scatter_handles(src, dst, dtype, rop),
        Collective::AllToAll => c.all_to_all_handles(src, dst, dtype),
        Collective::Gather => c.gather_handles(src, &dst[root_slot], dtype, root),
        Collective::Scatter => c.scatter_handles(&src[root_slot], dst, dtype, root),
        Collective::SendRecv => unreachable!("send/recv pairs ranks; callers handle it"),
        Collective::Barrier => return c.barrier(),
    };
    work.map(drop)
}

struct Suite {
    comm: Communicator,
    checks: usize,
}

impl Suite {
    fn upload(&self, slot: usize, bytes: &[u8]) -> Handle {
        self.comm.clients()[slot].create_from_slice(bytes)
    }

    fn read(&self, slot: usize, h: &Handle) -> Result<Vec<u8>, String> {
        let bytes = self.comm.clients()[slot].read_one(h.clone()).map_err(|e| e.to_string())?;
        Ok(bytes.to_vec())
    }

    /// One collective: inputs from `pattern`, outputs checked.
    fn run(&mut self, op: Collective, dtype: DType, rop: ReduceOp, root: usize, elems: usize) -> Result<(), String> {
        let c = &self.comm;
        let (l, m) = (c.local_devices(), c.members());
        let block = elems * dtype.size();
        let in_len = match op {
            Collective::ReduceScatter | Collective::AllToAll => m * block,
            Collective::Scatter => m * block,
            _ => block,
        };
        let out_len = match op {
            Collective::AllGather | Collective::AllToAll | Collective::Gather => m * block,
            _ => block,
        };
        let inputs: Vec<Vec<u8>> = (0..m).map(|member| pattern(dtype, member, in_len)).collect();
        let me = |slot: usize| c.rank() * l + slot;
        let src: Vec<Handle> = (0..l).map(|s| self.upload(s, &inputs[me(s)])).collect();
        let dst: Vec<Handle> = (0..l).map(|s| self.comm.clients()[s].empty(out_len)).collect();
        let root_slot = if root / l == c.rank() { root % l } else { 0 };
        let e = |r: Result<(), cohort_comm::CommError>| r.map_err(|e| e.to_string());
        match op {
            Collective::SendRecv => {
                // A ring of ranks: send to the next, receive from the previous
                // (even ranks send first, so large messages cannot deadlock).
                let (n, r) = (c.size(), c.rank());
                let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
                if r % 2 == 0 {
                    e(c.send_handle(&src[0], next, dtype).map(drop))?;
                    e(c.recv_handle(&dst[0], prev, dtype).map(drop))?;
                } else {
                    e(c.recv_handle(&dst[0], prev, dtype).map(drop))?;
                    e(c.send_handle(&src[0], next, dtype).map(drop))?;
                }
            }
            other => e(queue(c, other, &src, &dst, dtype, rop, root, root_slot))?,
        }
        let want = if op == Collective::SendRecv {
            let n = c.size();
            let per_rank: Vec<Vec<u8>> = (0..n).map(|r| inputs[r * l].clone()).collect();
            expected(op, dtype, rop, 0, block, &per_rank).into_iter().map(|w| (w, l)).collect::<Vec<_>>()
        } else {
            expected(op, dtype, rop, root, block, &inputs).into_iter().map(|w| (w, m)).collect()
        };
        for (slot, out) in dst.iter().enumerate() {
            if op == Collective::SendRecv && slot > 0 {
                continue;
            }
            let index = if op == Collective::SendRecv { c.rank() } else { me(slot) };
            let (Some(w), n) = &want[index] else { continue };
            let rooted = op == Collective::Reduce || op == Collective::Gather;
            if rooted && (slot != root_slot || root / l != c.rank()) {
                continue;
            }
            let got = self.read(slot, out)?;
            let rop_if = op.reduces().then_some(rop);
            let wrong = if got == *w { 0 } else { count_wrong(dtype, rop_if, &got, w, *n) };
            if wrong > 0 {
                return Err(format!(
                    "{} ({dtype}, {rop}, root {root}, {elems} elements): member {} got {wrong} wrong elements",
                    op.name(),
                    me(slot)
                ));
            }
            self.checks += 1;
        }
        Ok(())
    }

    /// One collective whose largest buffer holds `bytes` bytes of f32,
    /// checked in closed form (a GiB without a host reference of every
    /// member's input). Element `r` of block `k` of member `m`'s input is
    /// `(m + 1) + 128·k + 128·M·(r mod R)` for `M` members (see
    /// [`closed_form`]): every member, every block and `R` consecutive
    /// elements differ, and sums over the members stay exact in f32, so a
    /// misplaced member, block or element shows, in the reductions too.
    /// Send/recv is left to [`Suite::run`].
    fn run_closed_form(&mut self, op: Collective, root: usize, bytes: usize) -> Result<(), String> {
        if op == Collective::SendRecv {
            return Ok(());
        }
        let c = &self.comm;
        let (l, m) = (c.local_devices(), c.members());
        let form = ClosedForm::new(m)?;
        let elems = if op.blocked() { bytes / 4 / m } else { bytes / 4 };
        let block = elems * 4;
        let (in_len, out_len) = op.lengths(block, m);
        let me = |slot: usize| c.rank() * l + slot;
        let input = |member: usize| -> Vec<u8> {
            (0..in_len / 4)
                .flat_map(|j| {
                    // (No element when `elems` is 0.)
                    let (k, r) = (j / elems.max(1), j % elems.max(1));
                    (form.value(member, k, r) as f32).to_le_bytes()
                })
                .collect()
        };
        let src: Vec<Handle> = (0..l).map(|s| self.upload(s, &input(me(s)))).collect();
        let dst: Vec<Handle> = (0..l).map(|s| self.comm.clients()[s].empty(out_len)).collect();
        let root_slot = if root / l == c.rank() { root % l } else { 0 };
        let e = |r: Result<(), cohort_comm::CommError>| r.map_err(|e| e.to_string());
        e(queue(c, op, &src, &dst, DType::F32, ReduceOp::Sum, root, root_slot))?;
        for (slot, out) in dst.iter().enumerate() {
            let at_root = root / l == c.rank() && slot == root_slot;
            let member = me(slot);
            // Element `r` of output block `q` (None: not written here).
            let want = |q: usize, r: usize| -> Option<f64> {
                match op {
                    Collective::AllReduce => Some(form.sum(0, r)),
                    Collective::Reduce => at_root.then(|| form.sum(0, r)),
                    Collective::ReduceScatter => Some(form.sum(member, r)),
                    Collective::Broadcast => Some(form.value(root, 0, r)),
                    Collective::Scatter => Some(form.value(root, member, r)),
                    Collective::AllGather => Some(form.value(q, 0, r)),
                    Collective::Gather => at_root.then(|| form.value(q, 0, r)),
                    Collective::AllToAll => Some(form.value(q, member, r)),
                    Collective::SendRecv | Collective::Barrier => None,
                }
            };
            if want(0, 0).is_none() {
                continue;
            }
            let got = self.read(slot, out)?;
            let per_block = if op.blocked() && out_len > block { elems } else { out_len / 4 };
            let wrong = got
                .chunks_exact(4)
                .enumerate()
                .filter(|&(j, x)| {
                    let (q, r) = (j / per_block.max(1), j % per_block.max(1));
                    f32::from_le_bytes([x[0], x[1], x[2], x[3]]) as f64 != want(q, r).expect("written")
                })
                .count()
                + (out_len / 4).abs_diff(got.len() / 4);
            if wrong > 0 {
                return Err(format!("{} of {bytes} bytes: member {member} got {wrong} wrong elements", op.name()));
            }
            self.checks += 1;
        }
        Ok(())
    }
}

/// The closed-form inputs of [`Suite::run_closed_form`] over `members`
/// members: `(m + 1) + 128·k + 128·M·(r mod period)`, with the period as
/// long as keeps the sum over every member below 2^24 (exact in f32).
struct ClosedForm {
    members: usize,
    period: usize,
}

impl ClosedForm {
    fn new(members: usize) -> Result<ClosedForm, String> {
        let scale = 128 * members * members;
        if members > 127 || scale >= 1 << 24 {
            return Err(format!("the closed-form check takes at most 127 members in f32, not {members}"));
        }
        // The largest power of two that keeps M · (largest value) ≤ 2^24.
        let mut period = 1;
        while scale * period * 2 <= 1 << 24 {
            period *= 2;
        }
        Ok(ClosedForm { members, period })
    }

    /// Element `r` of block `k` of member `m`'s input.
    fn value(&self, m: usize, k: usize, r: usize) -> f64 {
        ((m + 1) + 128 * k + 128 * self.members * (r % self.period)) as f64
    }

    /// The sum over every member of element `r` of block `k`.
    fn sum(&self, k: usize, r: usize) -> f64 {
        (0..self.members).map(|m| self.value(m, k, r)).sum()
    }
}

/// Every collective × element type × operator (and two roots) at 0, 1, 37
/// and 4099 elements against the host reference, then every collective
/// with its largest buffer `big` bytes (1 GiB by default) in closed form.
fn full(comm: Communicator, big: usize) -> Result<usize, String> {
    let mut s = Suite { comm, checks: 0 };
    let m = s.comm.members();
    for op in Collective::ALL {
        if op == Collective::SendRecv && s.comm.size() == 1 {
            continue;
        }
        let ops: &[ReduceOp] = if op.reduces() { &ReduceOp::ALL } else { &[ReduceOp::Sum] };
        let roots: &[usize] = if op.rooted() { &[0, m - 1] } else { &[0] };
        for dtype in DType::ALL {
            for &rop in ops {
                for &root in roots {
                    for elems in [0, 1, 37, 4099] {
                        s.run(op, dtype, rop, root, elems)?;
                    }
                }
            }
        }
    }
    for op in Collective::ALL {
        s.run_closed_form(op, m / 2, big)?;
    }
    s.comm.barrier().map_err(|e| e.to_string())?;
    Ok(s.checks)
}

fn suite(comm: Communicator, large: usize) -> Result<usize, String> {
    let mut s = Suite { comm, checks: 0 };
    let m = s.comm.members();
    let small = 37;
    for op in ReduceOp::ALL {
        for dtype in [DType::F32, DType::I32, DType::F16] {
            s.run(Collective::AllReduce, dtype, op, 0, small)?;
        }
    }
    // Large ones take the ring (the integer reference is slow: one of them).
    for dtype in [DType::F32, DType::F64, DType::BF16] {
        s.run(Collective::AllReduce, dtype, ReduceOp::Sum, 0, large / dtype.size())?;
    }
    s.run(Collective::AllReduce, DType::F32, ReduceOp::Avg, 0, large / 4)?;
    s.run(Collective::AllReduce, DType::I32, ReduceOp::Max, 0, large / 4 + 3)?;
    for root in [0, m - 1] {
        s.run(Collective::Reduce, DType::F32, ReduceOp::Sum, root, small)?;
        s.run(Collective::Reduce, DType::F64, ReduceOp::Avg, root, large / 8 + 1)?;
        s.run(Collective::Broadcast, DType::F32, ReduceOp::Sum, root, small)?;
        s.run(Collective::Broadcast, DType::U8, ReduceOp::Sum, root, large)?;
        s.run(Collective::Gather, DType::I32, ReduceOp::Sum, root, small)?;
        s.run(Collective::Scatter, DType::I32, ReduceOp::Sum, root, small)?;
    }
    for (dtype, elems) in [(DType::F32, small), (DType::F64, large / 8 / m)] {
        s.run(Collective::AllGather, dtype, ReduceOp::Sum, 0, elems)?;
        s.run(Collective::ReduceScatter, dtype, ReduceOp::Sum, 0, elems)?;
        s.run(Collective::ReduceScatter, dtype, ReduceOp::Avg, 0, elems)?;
        s.run(Collective::AllToAll, dtype, ReduceOp::Sum, 0, elems)?;
    }
    if s.comm.size() > 1 {
        s.run(Collective::SendRecv, DType::F32, ReduceOp::Sum, 0, small)?;
        s.run(Collective::SendRecv, DType::U8, ReduceOp::Sum, 0, large)?;
    }
    s.comm.barrier().map_err(|e| e.to_string())?;
    Ok(s.checks)
}

/// Times `iters` calls of `what` (all_reduce, reduce or broadcast, as
/// [`parse_mode`] checked; root 0)
/// on `bytes` bytes of f32, in place (rank 0 prints the mean).
fn latency(comm: &Communicator, what: &str, bytes: usize, iters: usize) -> Result<(), String> {
    let client = &comm.clients()[0];
    let buf = client.create_from_slice(&vec![0u8; bytes / 4 * 4]);
    let bufs = vec![buf.clone(); comm.local_devices()];
    let once = || match what {
        "reduce" => comm.reduce_handles(&bufs, &buf, DType::F32, ReduceOp::Sum, 0),
        "broadcast" => comm.broadcast_handles(&buf, &bufs, DType::F32, 0),
        _ => comm.all_reduce_handles(&bufs, &bufs, DType::F32, ReduceOp::Sum),
    };
    let run = |n: usize| -> Result<f64, String> {
        let t = Instant::now();
        for _ in 0..n {
            once().map_err(|e| e.to_string())?;
        }
        client.read_one(buf.clone()).map_err(|e| e.to_string())?;
        Ok(t.elapsed().as_secs_f64() / n as f64)
    };
    run(5)?;
    let mean = run(iters)?;
    if comm.rank() == 0 {
        println!("{what} of {bytes} bytes over {} ranks: {:.1} us", comm.size(), mean * 1e6);
    }
    Ok(())
}

/// How this rank reached the rendezvous store: `direct` when the launcher
/// gave it no relay sockets (`COHORT_STORE_FD`), else `relay, N sockets,
/// K close-on-exec` (the first store client of the process marks every one
/// of them close-on-exec, so K = N once the Communicator connected).
fn store_route() -> String {
    let Ok(list) = std::env::var("COHORT_STORE_FD") else {
        return "direct".into();
    };
    let fds: Vec<i32> = list.split(',').filter_map(|v| v.parse().ok()).collect();
    let claimed = fds
        .iter()
        .filter(|&&fd| {
            // SAFETY: F_GETFD reads the descriptor's flags; any fd value is safe.
            let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
            flags >= 0 && flags & libc::FD_CLOEXEC != 0
        })
        .count();
    format!("relay, {} sockets, {claimed} close-on-exec", fds.len())
}

/// What a run does: the suite, or a fault-injection mode (see the file's
/// documentation).
#[derive(Debug, Clone, PartialEq)]
enum Mode {
    Suite,
    Full {
        big: usize,
    },
    Barrier,
    Latency {
        what: String,
        bytes: usize,
        iters: usize,
    },
    /// `crash`, `skip` or `mismatch` of rank `who`.
    Fault {
        kind: String,
        who: usize,
    },
    Secret {
        who: usize,
    },
    /// `loop` (who: none), `kill9` or `stop`.
    Looping {
        kind: String,
        who: usize,
    },
    Slow {
        who: usize,
        secs: usize,
    },
    Desync {
        what: String,
        who: usize,
    },
    Leave {
        who: usize,
    },
}

/// The largest buffer a run may ask for.
const MAX_SIZE: usize = 1 << 30;

/// A size in bytes: a whole number with an optional K, M or G, alone or as
/// KiB, MiB, GiB (powers of 1024), or B: `4096`, `4K`, `64MiB`, `1GiB`.
fn parse_size(text: &str) -> Result<usize, String> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, unit) = t.split_at(split);
    let shift = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kib" => 10,
        "m" | "mib" => 20,
        "g" | "gib" => 30,
        _ => {
            return Err(format!(
                "{text:?} is not a size: give bytes, or K, M, G (KiB, MiB, GiB), e.g. 4096, 4K, 64MiB, 1GiB"
            ))
        }
    };
    if digits.is_empty() {
        return Err(format!("{text:?} is not a size: it has no number, e.g. 64MiB"));
    }
    // Digits alone fail to parse only past usize::MAX.
    let bytes = digits.parse::<usize>().ok().and_then(|n| n.checked_mul(1 << shift));
    bytes.filter(|&b| b <= MAX_SIZE).ok_or_else(|| format!("{text:?} is too large: at most 1GiB"))
}

/// Reads the mode and its arguments; a bad one is an error naming it.
fn parse_mode(mode: &[String]) -> Result<Mode, String> {
    let name = mode.first().map_or("suite", String::as_str);
    let number = |i: usize, what: &str| -> Result<usize, String> {
        let text = mode.get(i).ok_or_else(|| format!("{name}: missing {what}"))?;
        text.parse().map_err(|_| format!("{name}: {what} {text:?} is not a whole number"))
    };
    let size = |i: usize, what: &str| -> Result<usize, String> {
        let text = mode.get(i).ok_or_else(|| format!("{name}: missing {what}"))?;
        parse_size(text).map_err(|e| format!("{name}: {what} {e}"))
    };
    let given = |i: usize| mode.len() > i;
    let parsed = match name {
        "suite" => Mode::Suite,
        "full" => Mode::Full { big: if given(1) { size(1, "size")? } else { MAX_SIZE } },
        "barrier" => Mode::Barrier,
        "latency" => {
            let what = mode.get(3).cloned().unwrap_or_else(|| "all_reduce".into());
            if !matches!(what.as_str(), "all_reduce" | "reduce" | "broadcast") {
                return Err(format!("latency: {what} is not all_reduce, reduce or broadcast"));
            }
            let iters = if given(2) { number(2, "iterations")? } else { 100 };
            Mode::Latency { what, bytes: size(1, "size")?, iters }
        }
        "crash" | "skip" | "mismatch" => Mode::Fault { kind: name.into(), who: number(1, "rank")? },
        "secret" => Mode::Secret { who: number(1, "rank")? },
        "loop" => Mode::Looping { kind: name.into(), who: if given(1) { number(1, "rank")? } else { usize::MAX } },
        "kill9" | "stop" => Mode::Looping { kind: name.into(), who: number(1, "rank")? },
        "slow" => Mode::Slow { who: number(1, "rank")?, secs: number(2, "seconds")? },
        "desync" => {
            let what = mode.get(1).cloned().unwrap_or_default();
            if !matches!(what.as_str(), "kind" | "count" | "dtype" | "op" | "root") {
                return Err(format!("desync: unknown {what:?} (kind, count, dtype, op or root)"));
            }
            Mode::Desync { what, who: number(2, "rank")? }
        }
        "leave" => Mode::Leave { who: number(1, "rank")? },
        other => return Err(format!("unknown mode {other:?}")),
    };
    Ok(parsed)
}

/// The run's settings from its flags, which it applies to this process as
/// it reads them (environment, address-space limit, pid file); the words
/// that are not flags are the mode.
struct Flags {
    devices: usize,
    large: usize,
    backend: String,
    mode: Vec<String>,
}

fn apply_flags(args: &[String]) -> Result<Flags, String> {
    // Just above the ring threshold.
    let mut flags = Flags { devices: 1, large: 288 * 1024, backend: "cpu".into(), mode: Vec::new() };
    let my_rank = || std::env::var("RANK").ok().and_then(|r| r.parse::<usize>().ok());
    let mut it = args.iter().cloned();
    while let Some(a) = it.next() {
        let mut next = |usage: &str| it.next().ok_or_else(|| format!("usage: {usage}"));
        match a.as_str() {
            "--devices" => flags.devices = whole(next("--devices N")?, "--devices N")?,
            "--backend" => flags.backend = next("--backend cpu|cuda")?,
            "--large" => flags.large = parse_size(&next("--large BYTES")?).map_err(|e| format!("--large: {e}"))?,
            "--set-env" => {
                let (k, v) = pair(next("--set-env KEY=VALUE")?, "--set-env KEY=VALUE")?;
                std::env::set_var(k, v);
            }
            "--rank-env" => {
                let usage = "--rank-env RANK KEY=VALUE";
                let who = whole(next(usage)?, usage)?;
                let (k, v) = pair(next(usage)?, usage)?;
                if my_rank() == Some(who) {
                    std::env::set_var(k, v);
                }
            }
            "--rank-mem-limit" => {
                let usage = "--rank-mem-limit RANK MIB";
                let who = whole(next(usage)?, usage)?;
                let mib = whole(next(usage)?, usage)?;
                if my_rank() == Some(who) {
                    limit_address_space(mib as u64);
                }
            }
            "--unset-env" => std::env::remove_var(next("--unset-env KEY")?),
            "--pid-dir" => {
                let dir = next("--pid-dir DIR")?;
                let rank = std::env::var("RANK")
                    .or_else(|_| std::env::var("OMPI_COMM_WORLD_RANK"))
                    .or_else(|_| std::env::var("SLURM_PROCID"))
                    .unwrap_or_default();
                std::fs::write(format!("{dir}/rank{rank}.pid"), std::process::id().to_string())
                    .map_err(|e| format!("--pid-dir {dir}: cannot write rank{rank}.pid: {e}"))?;
            }
            _ => flags.mode.push(a),
        }
    }
    Ok(flags)
}

/// A flag's whole-number value.
fn whole(text: String, usage: &str) -> Result<usize, String> {
    text.parse().map_err(|_| format!("usage: {usage}: {text:?} is not a whole number"))
}

/// A flag's `KEY=VALUE`.
fn pair(text: String, usage: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((k, v)) => Ok((k.to_string(), v.to_string())),
        None => Err(format!("usage: {usage}: {text:?} has no =")),
    }
}

fn main() -> ExitCode {
    let start = Instant::now();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (Flags { devices, large, backend, .. }, mode) =
        match apply_flags(&args).and_then(|f| parse_mode(&f.mode).map(|m| (f, m))) {
            Ok(parsed) => parsed,
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::from(2);
            }
        };
    let opened: Result<Vec<Client>, String> = match backend.as_str() {
        "cpu" => (0..devices).map(CpuRuntime::client).collect::<Result<_, _>>().map_err(|e| e.to_string()),
        "cuda" => cuda_clients(devices),
        other => Err(format!("unknown backend {other} (cpu or cuda)")),
    };
    let clients = match opened {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: no {backend} devices: {e}");
            return ExitCode::from(1);
        }
    };
    if let Mode::Secret { who } = mode {
        if std::env::var("RANK").ok().and_then(|r| r.parse::<usize>().ok()) == Some(who) {
            std::env::set_var(cohort_runtime::config::JOB_SECRET.name, "not-the-job-secret");
        }
    }
    let comm = match Communicator::from_env(clients) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(1);
        }
    };
    let rank = comm.rank();
    println!("store: {}", store_route());
    let result = match mode {
        Mode::Suite => suite(comm.clone(), large).map(|checks| {
            if rank == 0 {
                let links: Vec<&str> = (0..comm.size()).map(|r| comm.transport_to(r)).collect();
                println!(
                    "suite passed: {checks} checks on rank 0, {} ranks × {devices} devices, links from rank 0: {}, {:.2} s",
                    comm.size(),
                    links.join(","),
                    start.elapsed().as_secs_f64()
                );
                println!("collectives took {:?} ({backend})", comm.transport());
            }
        }),
        Mode::Full { big } => full(comm.clone(), big).map(|checks| {
            if rank == 0 {
                println!(
                    "full suite passed: {checks} checks on rank 0, {} ranks × {devices} devices, {:?} ({backend}), {:.2} s",
                    comm.size(),
                    comm.transport(),
                    start.elapsed().as_secs_f64()
                );
            }
        }),
        Mode::Barrier | Mode::Secret { .. } => comm.barrier().map_err(|e| e.to_string()),
        Mode::Latency { what, bytes, iters } => latency(&comm, &what, bytes, iters),
        Mode::Fault { kind, who } => {
            let client = comm.clients()[0].clone();
            let buf = client.create_from_slice(&[0u8; 4096]);
            let bufs = vec![buf.clone(); devices];
            if rank == who && kind == "crash" {
                eprintln!("rank {rank}: crashing on purpose");
                std::process::exit(3);
            }
            let queued = if rank == who && kind == "skip" {
                std::thread::sleep(std::time::Duration::from_secs(3600));
                Ok(())
            } else if rank == who {
                comm.broadcast_handles(&buf, &bufs, DType::F32, 0).map(drop)
            } else {
                comm.all_reduce_handles(&bufs, &bufs, DType::F32, ReduceOp::Sum).map(drop)
            };
            queued.map_err(|e| e.to_string()).and_then(|()| client.read_one(buf).map(|_| ()).map_err(|e| e.to_string()))
        }
        Mode::Looping { kind, who } => faults::looping(&comm, &kind, who),
        Mode::Slow { who, secs } => faults::slow(&comm, who, secs),
        Mode::Desync { what, who } => faults::desync(&comm, &what, who),
        Mode::Leave { who } => faults::leave(&comm, who),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rank {rank}: error: {e}");
            ExitCode::from(1)
        }
    }
}

/// This rank's CUDA devices: `devices` of them from `LOCAL_RANK × devices`
/// (Open MPI's local rank under mpirun), wrapping around the GPUs there are.
fn cuda_clients(devices: usize) -> Result<Vec<Client>, String> {
    let local = ["LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"]
        .iter()
        .find_map(|v| std::env::var(v).ok()?.trim().parse::<usize>().ok())
        .unwrap_or(0);
    let count = CudaRuntime::device_count().map_err(|e| e.to_string())?.max(1);
    (0..devices).map(|i| CudaRuntime::client((local * devices + i) % count).map_err(|e| e.to_string())).collect()
}

/// Fault injection: lets this process map at most `mib` MiB more than it
/// has mapped now (RLIMIT_AS), so a large shared-memory ring fails to map.
fn limit_address_space(mib: u64) {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("read /proc/self/statm");
    let pages: u64 = statm.split_whitespace().next().and_then(|p| p.parse().ok()).expect("statm's first field");
    // SAFETY: sysconf has no memory-safety preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as u64;
    let bytes = pages * page + (mib << 20);
    let limit = libc::rlimit { rlim_cur: bytes, rlim_max: bytes };
    // SAFETY: `limit` is a valid rlimit that outlives the call.
    let rc = unsafe { libc::setrlimit(libc::RLIMIT_AS, &limit) };
    assert_eq!(rc, 0, "setrlimit(RLIMIT_AS): {}", std::io::Error::last_os_error());
}

#[cfg(test)]
mod tests {
    use super::{parse_mode, parse_size, ClosedForm, Mode, MAX_SIZE};

    /// `full 64MiB` panicked with "capacity overflow" (the size read as
    /// usize::MAX); sizes now read as people write them, or are refused.
    #[test]
    fn sizes_read_as_written_or_are_refused_naming_them() {
        for (text, bytes) in [("4096", 4096), ("4K", 4096), ("4KiB", 4096), ("64MiB", 64 << 20), ("64m", 64 << 20)] {
            assert_eq!(parse_size(text), Ok(bytes), "{text}");
        }
        assert_eq!(parse_size("1GiB"), Ok(MAX_SIZE));
        assert_eq!(parse_size("0"), Ok(0));
        for (text, says) in [
            ("2GiB", "too large: at most 1GiB"),
            ("99999999999999999999", "too large"),
            ("64MB/s", "is not a size"),
            ("MiB", "it has no number"),
            ("-1", "is not a size"),
            ("", "it has no number"),
        ] {
            let err = parse_size(text).unwrap_err();
            assert!(err.contains(&format!("{text:?}")) && err.contains(says), "{text}: {err}");
        }
        let words = |w: &[&str]| w.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(parse_mode(&words(&["full", "64MiB"])), Ok(Mode::Full { big: 64 << 20 }));
        assert_eq!(parse_mode(&words(&[])), Ok(Mode::Suite));
        let err = parse_mode(&words(&["full", "64XB"])).unwrap_err();
        assert!(err.starts_with("full: size \"64XB\" is not a size"), "{err}");
        assert_eq!(parse_mode(&words(&["crash", "two"])).unwrap_err(), "crash: rank \"two\" is not a whole number");
        assert_eq!(parse_mode(&words(&["slow", "1"])).unwrap_err(), "slow: missing seconds");
        assert!(parse_mode(&words(&["desync", "colour", "1"])).unwrap_err().contains("kind, count, dtype, op or root"));
        assert!(parse_mode(&words(&["latency", "64", "5", "gather"])).is_err());
        assert_eq!(parse_mode(&words(&["leave", "1"])), Ok(Mode::Leave { who: 1 }));
    }

    /// Every member, block and element within a period has its own value,
    /// and every sum over the members is exact in f32 (old inputs were one
    /// constant per member: a misplaced block of a reduction went unseen).
    #[test]
    fn closed_form_values_are_distinct_and_their_sums_exact_in_f32() {
        for members in [1, 2, 3, 4, 8, 16] {
            let form = ClosedForm::new(members).unwrap();
            assert!(form.period >= 512, "{members} members: period {}", form.period);
            let mut seen = std::collections::HashSet::new();
            for m in 0..members {
                for k in 0..members {
                    for r in 0..form.period.min(4096) {
                        assert!(seen.insert(form.value(m, k, r) as u64), "{members} members: ({m}, {k}, {r}) repeats");
                    }
                }
            }
            let mut sums = std::collections::HashSet::new();
            for k in 0..members {
                for r in [0, 1, form.period - 1] {
                    let sum = form.sum(k, r);
                    assert!(sum <= (1 << 24) as f64 && (sum as f32) as f64 == sum, "{members} members: {sum}");
                    assert!(sums.insert(sum as u64), "{members} members: the sum of block {k} element {r} repeats");
                }
            }
        }
        assert!(ClosedForm::new(400).is_err());
    }
}
