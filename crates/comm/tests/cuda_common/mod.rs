//! Shared set-up of the CUDA tests: the devices, and the collective matrix
//! checked against `cohort_comm::verify`'s host reference.

#![allow(dead_code)]

use cohort_comm::op::Collective;
use cohort_comm::verify::Buffers;
use cohort_comm::{ClientGroup, DType, ReduceOp};
use cohort_runtime::{Client, CudaRuntime, Runtime};

/// Every CUDA device; panics (with the reason) where there is none, which
/// only the ignored GPU tests reach.
pub fn devices() -> Vec<Client> {
    let n = CudaRuntime::device_count().unwrap_or_else(|e| panic!("this test needs a CUDA GPU: {e}"));
    (0..n).map(|i| CudaRuntime::client(i).expect("a CUDA client")).collect()
}

/// Runs one collective and counts wrong elements against the reference.
pub fn check(group: &ClientGroup, coll: Collective, dtype: DType, op: ReduceOp, elems: usize, in_place: bool) {
    let n = group.len();
    let blocked = coll.blocked();
    let size = elems * dtype.size() * if blocked { n } else { 1 };
    let root = n / 2;
    let what = format!("{coll:?} {dtype} {op} n={n} elems={elems} in_place={in_place} ({:?})", group.transport());
    let bufs = Buffers::new(group, coll, dtype, size, in_place, root);
    bufs.run(group, op).unwrap_or_else(|e| panic!("{what}: {e}"));
    let wrong = bufs.wrong(group, op).unwrap_or_else(|e| panic!("{what}: read failed: {e}"));
    assert_eq!(wrong, 0, "{what}: {wrong} wrong elements");
}

/// Every collective × element type × reduction × size, in and out of place.
pub fn matrix(group: &ClientGroup, sizes: &[usize]) {
    for coll in Collective::ALL {
        for dtype in DType::ALL {
            let ops: &[ReduceOp] = if coll.reduces() { &ReduceOp::ALL } else { &[ReduceOp::Sum] };
            for &op in ops {
                for &elems in sizes {
                    for in_place in [false, true] {
                        check(group, coll, dtype, op, elems, in_place);
                    }
                }
            }
        }
    }
    group.barrier().expect("a barrier after the matrix");
}

/// Every collective once with its largest buffer 1 GiB (f32, sum, out of
/// place), checked element by element: the top of the size range.
pub fn one_gib(group: &ClientGroup) {
    let n = group.len();
    for coll in Collective::ALL {
        let blocked = coll.blocked();
        let elems = (1usize << 28) / if blocked { n } else { 1 };
        check(group, coll, DType::F32, ReduceOp::Sum, elems, false);
    }
    group.barrier().expect("a barrier after the 1 GiB collectives");
}

/// Starts this test binary again, running only test `name`, with `envs`
/// set (a child process of its own: for variables read once per process,
/// and for ranks in processes); its output is piped for [`finish`].
pub fn rerun(name: &str, envs: &[(&str, String)]) -> std::process::Child {
    std::process::Command::new(std::env::current_exe().expect("the test's own path"))
        .args(["--exact", name, "--include-ignored", "--nocapture"])
        .envs(envs.iter().map(|(k, v)| (k, v)))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("the test's own binary starts")
}

/// Waits for a child from [`rerun`]: whether it succeeded, having run its
/// one test (a name that matches no test runs nothing and exits 0: that is
/// a failure here), and its output (stdout, then stderr).
pub fn finish(child: std::process::Child) -> (bool, String) {
    let out = child.wait_with_output().expect("the child's output");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success() && text.contains("test result: ok. 1 passed;"), text)
}
