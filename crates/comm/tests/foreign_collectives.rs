//! Collectives on memory cohort did not allocate: every collective on
//! `Vec`s adopted by `Buffer::from_vec` (checked by reading the `Vec`s back
//! without cohort), zero copies (same address, no cohort allocation), the
//! owner outliving the work queued on it, the refusals (read-only
//! destinations, misaligned pointers, lengths that overflow, memory of
//! another backend), a borrow that ends even where a clone escaped it; and
//! the same on an adopted wgpu device's own buffers (lavapipe in CI).

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cohort_comm::store::StoreServer;
use cohort_comm::{Buffer, ClientGroup, Collectives, CommError, Communicator, Error, ReduceOp};
use cohort_runtime::dlpack::dlpark::ffi::{DLDataType, DLDevice, DLManagedTensorVersioned};
use cohort_runtime::dlpack::dlpark::metadata::Dynamic;
use cohort_runtime::dlpack::{self};
use cohort_runtime::{Access, Client, ForeignMemory};

/// `Vec`s adopted as buffers, one per client: member `m` gets `data(m)`.
fn adopted<T: cohort_comm::Element>(clients: &[Client], data: impl Fn(usize) -> Vec<T>) -> Vec<Buffer<T>> {
    clients.iter().enumerate().map(|(m, c)| Buffer::from_vec(c, data(m)).expect("adopt a Vec")).collect()
}

/// The `Vec`s back (waiting for the work queued on them), read without
/// cohort.
fn vecs<T: cohort_comm::Element>(buffers: Vec<Buffer<T>>) -> Vec<Vec<T>> {
    buffers.into_iter().map(|b| b.into_vec().expect("the Vec back")).collect()
}

/// Member `m`'s source of `len` elements: `100 m + i`.
fn source(m: usize, len: usize) -> Vec<f32> {
    (0..len).map(|i| (100 * m + i) as f32).collect()
}

#[test]
fn every_collective_runs_on_adopted_host_memory() {
    let clients = common::clients(3);
    let group = ClientGroup::new(clients.clone()).unwrap();
    let n = 3;
    let sum = |len: usize| -> Vec<f32> { (0..len).map(|i| (0..n).map(|m| source(m, len)[i]).sum()).collect() };

    let (src, dst) = (adopted(&clients, |m| source(m, 4)), adopted(&clients, |_| vec![0.0f32; 4]));
    group.all_reduce(&src, &dst, ReduceOp::Sum).unwrap();
    assert_eq!(vecs(dst), vec![sum(4); n], "all_reduce");

    let (src, dst) = (adopted(&clients, |m| source(m, 4)), adopted(&clients, |_| vec![-1.0f32; 4]));
    group.reduce(&src, &dst, ReduceOp::Sum, 1).unwrap();
    assert_eq!(vecs(dst), vec![vec![-1.0; 4], sum(4), vec![-1.0; 4]], "reduce to 1");

    let (src, dst) = (adopted(&clients, |m| source(m, 4)), adopted(&clients, |_| vec![0.0f32; 4]));
    group.broadcast(&src, &dst, 2).unwrap();
    assert_eq!(vecs(dst), vec![source(2, 4); n], "broadcast from 2");

    let (src, dst) = (adopted(&clients, |m| source(m, 2)), adopted(&clients, |_| vec![0.0f32; 2 * n]));
    group.all_gather(&src, &dst).unwrap();
    let gathered: Vec<f32> = (0..n).flat_map(|m| source(m, 2)).collect();
    assert_eq!(vecs(dst), vec![gathered.clone(); n], "all_gather");

    let (src, dst) = (adopted(&clients, |m| source(m, 2 * n)), adopted(&clients, |_| vec![0.0f32; 2]));
    group.reduce_scatter(&src, &dst, ReduceOp::Sum).unwrap();
    let total = sum(2 * n);
    assert_eq!(vecs(dst), (0..n).map(|m| total[2 * m..2 * m + 2].to_vec()).collect::<Vec<_>>(), "reduce_scatter");

    let (src, dst) = (adopted(&clients, |m| source(m, 2 * n)), adopted(&clients, |_| vec![0.0f32; 2 * n]));
    group.all_to_all(&src, &dst).unwrap();
    let expected: Vec<Vec<f32>> =
        (0..n).map(|k| (0..n).flat_map(|m| source(m, 2 * n)[2 * k..2 * k + 2].to_vec()).collect()).collect();
    assert_eq!(vecs(dst), expected, "all_to_all");

    let (src, dst) = (adopted(&clients, |m| source(m, 2)), adopted(&clients, |_| vec![-1.0f32; 2 * n]));
    group.gather(&src, &dst, 0).unwrap();
    assert_eq!(vecs(dst), vec![gathered, vec![-1.0; 2 * n], vec![-1.0; 2 * n]], "gather to 0");

    let (src, dst) = (adopted(&clients, |m| source(m, 2 * n)), adopted(&clients, |_| vec![0.0f32; 2]));
    group.scatter(&src, &dst, 1).unwrap();
    let scattered: Vec<Vec<f32>> = (0..n).map(|m| source(1, 2 * n)[2 * m..2 * m + 2].to_vec()).collect();
    assert_eq!(vecs(dst), scattered, "scatter from 1");

    let (src, dst) = (adopted(&clients, |m| source(m, 3)), adopted(&clients, |_| vec![0.0f32; 3]));
    group.send_recv(0, Some(&src[0]), 2, Some(&dst[2])).unwrap();
    assert_eq!(vecs(dst), vec![vec![0.0; 3], vec![0.0; 3], source(0, 3)], "send_recv 0 → 2");

    // A grouped call over two element types, in place.
    let floats = adopted(&clients, |m| source(m, 5));
    let ints = adopted(&clients, |m| vec![m as i64 + 1; 3]);
    group
        .group(|g| {
            g.all_reduce(&floats, &floats, ReduceOp::Sum)?;
            g.all_reduce(&ints, &ints, ReduceOp::Max)
        })
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(vecs(floats), vec![sum(5); n], "grouped all_reduce f32");
    assert_eq!(vecs(ints), vec![vec![3i64; 3]; n], "grouped all_reduce i64");
}

/// The zero-copy proof on the CPU: an in-place all-reduce on
/// adopted `Vec`s leaves each at its address and makes no allocation of
/// cohort's (`memory_usage` unchanged on every device).
#[test]
fn an_in_place_all_reduce_on_adopted_memory_copies_nothing() {
    let clients = common::clients(2);
    let group = ClientGroup::new(clients.clone()).unwrap();
    let usage = || clients.iter().map(|c| c.memory_usage().unwrap()).collect::<Vec<_>>();
    let data: Vec<Vec<f32>> = (0..2).map(|m| vec![m as f32 + 1.0; 1 << 16]).collect();
    let addresses: Vec<*const f32> = data.iter().map(|v| v.as_ptr()).collect();
    let before = usage();
    let bufs: Vec<Buffer<f32>> = clients.iter().zip(data).map(|(c, v)| Buffer::from_vec(c, v).unwrap()).collect();
    group.all_reduce(&bufs, &bufs, ReduceOp::Sum).unwrap().wait().unwrap();
    assert_eq!(usage(), before, "no allocation of cohort's for an in-place all-reduce on adopted memory");
    for (m, back) in vecs(bufs).into_iter().enumerate() {
        assert_eq!(back.as_ptr(), addresses[m], "member {m}'s Vec is the same allocation");
        assert!(back.iter().all(|&x| x == 3.0), "member {m}: {:?}", &back[..4]);
    }
}

#[test]
fn from_vec_and_into_vec_keep_the_allocation() {
    let client = &common::clients(1)[0];
    let data = vec![1u32, 2, 3, 4];
    let address = data.as_ptr();
    let buf = Buffer::from_vec(client, data).unwrap();
    assert!(buf.is_foreign());
    assert_eq!(buf.to_vec().unwrap(), [1, 2, 3, 4], "cohort reads the Vec's elements");
    buf.write(&[5, 6, 7, 8]).unwrap();
    let back = buf.into_vec().unwrap();
    assert_eq!((back.as_ptr(), back), (address, vec![5, 6, 7, 8]), "the same allocation, written in place");
    // Any value that holds its elements: an array, held inline.
    let buf = Buffer::adopt_owner(client, [1.5f64; 3]).unwrap();
    assert_eq!(buf.to_vec().unwrap(), [1.5; 3]);
    assert_eq!(buf.into_owner::<[f64; 3]>().unwrap(), [1.5; 3]);
}

/// `into_vec` with a clone alive gives nothing up: the clone still names
/// the memory; once the clone is the last, it gives the `Vec` back.
#[test]
fn into_vec_with_a_clone_alive_is_refused_and_the_clone_keeps_the_memory() {
    let client = &common::clients(1)[0];
    let buf = Buffer::from_vec(client, vec![7i32; 5]).unwrap();
    let clone = buf.clone();
    let err = buf.into_vec().unwrap_err();
    assert!(err.to_string().contains("clone"), "the error says why: {err}");
    let buf = err.into_inner();
    assert_eq!(buf.to_vec().unwrap(), [7; 5], "the buffer given back still reads the memory");
    drop(buf);
    assert_eq!(clone.to_vec().unwrap(), [7; 5], "the clone still reads the memory");
    let slice = clone.slice(1..3).unwrap();
    assert!(clone.clone().into_vec().is_err(), "a slice of it is a clone too");
    drop(slice);
    assert_eq!(clone.into_vec().unwrap(), [7; 5], "the last clone gives the Vec back");
}

/// Asked for an owner of another type, `into_owner` names the type and
/// gives the buffer back, its owner kept: `into_vec` then gives the `Vec`.
#[test]
fn into_owner_of_another_type_names_the_type_and_gives_the_buffer_back() {
    let client = &common::clients(1)[0];
    let data = vec![1.0f32, 2.0];
    let address = data.as_ptr();
    let err = Buffer::from_vec(client, data).unwrap().into_owner::<Box<[f32]>>().unwrap_err();
    assert!(err.to_string().contains("Box<[f32]>"), "{err}");
    let buf = err.into_inner();
    assert_eq!(buf.to_vec().unwrap(), [1.0, 2.0], "the buffer given back still reads the memory");
    let back = buf.into_vec().expect("the owner was kept");
    assert_eq!((back.as_ptr(), back), (address, vec![1.0, 2.0]), "the same allocation");
    let own = Buffer::<f32>::zeros(client, 4).unwrap().into_vec().unwrap_err();
    assert!(own.to_string().contains("adopt"), "cohort's own memory has no owner: {own}");
    assert_eq!(own.into_inner().len(), 4);
}

/// A refused constructor loses nothing: the `Vec` (or owner) it was given
/// comes back, the same allocation with the same contents, never dropped.
#[test]
fn a_refused_vec_or_owner_is_given_back_untouched() {
    let client = &common::clients(1)[0];
    // No element: refused ("0 bytes"), the Vec and its capacity given back.
    let empty = Vec::<f32>::with_capacity(8);
    let address = empty.as_ptr();
    let err = Buffer::from_vec(client, empty).unwrap_err();
    assert!(err.to_string().contains("0 bytes"), "{err}");
    let back = err.into_inner();
    assert_eq!((back.as_ptr(), back.capacity() >= 8, back.len()), (address, true, 0));

    // Elements off the CPU's 16-byte boundary: refused by the device.
    struct Shifted(Vec<f32>, Arc<AtomicUsize>);
    impl AsMut<[f32]> for Shifted {
        fn as_mut(&mut self) -> &mut [f32] {
            &mut self.0[1..]
        }
    }
    impl Drop for Shifted {
        fn drop(&mut self) {
            self.1.fetch_add(1, Ordering::SeqCst);
        }
    }
    let drops = Arc::new(AtomicUsize::new(0));
    let data: Vec<f32> = (0..8).map(|i| i as f32).collect();
    let address = data.as_ptr();
    let err = Buffer::adopt_owner(client, Shifted(data, drops.clone())).unwrap_err();
    assert!(err.to_string().contains("16-byte"), "{err}");
    assert!(matches!(err.error(), Error::Device(_)), "{err}");
    let back = err.into_inner();
    assert_eq!(drops.load(Ordering::SeqCst), 0, "the owner is given back, not dropped");
    assert_eq!((back.0.as_ptr(), &back.0[..]), (address, &[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0][..]));
    drop(back);
    assert_eq!(drops.load(Ordering::SeqCst), 1);

    // A pointer misaligned for the element: refused before the device, the
    // owner given back.
    let mut words = vec![0u64; 4];
    let ptr = words.as_mut_ptr().cast::<u8>().wrapping_add(2).cast::<f32>();
    // SAFETY: refused before anything uses the pointer.
    let err = unsafe { Buffer::<f32>::from_host_ptr(client, ptr, 2, words) }.unwrap_err();
    assert!(err.to_string().contains("multiple of 4"), "{err}");
    assert_eq!(err.into_inner(), [0u64; 4]);

    // `?` converts the refusal into cohort's Error where the value does not
    // matter (it is dropped then).
    let converted = || -> Result<Buffer<f32>, Error> { Ok(Buffer::from_vec(client, Vec::new())?) };
    assert!(converted().unwrap_err().to_string().contains("0 bytes"));
}

/// A clone smuggled out of `with_borrowed` fails cleanly once the borrow
/// ended, and never touches the slice: the slice keeps the collective's
/// results and nothing later.
#[test]
fn a_clone_kept_past_with_borrowed_fails_without_touching_the_slice() {
    let clients = common::clients(2);
    let group = ClientGroup::new(clients.clone()).unwrap();
    let (mut a, mut b) = (vec![1.0f32; 8], vec![2.0f32; 8]);
    let mut kept = None;
    Buffer::with_borrowed(&clients[0], &mut a, |a| {
        Buffer::with_borrowed(&clients[1], &mut b, |b| {
            let bufs = [a.clone(), b.clone()];
            // Not waited for: the end of the borrow waits.
            group.all_reduce(&bufs, &bufs, ReduceOp::Sum).unwrap();
            kept = Some(bufs);
        })
        .unwrap()
    })
    .unwrap();
    assert_eq!((a.clone(), b.clone()), (vec![3.0; 8], vec![3.0; 8]), "the borrow ended after the all-reduce");
    let kept = kept.unwrap();
    assert!(kept[0].to_vec().is_err(), "a read of a revoked buffer fails");
    assert!(kept[1].write(&[9.0; 8]).and_then(|_| kept[1].to_vec().map(drop)).is_err(), "a write of it fails");
    let refused = group.all_reduce(&kept, &kept, ReduceOp::Sum).and_then(|w| w.wait().map_err(Error::from));
    assert!(refused.is_err(), "a collective on it fails");
    client_sync(&clients);
    assert_eq!((a, b), (vec![3.0; 8], vec![3.0; 8]), "nothing touched the slices after their borrow");
}

fn client_sync(clients: &[Client]) {
    for c in clients {
        let _ = c.sync();
    }
}

/// A panic inside `with_borrowed` still ends the borrow (the buffer is
/// revoked while unwinding).
#[test]
fn a_panic_inside_with_borrowed_still_ends_the_borrow() {
    let client = common::clients(1)[0].clone();
    let mut data = vec![1u8; 4];
    let escaped = Arc::new(Mutex::new(None));
    let keep = escaped.clone();
    let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        Buffer::with_borrowed(&client, &mut data, |buf| {
            *keep.lock().unwrap() = Some(buf.clone());
            panic!("the body panics");
        })
    }));
    assert!(unwound.is_err());
    let buf = escaped.lock().unwrap().take().unwrap();
    assert!(buf.to_vec().is_err(), "revoked while unwinding");
    assert_eq!(data, [1; 4]);
}

/// What an owner saw when it was dropped: how many times, and the
/// elements then.
#[derive(Default)]
struct Dropped {
    count: AtomicUsize,
    seen: Mutex<Vec<f32>>,
}

/// A `Vec` that records its drop.
struct Watched {
    data: Vec<f32>,
    dropped: Arc<Dropped>,
}

impl AsMut<[f32]> for Watched {
    fn as_mut(&mut self) -> &mut [f32] {
        &mut self.data
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        *self.dropped.seen.lock().unwrap() = self.data.clone();
        self.dropped.count.fetch_add(1, Ordering::SeqCst);
    }
}

/// The "owner outliving queued work": rank 0 of a two-rank job (a
/// thread each) queues an all-reduce on adopted memory and drops every
/// clone of the buffer at once; rank 1 issues its part only once rank 0
/// has looked (100 ms later), from its own thread. The owner lives until
/// the all-reduce ended (it sees the sum), and is dropped exactly once.
#[test]
fn dropping_an_adopted_buffer_with_work_in_flight_keeps_its_owner_until_the_work_ends() {
    let clients = common::clients(8);
    let server = StoreServer::bind("127.0.0.1:0", "foreign").unwrap();
    let addr = server.local_addr().to_string();
    let dropped = Arc::new(Dropped::default());
    let (go, gone) = std::sync::mpsc::channel::<()>();
    std::thread::scope(|s| {
        let late = {
            let (addr, client) = (addr.clone(), clients[7].clone());
            s.spawn(move || {
                let comm = Communicator::connect(1, 2, &addr, "foreign", vec![client.clone()]).unwrap();
                gone.recv().unwrap();
                let buf = [Buffer::from_slice(&client, &[2.0f32; 64]).unwrap()];
                comm.all_reduce(&buf, &buf, ReduceOp::Sum).unwrap().wait().unwrap();
            })
        };
        let comm = Communicator::connect(0, 2, &addr, "foreign", vec![clients[6].clone()]).unwrap();
        let owner = Watched { data: vec![1.0; 64], dropped: dropped.clone() };
        let buf = [Buffer::adopt_owner(&clients[6], owner).unwrap()];
        let work = comm.all_reduce(&buf, &buf, ReduceOp::Sum).unwrap();
        drop(buf);
        // Time for a wrong release to happen.
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(dropped.count.load(Ordering::SeqCst), 0, "the owner lives while its work waits for rank 1");
        assert!(!work.is_done(), "rank 0's part waits for rank 1");
        go.send(()).unwrap();
        work.wait().unwrap();
        late.join().unwrap();
    });
    // Dropped on the device thread once it sees the work ended.
    let deadline = Instant::now() + Duration::from_secs(10);
    while dropped.count.load(Ordering::SeqCst) == 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(dropped.count.load(Ordering::SeqCst), 1, "dropped once");
    assert_eq!(*dropped.seen.lock().unwrap(), vec![3.0; 64], "dropped after the all-reduce wrote the sum");
    clients[6].sync().unwrap();
    assert_eq!(dropped.count.load(Ordering::SeqCst), 1, "and never again");
}

/// `owner`'s elements as a DLPack 1.x tensor of `shape`, built as a
/// producer (PyTorch, NumPy) builds one: its deleter drops `owner`.
fn dlpack_tensor(mut owner: Watched, shape: &[i64]) -> dlpack::Versioned {
    let data = owner.data.as_mut_ptr();
    let strides = (0..shape.len()).map(|d| shape[d + 1..].iter().product()).collect::<Vec<i64>>();
    let mut tensor =
        Dynamic::new(shape.to_vec(), strides).initialize_as::<DLManagedTensorVersioned>(Box::new(owner)).unwrap();
    tensor.set_data(data.cast()).set_device(DLDevice::CPU).set_dtype(DLDataType::F32);
    // SAFETY: data, shape and strides stay valid until the deleter drops
    // the owner (the Vec's heap block does not move with it).
    unsafe { tensor.finish() }
}

/// Another library's tensors (a 2 × 4 DLPack tensor on each device),
/// all-reduced in place through cohort: their deleters run once, after the
/// all-reduce, and see the sum; exported back, a buffer's tensor points at
/// the same memory.
#[test]
fn dlpack_tensors_of_another_library_are_all_reduced_in_place() {
    let clients = common::clients(2);
    let group = ClientGroup::new(clients.clone()).unwrap();
    let dropped: Vec<Arc<Dropped>> = (0..2).map(|_| Arc::new(Dropped::default())).collect();
    let mut addresses = Vec::new();
    let bufs: Vec<Buffer<f32>> = clients
        .iter()
        .enumerate()
        .map(|(m, c)| {
            let owner = Watched { data: vec![m as f32 + 1.0; 8], dropped: dropped[m].clone() };
            addresses.push(owner.data.as_ptr() as u64);
            Buffer::from_dlpack(c, dlpack_tensor(owner, &[2, 4])).unwrap()
        })
        .collect();
    assert_eq!(bufs[0].len(), 8, "every element of the 2 × 4 tensor");
    group.all_reduce(&bufs, &bufs, ReduceOp::Sum).unwrap();
    let exported = bufs[1].to_dlpack().unwrap();
    let view = exported.validate().unwrap();
    assert_eq!(view.data_ptr() as u64 + view.byte_offset(), addresses[1], "exported over the same memory");
    assert_eq!(view.shape(), [8]);
    drop(bufs);
    let deadline = Instant::now() + Duration::from_secs(10);
    while dropped[0].count.load(Ordering::SeqCst) == 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(dropped[0].count.load(Ordering::SeqCst), 1, "tensor 0's deleter ran once");
    assert_eq!(*dropped[0].seen.lock().unwrap(), vec![3.0; 8], "after the all-reduce");
    assert_eq!(dropped[1].count.load(Ordering::SeqCst), 0, "tensor 1 lives while its export does");
    drop(exported);
    while dropped[1].count.load(Ordering::SeqCst) == 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(dropped[1].count.load(Ordering::SeqCst), 1);
    assert_eq!(*dropped[1].seen.lock().unwrap(), vec![3.0; 8]);
}

#[test]
fn a_dlpack_tensor_of_another_element_type_is_refused_naming_both() {
    let client = &common::clients(1)[0];
    let owner = Watched { data: vec![1.0; 4], dropped: Arc::default() };
    let err = Buffer::<i32>::from_dlpack(client, dlpack_tensor(owner, &[4])).unwrap_err().to_string();
    assert!(err.contains("f32") && err.contains("i32"), "{err}");
}

/// Host memory adopted read-only, viewed as a buffer.
fn read_only(client: &Client, data: &'static mut [f32]) -> Buffer<f32> {
    let memory = ForeignMemory::Host { ptr: data.as_mut_ptr().cast(), len: std::mem::size_of_val(data) };
    // SAFETY: the memory is leaked: valid for the rest of the process, and
    // only cohort touches it.
    let handle = unsafe { client.adopt(memory, Box::new(()), Access::ReadOnly) }.unwrap();
    Buffer::from_handle(client, handle).unwrap()
}

/// `result`'s refusal, which must be `CommError::ReadOnly` naming
/// `operation` and `member`; its message.
#[track_caller]
fn read_only_refusal(result: Result<(), Error>, operation: &str, member: usize) -> String {
    let err = result.expect_err("a read-only destination is refused");
    match &err {
        Error::Comm(CommError::ReadOnly { operation: op, member: m, .. }) => {
            assert_eq!((*op, *m), (operation, member), "{err}");
        }
        other => panic!("expected CommError::ReadOnly for {operation}, member {member}: {other}"),
    }
    err.to_string()
}

#[test]
fn a_read_only_destination_is_refused_naming_the_collective_and_the_buffer() {
    let clients = common::clients(2);
    let group = ClientGroup::new(clients.clone()).unwrap();
    let ro: Vec<Buffer<f32>> = clients.iter().map(|c| read_only(c, vec![1.0; 4].leak())).collect();
    let rw = adopted(&clients, |_| vec![0.0f32; 4]);
    let err = read_only_refusal(group.all_reduce(&ro, &ro, ReduceOp::Sum).map(|_| ()), "all_reduce", 0);
    assert!(
        err.contains("all_reduce") && err.contains("destination of member 0") && err.contains("read-only"),
        "{err}"
    );
    assert!(err.contains("pass a writable buffer"), "it says what to do: {err}");
    let err = read_only_refusal(group.broadcast(&rw, &[rw[0].clone(), ro[1].clone()], 0).map(|_| ()), "broadcast", 1);
    assert!(err.contains("broadcast") && err.contains("destination of member 1"), "{err}");
    let err = read_only_refusal(group.send_recv(0, Some(&rw[0]), 1, Some(&ro[1])).map(|_| ()), "send_recv", 1);
    assert!(err.contains("send_recv") && err.contains("read-only"), "{err}");
    let err = read_only_refusal(group.group(|g| g.all_reduce(&rw, &ro, ReduceOp::Sum)).map(|_| ()), "all_reduce", 0);
    assert!(err.contains("all_reduce") && err.contains("read-only"), "a grouped call too: {err}");
    // Read-only sources are fine, and nothing was queued by the refusals.
    group.all_reduce(&ro, &rw, ReduceOp::Sum).unwrap().wait().unwrap();
    assert_eq!(vecs(rw), vec![vec![2.0; 4]; 2]);
    assert_eq!(ro[1].to_vec().unwrap(), [1.0; 4], "the read-only memory was never written");
}

/// The same check on a communicator's calls: an all-reduce into read-only
/// memory, and a message received into it, refused on the rank before
/// anything is queued (the ranks go on: a barrier passes).
#[test]
fn a_read_only_destination_is_refused_by_a_communicator_too() {
    let errors = common::communicator_ranks(8, 4, 2, 1, |comm| {
        let client = comm.clients()[0].clone();
        let ro = [read_only(&client, vec![1.0; 4].leak())];
        let member = comm.rank();
        let mut errors =
            vec![read_only_refusal(comm.all_reduce(&ro, &ro, ReduceOp::Sum).map(|_| ()), "all_reduce", member)];
        if comm.rank() == 1 {
            errors.push(read_only_refusal(comm.send_recv(0, None, 1, Some(&ro[0])).map(|_| ()), "recv", 1));
        }
        comm.barrier().unwrap();
        errors
    });
    for (rank, errors) in errors.iter().enumerate() {
        assert!(errors[0].contains("all_reduce") && errors[0].contains("read-only"), "rank {rank}: {errors:?}");
    }
    assert!(errors[1][1].contains("recv") && errors[1][1].contains("read-only"), "{:?}", errors[1]);
}

#[test]
fn a_misaligned_pointer_an_overflowing_length_and_another_device_are_refused() {
    let client = &common::clients(1)[0];
    let mut bytes = vec![0u64; 4];
    // SAFETY: refused before anything uses the pointer.
    let misaligned =
        unsafe { Buffer::<f32>::from_host_ptr(client, bytes.as_mut_ptr().cast::<u8>().add(2).cast(), 2, ()) };
    let err = misaligned.unwrap_err().to_string();
    assert!(err.contains("f32") && err.contains("multiple of 4"), "{err}");
    // SAFETY: refused before anything uses the pointer.
    let huge = unsafe { Buffer::<f64>::from_host_ptr(client, bytes.as_mut_ptr().cast(), usize::MAX / 4, ()) };
    assert!(huge.unwrap_err().to_string().contains("larger than memory"));
    // SAFETY: refused before anything uses the pointer.
    let null = unsafe { Buffer::<f32>::from_host_ptr(client, std::ptr::null_mut(), 1, ()) };
    assert!(null.unwrap_err().to_string().contains("non-null"));
    // The CPU's own conditions: at least one element, a 16-byte boundary.
    assert!(Buffer::from_vec(client, Vec::<f32>::new()).unwrap_err().to_string().contains("0 bytes"));
    let mut v = Vec::from([1.0f32; 8]); // heap: its start is on a 16-byte boundary
    let err = Buffer::with_borrowed(client, &mut v[1..], |_| ()).unwrap_err().to_string();
    assert!(err.contains("16"), "a sub-slice off the 16-byte boundary: {err}");
    // A slice of another device's buffer, into a collective of this one.
    let other = common::clients(2)[1].clone();
    let theirs = Buffer::from_vec(&other, vec![1.0f32; 2]).unwrap();
    let group = ClientGroup::new(vec![client.clone()]).unwrap();
    assert!(group.all_reduce(std::slice::from_ref(&theirs), std::slice::from_ref(&theirs), ReduceOp::Sum).is_err());
}

#[cfg(feature = "wgpu")]
mod wgpu_device {
    //! Adopted wgpu devices (lavapipe in CI): their own buffers, made by the
    //! caller with wgpu, in every collective ordered on the devices' queues
    //! and read back with wgpu alone; an in-place all-reduce with no copy;
    //! the refusals.

    use cohort_comm::OnStream;
    use cohort_runtime::{ExternalStream, WgpuRuntime};

    use super::*;

    /// A device and queue of the caller's (another framework's), adopted
    /// as a cohort client.
    struct Adopted {
        client: Client,
        device: wgpu::Device,
        queue: wgpu::Queue,
    }

    /// `n` wgpu devices of the first adapter, each opened by the caller and
    /// adopted. Panics where there is none (CI has lavapipe). One instance
    /// for the whole process, as an application has.
    fn adopted_devices(n: usize) -> Vec<Adopted> {
        static ADAPTER: std::sync::OnceLock<wgpu::Adapter> = std::sync::OnceLock::new();
        let adapter = ADAPTER.get_or_init(|| {
            let instance = wgpu::Instance::new(wgpu::InstanceDescriptor {
                backends: wgpu::Backends::PRIMARY,
                ..wgpu::InstanceDescriptor::new_without_display_handle()
            });
            pollster::block_on(instance.request_adapter(&wgpu::RequestAdapterOptions::default()))
                .expect("a wgpu adapter (lavapipe in CI)")
        });
        (0..n)
            .map(|_| {
                let (device, queue) =
                    pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor::default())).expect("a device");
                let client = WgpuRuntime::adopt(device.clone(), queue.clone()).expect("adopt the device");
                Adopted { client, device, queue }
            })
            .collect()
    }

    const USAGES: wgpu::BufferUsages =
        wgpu::BufferUsages::STORAGE.union(wgpu::BufferUsages::COPY_SRC).union(wgpu::BufferUsages::COPY_DST);

    /// A buffer of the caller's on `d`, holding `data` (written by wgpu).
    fn own_buffer(d: &Adopted, data: &[f32], usage: wgpu::BufferUsages) -> wgpu::Buffer {
        let buffer = d.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("the caller's"),
            size: std::mem::size_of_val(data) as u64,
            usage,
            mapped_at_creation: false,
        });
        d.queue.write_buffer(&buffer, 0, bytemuck::cast_slice(data));
        buffer
    }

    /// `buffer`'s elements, read with wgpu alone: a copy submitted on the
    /// device's queue (after whatever was submitted before) and mapped.
    fn read_back(d: &Adopted, buffer: &wgpu::Buffer) -> Vec<f32> {
        let staging = d.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("read back"),
            size: buffer.size(),
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let mut encoder = d.device.create_command_encoder(&wgpu::CommandEncoderDescriptor::default());
        encoder.copy_buffer_to_buffer(buffer, 0, &staging, 0, buffer.size());
        d.queue.submit([encoder.finish()]);
        staging.slice(..).map_async(wgpu::MapMode::Read, |mapped| mapped.expect("mapped"));
        d.device.poll(wgpu::PollType::Wait { submission_index: None, timeout: None }).expect("poll");
        let data = bytemuck::cast_slice(&staging.slice(..).get_mapped_range().expect("mapped range")).to_vec();
        data
    }

    /// Per device, the caller's buffer holding `data(m)` and cohort's view
    /// of it.
    fn wrapped(devices: &[Adopted], data: impl Fn(usize) -> Vec<f32>) -> (Vec<wgpu::Buffer>, Vec<Buffer<f32>>) {
        devices
            .iter()
            .enumerate()
            .map(|(m, d)| {
                let data = data(m);
                let own = own_buffer(d, &data, USAGES);
                let buf = Buffer::from_wgpu(&d.client, own.clone(), 0, data.len()).expect("wrap a wgpu buffer");
                (own, buf)
            })
            .unzip()
    }

    /// Every device's buffer read with wgpu, right after the call: ordered
    /// on the queues, nothing waited for through cohort.
    fn read_all(devices: &[Adopted], own: &[wgpu::Buffer]) -> Vec<Vec<f32>> {
        devices.iter().zip(own).map(|(d, b)| read_back(d, b)).collect()
    }

    #[test]
    fn every_collective_runs_on_adopted_devices_own_buffers_ordered_on_their_queues() {
        let devices = adopted_devices(2);
        let n = devices.len();
        let group = ClientGroup::new(devices.iter().map(|d| d.client.clone()).collect()).unwrap();
        let comm = OnStream::new(&group, &[ExternalStream::WgpuQueue, ExternalStream::WgpuQueue]).unwrap();
        let sum = |len: usize| -> Vec<f32> { (0..len).map(|i| (0..n).map(|m| source(m, len)[i]).sum()).collect() };

        let ((_, src), (dst_own, dst)) = (wrapped(&devices, |m| source(m, 4)), wrapped(&devices, |_| vec![0.0; 4]));
        comm.all_reduce(&src, &dst, ReduceOp::Sum).unwrap();
        assert_eq!(read_all(&devices, &dst_own), vec![sum(4); n], "all_reduce");

        let ((_, src), (dst_own, dst)) = (wrapped(&devices, |m| source(m, 4)), wrapped(&devices, |_| vec![-1.0; 4]));
        comm.reduce(&src, &dst, ReduceOp::Sum, 1).unwrap();
        assert_eq!(read_all(&devices, &dst_own), vec![vec![-1.0; 4], sum(4)], "reduce to 1");

        let ((_, src), (dst_own, dst)) = (wrapped(&devices, |m| source(m, 4)), wrapped(&devices, |_| vec![0.0; 4]));
        comm.broadcast(&src, &dst, 1).unwrap();
        assert_eq!(read_all(&devices, &dst_own), vec![source(1, 4); n], "broadcast from 1");

        let ((_, src), (dst_own, dst)) = (wrapped(&devices, |m| source(m, 2)), wrapped(&devices, |_| vec![0.0; 4]));
        comm.all_gather(&src, &dst).unwrap();
        let gathered: Vec<f32> = (0..n).flat_map(|m| source(m, 2)).collect();
        assert_eq!(read_all(&devices, &dst_own), vec![gathered.clone(); n], "all_gather");

        let ((_, src), (dst_own, dst)) = (wrapped(&devices, |m| source(m, 4)), wrapped(&devices, |_| vec![0.0; 2]));
        comm.reduce_scatter(&src, &dst, ReduceOp::Sum).unwrap();
        let total = sum(4);
        assert_eq!(read_all(&devices, &dst_own), vec![total[..2].to_vec(), total[2..].to_vec()], "reduce_scatter");

        let ((_, src), (dst_own, dst)) = (wrapped(&devices, |m| source(m, 4)), wrapped(&devices, |_| vec![0.0; 4]));
        comm.all_to_all(&src, &dst).unwrap();
        let expected: Vec<Vec<f32>> =
            (0..n).map(|k| (0..n).flat_map(|m| source(m, 4)[2 * k..2 * k + 2].to_vec()).collect()).collect();
        assert_eq!(read_all(&devices, &dst_own), expected, "all_to_all");

        let ((_, src), (dst_own, dst)) = (wrapped(&devices, |m| source(m, 2)), wrapped(&devices, |_| vec![-1.0; 4]));
        comm.gather(&src, &dst, 0).unwrap();
        assert_eq!(read_all(&devices, &dst_own), vec![gathered, vec![-1.0; 4]], "gather to 0");

        let ((_, src), (dst_own, dst)) = (wrapped(&devices, |m| source(m, 4)), wrapped(&devices, |_| vec![0.0; 2]));
        comm.scatter(&src, &dst, 0).unwrap();
        assert_eq!(read_all(&devices, &dst_own), vec![source(0, 4)[..2].to_vec(), source(0, 4)[2..].to_vec()]);

        let ((_, src), (dst_own, dst)) = (wrapped(&devices, |m| source(m, 3)), wrapped(&devices, |_| vec![0.0; 3]));
        comm.send_recv(1, Some(&src[1]), 0, Some(&dst[0])).unwrap();
        assert_eq!(read_all(&devices, &dst_own), vec![source(1, 3), vec![0.0; 3]], "send_recv 1 → 0");

        let (own, bufs) = wrapped(&devices, |m| source(m, 6));
        comm.group(|g| g.all_reduce(&bufs, &bufs, ReduceOp::Max)).unwrap();
        assert_eq!(read_all(&devices, &own), vec![source(1, 6); n], "grouped all_reduce in place");
    }

    /// The zero-copy proof on wgpu: an in-place all-reduce on the caller's
    /// own buffers (at an offset) writes them and makes no allocation of
    /// cohort's.
    #[test]
    fn an_in_place_all_reduce_on_adopted_wgpu_buffers_copies_nothing() {
        let devices = adopted_devices(2);
        let group = ClientGroup::new(devices.iter().map(|d| d.client.clone()).collect()).unwrap();
        let usage = || devices.iter().map(|d| d.client.memory_usage().unwrap()).collect::<Vec<_>>();
        let before = usage();
        let own: Vec<wgpu::Buffer> =
            devices.iter().enumerate().map(|(m, d)| own_buffer(d, &[m as f32 + 1.0; 1024], USAGES)).collect();
        // Elements 256.. of each: a view at a byte offset.
        let bufs: Vec<Buffer<f32>> = devices
            .iter()
            .zip(&own)
            .map(|(d, b)| Buffer::from_wgpu(&d.client, b.clone(), 1024, 768).unwrap())
            .collect();
        group.all_reduce(&bufs, &bufs, ReduceOp::Sum).unwrap().wait().unwrap();
        assert_eq!(usage(), before, "no allocation of cohort's");
        for (m, d) in devices.iter().enumerate() {
            let got = read_back(d, &own[m]);
            assert!(got[..256].iter().all(|&x| x == m as f32 + 1.0), "device {m}: before the view, untouched");
            assert!(got[256..].iter().all(|&x| x == 3.0), "device {m}: the view holds the sum, in the caller's buffer");
        }
    }

    /// `OnStream` with a stream per device: a count that differs is
    /// refused, and so is a stream the devices have no such thing as (the
    /// CPU's), before anything is queued.
    #[test]
    fn on_stream_refuses_a_wrong_count_and_a_backend_without_streams() {
        let clients = common::clients(2);
        let group = ClientGroup::new(clients.clone()).unwrap();
        let err = OnStream::new(&group, &[ExternalStream::WgpuQueue]).unwrap_err().to_string();
        assert!(err.contains("1 streams for 2 local devices"), "{err}");
        let comm = OnStream::new(&group, &[ExternalStream::WgpuQueue, ExternalStream::WgpuQueue]).unwrap();
        let bufs = adopted(&clients, |_| vec![1.0f32; 4]);
        let err = comm.all_reduce(&bufs, &bufs, ReduceOp::Sum).unwrap_err().to_string();
        assert!(err.contains("all_reduce") && err.contains("member 0"), "{err}");
        assert_eq!(vecs(bufs), vec![vec![1.0; 4]; 2], "nothing ran");
    }

    #[test]
    fn host_memory_a_buffer_of_another_device_missing_usages_and_a_bad_offset_are_refused_on_wgpu() {
        let devices = adopted_devices(2);
        let (a, b) = (&devices[0], &devices[1]);
        // Host memory on a wgpu device: refused, the same Vec given back.
        let data = vec![1.0f32, 2.0, 3.0, 4.0];
        let address = data.as_ptr();
        let err = Buffer::from_vec(&a.client, data).unwrap_err();
        assert!(err.to_string().contains("host memory") && err.to_string().contains("wgpu"), "{err}");
        let back = err.into_inner();
        assert_eq!((back.as_ptr(), back), (address, vec![1.0, 2.0, 3.0, 4.0]), "the Vec, untouched");
        // Each refused wgpu buffer is given back.
        let theirs = own_buffer(b, &[1.0; 4], USAGES);
        let err = Buffer::<f32>::from_wgpu(&a.client, theirs.clone(), 0, 4).unwrap_err();
        assert_eq!(err.into_inner(), theirs, "a buffer of another device");
        let no_storage = own_buffer(a, &[1.0; 4], wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST);
        let err = Buffer::<f32>::from_wgpu(&a.client, no_storage.clone(), 0, 4).unwrap_err();
        assert!(err.to_string().contains("STORAGE"), "the missing usage is named: {err}");
        assert_eq!(err.into_inner(), no_storage);
        let mine = own_buffer(a, &[1.0; 8], USAGES);
        let err = Buffer::<f32>::from_wgpu(&a.client, mine.clone(), 2, 4).unwrap_err();
        assert!(err.to_string().contains("byte 2"), "{err}");
        assert_eq!(err.into_inner(), mine);
        let err = Buffer::<f32>::from_wgpu(&a.client, mine.clone(), 16, 8).unwrap_err();
        assert_eq!(err.into_inner(), mine, "a range past the buffer's end");
        assert_eq!(read_back(a, &mine), [1.0; 8], "nothing written");
    }
}
