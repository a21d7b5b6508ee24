//! Collectives on your own tensors: memory you allocated, computed by your
//! own code on your own stream, all-reduced in place through cohort with no
//! copy, and read back without cohort.
//!
//! - CPU: a `Vec<f32>` filled by a plain Rust loop, lent to cohort with
//!   `Buffer::with_borrowed` for the all-reduce.
//! - CUDA (argument `cuda`): a cudarc allocation on a cudarc stream of
//!   cudarc's primary context, filled by an NVRTC kernel of the program's
//!   own, lent with `Buffer::with_cuda_slice`; the all-reduce is ordered on
//!   that stream (`OnStream`: it starts after the kernel, with no host wait);
//!   the result is copied back with cudarc's `clone_dtoh`.
//!
//! Each rank's member `m` holds `(m + 1) × (i % 7 + 1)` at element `i`;
//! after the all-reduce every element is `(i % 7 + 1) × M(M + 1)/2` over
//! `M` members, which the program checks (it exits non-zero if not).
//!
//! Run alone (one device): `cargo run --example bring_your_own [cuda]`.
//! As a job of two ranks on the CPU:
//! `cargo build --example bring_your_own -p cohort && cargo build -p cohort-launch --bin cohort &&
//! target/debug/cohort run -n 2 target/debug/examples/bring_your_own` (one GPU per rank with `cuda`).

use std::slice;

use cohort::prelude::*;

/// Elements of the tensor.
const LEN: usize = 1 << 12;

/// Member `m`'s element `i`, as the program's own code computes it.
fn mine(member: usize, i: usize) -> f32 {
    ((member + 1) * (i % 7 + 1)) as f32
}

/// Checks the all-reduced elements, read without cohort.
fn check(sums: &[f32], members: usize) -> Result<(), String> {
    let total = (members * (members + 1) / 2) as f32;
    match sums.iter().enumerate().find(|(i, &x)| x != (i % 7 + 1) as f32 * total) {
        None => Ok(()),
        Some((i, x)) => Err(format!("element {i} is {x}, expected {}", (i % 7 + 1) as f32 * total)),
    }
}

/// CPU: a `Vec` of the program's, filled by a Rust loop.
fn cpu() -> Result<(), Box<dyn std::error::Error>> {
    // One CPU device per rank under a launcher, one alone.
    let world = World::join(rank_clients("cpu", Some(1))?)?;
    let (member, members) = (world.first_member(), world.members());
    let mut grads: Vec<f32> = (0..LEN).map(|i| mine(member, i)).collect();
    let address = grads.as_ptr();
    // Lent for the call: no copy, and the borrow ends (after the
    // all-reduce) when the closure returns.
    Buffer::with_borrowed(&world.clients()[0], &mut grads, |g| -> Result<(), Error> {
        world.all_reduce(slice::from_ref(g), slice::from_ref(g), ReduceOp::Sum)?.wait()?;
        Ok(())
    })??;
    check(&grads, members)?;
    assert_eq!(grads.as_ptr(), address, "the same Vec, written in place");
    println!(
        "member {member} of {members}: all-reduced {LEN} f32 in place in its own Vec (no copy), read back without \
         cohort: every element checked"
    );
    Ok(())
}

#[cfg(feature = "cuda")]
mod cuda {
    use std::slice;

    use cohort::prelude::*;
    use cohort::runtime::backend::cuda::cudarc::driver::{CudaContext, LaunchConfig, PushKernelArg};
    use cohort::runtime::backend::cuda::cudarc::nvrtc::compile_ptx;
    use cohort::runtime::CudaRuntime;

    use super::{check, LEN};

    /// The program's own kernel: `mine(member, i)` at every element.
    const FILL: &str = r#"
extern "C" __global__ void fill(float *x, unsigned n, float scale) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = scale * (float)(i % 7 + 1);
}"#;

    pub fn run() -> Result<(), Box<dyn std::error::Error>> {
        // The GPU of this rank (torchrun's LOCAL_RANK; 0 alone), through
        // cudarc's primary context, which cohort's client shares.
        let ordinal = std::env::var("LOCAL_RANK").ok().and_then(|r| r.parse().ok()).unwrap_or(0);
        // A clear error where there is no CUDA driver (cudarc panics).
        CudaRuntime::device_count()?;
        let ctx = CudaContext::new(ordinal)?;
        let client = CudaRuntime::client_for_context(&ctx)?;
        let world = World::join(vec![client.clone()])?;
        let (member, members) = (world.first_member(), world.members());
        let stream = ctx.new_stream()?;
        let fill = ctx.load_module(compile_ptx(FILL)?)?.load_function("fill")?;
        let mut grads = stream.alloc_zeros::<f32>(LEN)?;
        let (n, scale) = (LEN as u32, (member + 1) as f32);
        let mut launch = stream.launch_builder(&fill);
        launch.arg(&mut grads).arg(&n).arg(&scale);
        // SAFETY: `fill` takes (float*, unsigned, float) and writes
        // elements below `n` only, which `grads` holds.
        unsafe { launch.launch(LaunchConfig::for_num_elems(n)) }?;
        // The all-reduce starts after `fill` on the GPU (no host wait), and
        // the stream's later work after the all-reduce.
        let on_stream = OnStream::new(&world, &[ExternalStream::from_cudarc(&stream)])?;
        Buffer::with_cuda_slice(&client, &mut grads, |g| -> Result<(), Error> {
            on_stream.all_reduce(slice::from_ref(g), slice::from_ref(g), ReduceOp::Sum)?;
            Ok(())
        })??;
        let sums = stream.clone_dtoh(&grads)?;
        check(&sums, members)?;
        println!(
            "member {member} of {members}: all-reduced {LEN} f32 in place in its own cudarc allocation on GPU \
             {ordinal}, ordered on its own stream after its own kernel, read back with cudarc: every element checked"
        );
        Ok(())
    }
}

fn main() -> std::process::ExitCode {
    let run = match std::env::args().nth(1).as_deref() {
        None | Some("cpu") => cpu(),
        #[cfg(feature = "cuda")]
        Some("cuda") => cuda::run(),
        #[cfg(not(feature = "cuda"))]
        Some("cuda") => Err("built without the `cuda` feature: build with the default features".into()),
        Some(other) => Err(format!("unknown argument {other:?}: pass nothing (the CPU), `cpu` or `cuda`").into()),
    };
    match run {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(why) => {
            eprintln!("bring_your_own: {why}");
            std::process::ExitCode::FAILURE
        }
    }
}
