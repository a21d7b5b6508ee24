//! Communicators formed inside one process, one thread per rank (shared
//! memory between them): collectives agree, argument errors come before
//! anything is queued, and a wrong secret is refused.

mod common;

use cohort_comm::store::StoreServer;
use cohort_comm::{CommError, Communicator, ConnectError, DType, ReduceOp};
use cohort_runtime::{CpuRuntime, Runtime};

/// Runs `body(comm)` on `n` ranks (CPU device `first + rank` each: tests
/// running at once use distinct devices, whose threads a collective blocks)
/// over a fresh store.
fn ranks<T: Send + 'static>(first: usize, n: usize, body: fn(Communicator) -> T) -> Vec<T> {
    ranks_of(first, n, 1, body)
}

/// [`ranks`] with `local` devices per rank (rank r: CPU devices `first + r
/// × local` onwards).
fn ranks_of<T: Send + 'static>(first: usize, n: usize, local: usize, body: fn(Communicator) -> T) -> Vec<T> {
    common::communicator_ranks(12, first, n, local, body)
}

/// Two ranks of two devices: every local device's part meets the others
/// of its rank before the exchange, for collectives and messages alike.
#[test]
fn ranks_of_two_devices_reduce_and_exchange_messages() {
    let results = ranks_of(8, 2, 2, |comm| {
        let (rank, clients) = (comm.rank(), comm.clients().to_vec());
        let member = |l: usize| (rank * 2 + l) as f32;
        let src: Vec<_> =
            (0..2).map(|l| clients[l].create_from_slice(bytemuck::cast_slice(&[member(l); 64]))).collect();
        let dst: Vec<_> = clients.iter().map(|c| c.empty(64 * 4)).collect();
        comm.all_reduce_handles(&src, &dst, DType::F32, ReduceOp::Sum).unwrap();
        let message = clients[1].empty(4);
        if rank == 0 {
            let sent = clients[1].create_from_slice(bytemuck::cast_slice(&[42.0f32]));
            comm.send_handle(&sent, 1, DType::F32).unwrap();
        } else {
            comm.recv_handle(&message, 0, DType::F32).unwrap();
        }
        comm.barrier().unwrap();
        let sums: Vec<f32> = dst
            .iter()
            .zip(&clients)
            .flat_map(|(d, c)| bytemuck::cast_slice::<u8, f32>(&c.read_one(d.clone()).unwrap()).to_vec())
            .collect();
        let got: Vec<f32> = bytemuck::cast_slice(&clients[1].read_one(message).unwrap()).to_vec();
        (sums, got)
    });
    for (rank, (sums, got)) in results.into_iter().enumerate() {
        assert!(sums.iter().all(|&v| v == 6.0), "rank {rank}: {sums:?}");
        if rank == 1 {
            assert_eq!(got, [42.0]);
        }
    }
}

#[test]
fn all_reduce_and_all_gather_agree_across_threads() {
    let results = ranks(0, 3, |comm| {
        let c = &comm.clients()[0];
        let r = comm.rank() as f32;
        let src = c.create_from_slice(bytemuck::cast_slice(&[r + 1.0; 100_000]));
        let one = std::slice::from_ref(&src);
        comm.all_reduce_handles(one, one, DType::F32, ReduceOp::Sum).unwrap();
        let gathered = c.empty(3 * 4);
        let mine = c.create_from_slice(bytemuck::cast_slice(&[r]));
        comm.all_gather_handles(&[mine], std::slice::from_ref(&gathered), DType::F32).unwrap();
        comm.barrier().unwrap();
        let sum: Vec<f32> = bytemuck::cast_slice(&c.read_one(src).unwrap()).to_vec();
        let all: Vec<f32> = bytemuck::cast_slice(&c.read_one(gathered).unwrap()).to_vec();
        (sum.iter().all(|&v| v == 6.0), all)
    });
    for (sum_ok, all) in results {
        assert!(sum_ok);
        assert_eq!(all, vec![0.0, 1.0, 2.0]);
    }
}

#[test]
fn argument_errors_come_before_anything_is_queued() {
    let errors = ranks(3, 2, |comm| {
        let c = &comm.clients()[0];
        let a = c.empty(16);
        let b = c.empty(12);
        let one = std::slice::from_ref(&a);
        let wrong_count = comm.all_reduce_handles(&[a.clone(), a.clone()], one, DType::F32, ReduceOp::Sum);
        let wrong_size = comm.all_reduce_handles(one, &[b], DType::F32, ReduceOp::Sum);
        let bad_root = comm.broadcast_handles(&a, one, DType::F32, 5);
        // The communicator still works: nothing was queued.
        comm.barrier().unwrap();
        (wrong_count, wrong_size, bad_root)
    });
    for (count, size, root) in errors {
        assert!(matches!(count, Err(CommError::BufferCount { expected: 1, got: 2, .. })), "{count:?}");
        assert!(matches!(size, Err(CommError::WrongSize { .. })), "{size:?}");
        assert!(matches!(root, Err(CommError::NotAMember { index: 5, members: 2, .. })), "{root:?}");
    }
}

#[test]
fn a_wrong_secret_is_refused() {
    let server = StoreServer::bind("127.0.0.1:0", "the-real-secret").unwrap();
    std::env::set_var("COHORT_CPU_DEVICES", "12");
    let client = CpuRuntime::client(7).unwrap();
    let err = Communicator::connect(0, 1, &server.local_addr().to_string(), "a-guess", vec![client]).unwrap_err();
    assert!(matches!(err, ConnectError::Store(_)), "{err:?}");
    assert!(err.to_string().to_lowercase().contains("secret"), "{err}");
}
