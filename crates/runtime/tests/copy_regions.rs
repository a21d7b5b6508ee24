//! Batched copies (`BufferAccess::copy_regions`): 300 regions of odd sizes
//! and offsets (more than one CUDA launch), empty ones and one of 1 MiB + 3
//! bytes, from three buffers into two, against the same copies made on the
//! host; regions past a buffer, naming a missing buffer or overlapping
//! another's bytes are refused with the region named. On the CPU backend, wgpu (lavapipe in CI) and
//! CUDA (ignored without a GPU).

use cohort_runtime::{Bytes, Client, CopyRegion, CpuRuntime, CudaRuntime, Runtime, WgpuRuntime};

/// Buffer sizes: three sources, then two destinations.
const SIZES: [usize; 5] = [5000, 777, (1 << 20) + 64, 40_000, (1 << 20) + 16];

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

/// The regions: 300 small copies from sources 0 and 1 into destination 3
/// at odd offsets (sizes 0 to 36 bytes), one large copy from source 2 into
/// destination 4, and one 16-byte aligned copy.
fn regions() -> Vec<CopyRegion> {
    let mut regions = Vec::new();
    let mut at = 3u64;
    for k in 0..300u64 {
        let bytes = (k * 7) % 37;
        let src = (k % 2) as usize;
        let src_offset = (k * 13) % (SIZES[src] as u64 - 40);
        regions.push(CopyRegion { src, src_offset, dst: 3, dst_offset: at, bytes });
        at += bytes + k % 3;
    }
    regions.push(CopyRegion { src: 2, src_offset: 1, dst: 4, dst_offset: 0, bytes: (1 << 20) + 3 });
    regions.push(CopyRegion { src: 0, src_offset: 16, dst: 4, dst_offset: (1 << 20) + 8, bytes: 0 });
    regions.push(CopyRegion { src: 1, src_offset: 32, dst: 3, dst_offset: 32_000, bytes: 512 });
    regions
}

/// Runs `regions` in one task over fresh buffers; returns the
/// destinations' bytes, or the task's error.
fn run(client: &Client, regions: Vec<CopyRegion>) -> Result<Vec<Vec<u8>>, String> {
    let handles: Vec<_> =
        SIZES.iter().enumerate().map(|(i, &n)| client.create(Bytes::from(pattern(n, 17 * i as u8)))).collect();
    let (inputs, outputs) = (handles[..3].to_vec(), handles[3..].to_vec());
    let (tx, rx) = std::sync::mpsc::channel();
    client
        .submit_buffers("copy_regions test", inputs, outputs.clone(), move |access| {
            let result = access.copy_regions(&regions);
            tx.send(result.as_ref().map_err(ToString::to_string).cloned()).unwrap();
            result
        })
        .unwrap();
    rx.recv().unwrap()?;
    Ok(outputs.into_iter().map(|h| client.read_one(h).unwrap().to_vec()).collect())
}

/// The same copies on the host.
fn expected(regions: &[CopyRegion]) -> Vec<Vec<u8>> {
    let mut buffers: Vec<Vec<u8>> = SIZES.iter().enumerate().map(|(i, &n)| pattern(n, 17 * i as u8)).collect();
    for r in regions {
        let (s, d, n) = (r.src_offset as usize, r.dst_offset as usize, r.bytes as usize);
        let from = buffers[r.src][s..s + n].to_vec();
        buffers[r.dst][d..d + n].copy_from_slice(&from);
    }
    buffers.split_off(3)
}

fn copies_match_the_host(client: &Client) {
    let regions = regions();
    assert_eq!(run(client, regions.clone()).unwrap(), expected(&regions));
}

fn bad_regions_are_refused(client: &Client) {
    let past = vec![
        CopyRegion { src: 0, src_offset: 0, dst: 3, dst_offset: 0, bytes: 8 },
        CopyRegion { src: 1, src_offset: 770, dst: 3, dst_offset: 64, bytes: 8 },
    ];
    let err = run(client, past).unwrap_err();
    assert!(err.contains("copy region 1") && err.contains("source buffer 1 (777 bytes)"), "{err}");
    let overlap = vec![
        CopyRegion { src: 0, src_offset: 0, dst: 3, dst_offset: 0, bytes: 8 },
        CopyRegion { src: 1, src_offset: 0, dst: 3, dst_offset: 7, bytes: 8 },
    ];
    let err = run(client, overlap).unwrap_err();
    assert!(err.contains("copy regions 0 and 1 overlap"), "{err}");
    let missing = vec![CopyRegion { src: 0, src_offset: 0, dst: 5, dst_offset: 0, bytes: 1 }];
    let err = run(client, missing).unwrap_err();
    assert!(err.contains("destination buffer 5 does not exist"), "{err}");
    // An empty batch copies nothing.
    assert_eq!(run(client, Vec::new()).unwrap(), expected(&[]));
}

#[test]
fn cpu_batched_copies_match_the_host() {
    let client = CpuRuntime::client(0).unwrap();
    copies_match_the_host(&client);
    bad_regions_are_refused(&client);
}

#[test]
fn wgpu_batched_copies_match_the_host() {
    let client = WgpuRuntime::client(0).unwrap_or_else(|e| panic!("no wgpu device 0: {e}"));
    copies_match_the_host(&client);
    bad_regions_are_refused(&client);
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored where one is"]
fn cuda_batched_copies_match_the_host() {
    let client = CudaRuntime::client(0).expect("CUDA device 0");
    copies_match_the_host(&client);
    bad_regions_are_refused(&client);
}
