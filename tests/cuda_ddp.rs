//! DistributedDataParallel on CUDA devices: on one GPU (a group of one),
//! and over NCCL on every GPU of the machine (`two_gpus_`), the same
//! scenarios as on the CPU: buckets overlapped with backward on two
//! streams and no_sync against an all-reduce after the whole backward,
//! bit-identical replicas, the hooks' tolerance; and the same bits with the
//! world on high-priority communication streams. Ignored without a GPU.

mod common;

use cohort_comm::ClientGroup;
use cohort_runtime::{Client, CudaRuntime, Runtime};

fn devices() -> Vec<Client> {
    let n = CudaRuntime::device_count().unwrap_or_else(|e| panic!("this test needs a CUDA GPU: {e}"));
    (0..n).map(|i| CudaRuntime::client(i).expect("a CUDA client")).collect()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_ddp_on_one_gpu_matches_the_reference() {
    let one = devices().into_iter().take(1).collect();
    common::every_scenario(&ClientGroup::new(one).unwrap());
}

#[test]
#[ignore = "needs CUDA GPUs: two or more"]
fn two_gpus_ddp_over_nccl_matches_the_reference_and_keeps_replicas_identical() {
    let all = devices();
    assert!(all.len() >= 2, "this test needs two GPUs or more, found {}", all.len());
    common::every_scenario(&ClientGroup::new(all).unwrap());
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_ddp_on_a_high_priority_communication_stream_gives_the_same_bits() {
    let one: Vec<Client> = devices().into_iter().take(1).collect();
    common::high_priority_world_gives_the_same_bits(&one);
}

#[test]
#[ignore = "needs CUDA GPUs: two or more"]
fn two_gpus_ddp_on_high_priority_communication_streams_gives_the_same_bits() {
    let all = devices();
    assert!(all.len() >= 2, "this test needs two GPUs or more, found {}", all.len());
    common::high_priority_world_gives_the_same_bits(&all);
}

#[test]
fn the_cublas_probe_names_the_library_when_it_is_missing_and_never_panics() {
    match cohort_runtime::backend::cuda::cublas_version() {
        Ok(version) => assert!(!version.is_empty()),
        Err(why) => assert!(why.contains("libcublas") && why.contains("LD_LIBRARY_PATH"), "{why}"),
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_cublas_products_match_the_tiled_kernel() {
    use cohort_comm::Buffer;
    use cohort_train::nn::{noise, Matmul, Mlp, MlpConfig};
    let gpu = devices().remove(0);
    let config = MlpConfig { width: 96, depth: 3 };
    let rows = 24;
    let x: Vec<f32> = (0..rows * config.width).map(|i| noise(i as u64)).collect();
    let input = [Buffer::from_slice(&gpu, &x).unwrap()];
    let mut outputs = Vec::new();
    for matmul in [Matmul::Auto, Matmul::Kernels] {
        let mut model = Mlp::with_matmul(std::slice::from_ref(&gpu), config, rows, 3, matmul).unwrap();
        model.forward(&input).unwrap();
        outputs.push(model.output(0).to_vec().unwrap());
    }
    let scale = outputs[1].iter().fold(0.0f32, |a, v| a.max(v.abs()));
    let worst = outputs[0].iter().zip(&outputs[1]).fold(0.0f32, |a, (x, y)| a.max((x - y).abs()));
    assert!(scale > 0.0 && worst <= 1e-4 * scale, "cuBLAS and the tiled kernel differ by {worst} (scale {scale})");
}
