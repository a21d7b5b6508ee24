//! DLPack both ways on the CPU backend: tensors built here (as a producer
//! would: memory, shape, strides, a deleter that records when it ran and
//! what the memory held then) are imported with no copy, used by cohort,
//! exported back and read straight from the exported tensor's memory.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use cohort_runtime::dlpack::dlpark::ffi::{DLDataType, DLDataTypeCode, DLDevice, DLDeviceType, DLManagedTensor};
use cohort_runtime::dlpack::dlpark::ffi::{DLManagedTensorVersioned, DLPackVersion};
use cohort_runtime::dlpack::dlpark::metadata::Dynamic;
use cohort_runtime::dlpack::dlpark::{DlpackFlags, Managed, ManagedTensorBase};
use cohort_runtime::dlpack::{self, DlpackImport, Legacy, Versioned};
use cohort_runtime::{
    Access, Bytes, Client, CpuRuntime, DType, GridCount, Kernel, KernelArguments, Runtime, ServerError,
};

/// What a test tensor's deleter saw: how often it ran, and the bytes of the
/// tensor's memory when it did.
#[derive(Default)]
struct Probe {
    deletes: AtomicUsize,
    bytes_at_delete: Mutex<Option<Vec<u8>>>,
}

impl Probe {
    fn deletes(&self) -> usize {
        self.deletes.load(Ordering::SeqCst)
    }

    /// Waits (at most 10 s: a loaded CI box) for the deleter to have run
    /// `count` times in all.
    fn wait_deletes(&self, count: usize) {
        let start = Instant::now();
        while self.deletes() < count && start.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(self.deletes(), count, "the deleter ran {} times, expected {count}", self.deletes());
    }

    fn bytes_at_delete(&self) -> Vec<u8> {
        self.bytes_at_delete.lock().unwrap().clone().expect("the deleter ran")
    }
}

/// The producer's side of a test tensor: its memory (16-byte aligned, as
/// NumPy's and PyTorch's allocators give), dropped by the DLPack deleter.
struct Owner {
    storage: Vec<u128>,
    range: std::ops::Range<usize>,
    probe: Arc<Probe>,
}

impl Drop for Owner {
    fn drop(&mut self) {
        let bytes: &[u8] = bytemuck::cast_slice(&self.storage);
        *self.probe.bytes_at_delete.lock().unwrap() = Some(bytes[self.range.clone()].to_vec());
        self.probe.deletes.fetch_add(1, Ordering::SeqCst);
    }
}

/// A tensor to build as a producer would.
#[derive(Clone)]
struct Spec {
    dtype: DLDataType,
    shape: Vec<i64>,
    /// `None`: compact row-major, written out.
    strides: Option<Vec<i64>>,
    /// A null strides pointer (legacy and DLPack < 1.2 compact).
    null_strides: bool,
    byte_offset: u64,
    device: DLDevice,
    flags: DlpackFlags,
    /// The bytes at `data + byte_offset`.
    bytes: Vec<u8>,
}

impl Spec {
    fn new(dtype: DLDataType, shape: &[i64], bytes: Vec<u8>) -> Spec {
        Spec {
            dtype,
            shape: shape.to_vec(),
            strides: None,
            null_strides: false,
            byte_offset: 0,
            device: DLDevice::CPU,
            flags: DlpackFlags::empty(),
            bytes,
        }
    }

    /// The managed tensor, and its `data + byte_offset`.
    fn build<M: ManagedTensorBase>(&self, probe: &Arc<Probe>) -> (Managed<M>, *mut u8) {
        let offset = self.byte_offset as usize;
        let end = offset + self.bytes.len();
        let mut storage = vec![0u128; end.div_ceil(16).max(1)];
        bytemuck::cast_slice_mut::<u128, u8>(&mut storage)[offset..end].copy_from_slice(&self.bytes);
        // The heap block does not move with the Vec.
        let base = storage.as_mut_ptr().cast::<u8>();
        let owner = Box::new(Owner { storage, range: offset..end, probe: probe.clone() });
        let strides = self.strides.clone().unwrap_or_else(|| compact(&self.shape));
        let mut tensor = Dynamic::new(self.shape.clone(), strides).initialize_as::<M>(owner).unwrap();
        tensor.set_data(base.cast()).set_device(self.device).set_dtype(self.dtype).set_byte_offset(self.byte_offset);
        // SAFETY: the flags describe this test tensor as the test means it.
        unsafe { tensor.set_flags_unchecked(self.flags) };
        if self.null_strides {
            tensor.tensor_mut().strides = std::ptr::null_mut();
        }
        // SAFETY: data, shape and strides stay valid until the deleter
        // drops the owner.
        (unsafe { tensor.finish() }, base.wrapping_add(offset))
    }

    fn versioned(&self, probe: &Arc<Probe>) -> (Versioned, *mut u8) {
        self.build::<DLManagedTensorVersioned>(probe)
    }

    fn legacy(&self, probe: &Arc<Probe>) -> (Legacy, *mut u8) {
        self.build::<DLManagedTensor>(probe)
    }
}

fn compact(shape: &[i64]) -> Vec<i64> {
    let mut strides = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * shape[i + 1];
    }
    strides
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u32).wrapping_mul(2_654_435_761).rotate_left(7) as u8 ^ seed).collect()
}

fn client() -> Client {
    CpuRuntime::client(0).expect("CPU device 0")
}

/// Tests that compare device-wide memory usage run one at a time, on a
/// device no other test of this file uses.
fn usage_client() -> (MutexGuard<'static, ()>, Client) {
    static SERIAL: Mutex<()> = Mutex::new(());
    let guard = SERIAL.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    (guard, CpuRuntime::client(3).expect("CPU device 3"))
}

/// The refusal's message, which must name `needles`; the refused tensor's
/// deleter has run exactly once.
fn refusal(result: Result<DlpackImport, ServerError>, probe: &Probe, needles: &[&str]) -> String {
    let err = result.expect_err("the tensor is refused");
    let message = err.to_string();
    assert!(matches!(err, ServerError::InvalidArgument(_)), "{message}");
    for needle in needles {
        assert!(message.contains(needle), "`{message}` names `{needle}`");
    }
    assert_eq!(probe.deletes(), 1, "a refused tensor is dropped once: {message}");
    message
}

/// The message of an export's refusal.
fn error_of<T>(result: Result<T, ServerError>) -> String {
    match result {
        Ok(_) => panic!("the export is refused"),
        Err(err) => err.to_string(),
    }
}

fn read_raw(data: *const u8, len: usize) -> Vec<u8> {
    // SAFETY: the tests call this while the tensor owning `data..data+len`
    // lives and cohort's work on it is synced.
    unsafe { std::slice::from_raw_parts(data, len) }.to_vec()
}

/// Import, read and write through cohort at the producer's address, export
/// back and read the export's memory, for every cohort element type and
/// both ABIs; the producer's memory is freed once, only after the export
/// is dropped too.
#[test]
fn round_trip_every_dtype_with_no_copy() {
    let (_serial, client) = usage_client();
    for dtype in DType::ALL {
        for legacy in [false, true] {
            let what = format!("{dtype} ({})", if legacy { "legacy" } else { "versioned" });
            let shape = [2usize, 3, 4];
            let len = 24 * dtype.size();
            let mut spec = Spec::new(dlpack::dtype_to_dlpack(dtype), &[2, 3, 4], pattern(len, 1));
            spec.byte_offset = 32;
            let probe = Arc::new(Probe::default());
            let usage = client.memory_usage().unwrap();
            let (import, data) = if legacy {
                let (tensor, data) = spec.legacy(&probe);
                (dlpack::import(&client, tensor), data)
            } else {
                let (tensor, data) = spec.versioned(&probe);
                (dlpack::import(&client, tensor), data)
            };
            let import = import.unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_eq!((import.dtype, &import.shape[..]), (dtype, &shape[..]), "{what}");
            assert_eq!(import.handle.size(), len as u64, "{what}");
            assert_eq!(import.handle.access(), Access::ReadWrite, "{what}");
            assert_eq!(client.device_address(&import.handle).unwrap(), data as u64, "{what}: same address");

            // Cohort reads the producer's bytes and writes in place.
            assert_eq!(&client.read_one(import.handle.clone()).unwrap()[..], &spec.bytes[..], "{what}");
            let written = pattern(len, 2);
            client.write(&import.handle, Bytes::from_slice(&written)).unwrap();
            client.sync().unwrap();
            assert_eq!(read_raw(data, len), written, "{what}: cohort wrote the producer's memory");
            assert_eq!(client.memory_usage().unwrap(), usage, "{what}: no cohort allocation");

            // Exported back: the same memory, described for a consumer.
            let exported = dlpack::export(&client, &import.handle, dtype, &shape).unwrap();
            {
                let view = exported.validate().unwrap();
                assert_eq!(view.device(), DLDevice::CPU, "{what}");
                assert!(view.dtype().matches(spec.dtype), "{what}");
                assert_eq!(view.shape(), &[2, 3, 4], "{what}");
                assert_eq!(view.strides(), Some(&[12i64, 4, 1][..]), "{what}");
                assert_eq!(view.byte_offset(), 0, "{what}");
                assert_eq!(view.data_ptr() as u64, data as u64, "{what}: exported at the same address");
                // SAFETY: the export keeps the memory; cohort's work is synced.
                assert_eq!(unsafe { view.cpu_bytes() }.unwrap(), &written[..], "{what}");
            }
            assert_eq!(exported.flags(), DlpackFlags::empty(), "{what}");

            // The export keeps the producer's memory after the import is gone.
            drop(import);
            client.sync().unwrap();
            std::thread::sleep(Duration::from_millis(20));
            assert_eq!(probe.deletes(), 0, "{what}: freed while the export lives");
            drop(exported);
            probe.wait_deletes(1);
            assert_eq!(probe.bytes_at_delete(), written, "{what}");
        }
    }
}

/// The DLPack data type of each cohort type is the one NumPy and PyTorch
/// give it, and maps back.
#[test]
fn dtypes_map_both_ways() {
    let expected = [
        (DType::F32, DLDataTypeCode::FLOAT, 32),
        (DType::F64, DLDataTypeCode::FLOAT, 64),
        (DType::F16, DLDataTypeCode::FLOAT, 16),
        (DType::BF16, DLDataTypeCode::BFLOAT, 16),
        (DType::I8, DLDataTypeCode::INT, 8),
        (DType::U8, DLDataTypeCode::UINT, 8),
        (DType::I32, DLDataTypeCode::INT, 32),
        (DType::U32, DLDataTypeCode::UINT, 32),
        (DType::I64, DLDataTypeCode::INT, 64),
        (DType::U64, DLDataTypeCode::UINT, 64),
    ];
    assert_eq!(expected.len(), DType::ALL.len());
    for (dtype, code, bits) in expected {
        let dl = dlpack::dtype_to_dlpack(dtype);
        assert!(dl.matches(DLDataType::new(code, bits, 1)), "{dtype}: {dl:?}");
        assert_eq!(dlpack::dtype_from_dlpack(dl).unwrap(), dtype);
    }
}

/// Element types cohort has no type for are refused, naming the type and
/// listing what cohort takes.
#[test]
fn unsupported_dtypes_are_refused_by_name() {
    let client = client();
    let cases = [
        (DLDataType::BOOL, "bool"),
        (DLDataType::C64, "complex64"),
        (DLDataType::C128, "complex128"),
        (DLDataType::I16, "int16"),
        (DLDataType::U16, "uint16"),
        (DLDataType::F8E4M3FN, "float8_e4m3fn"),
        (DLDataType::new(DLDataTypeCode::FLOAT, 32, 4), "float32x4"),
        (DLDataType::new(DLDataTypeCode::OPAQUEHANDLE, 64, 1), "opaque handle"),
    ];
    for (dtype, name) in cases {
        let probe = Arc::new(Probe::default());
        let bytes = 4 * dtype.element_size();
        let (tensor, _) = Spec::new(dtype, &[4], vec![0; bytes]).versioned(&probe);
        let message = refusal(dlpack::import(&client, tensor), &probe, &[name, "not supported"]);
        assert!(message.contains("f32, f64, f16, bf16, i8, u8, i32, u32, i64, u64"), "{message}");
        let err = dlpack::dtype_from_dlpack(dtype).unwrap_err().to_string();
        assert!(err.contains(name), "{err}");
    }
}

/// Non-contiguous tensors are refused (transposed, strided, broadcast);
/// compact ones are taken however their size-1 dimensions' strides read
/// and when strides are null.
#[test]
fn strides_must_be_compact_row_major() {
    let client = client();
    let f32s = DLDataType::F32;
    for (shape, strides) in [
        (vec![2i64, 3], vec![1i64, 2]), // transposed
        (vec![4], vec![2]),             // every other element
        (vec![2, 3], vec![0, 1]),       // broadcast rows
        (vec![2, 1, 3], vec![6, 3, 2]), // padded innermost
        (vec![3, 2], vec![-2, 1]),      // reversed
    ] {
        let probe = Arc::new(Probe::default());
        let elements: i64 = shape.iter().product();
        let mut spec = Spec::new(f32s, &shape, vec![0; 4 * 2 * elements as usize]);
        spec.strides = Some(strides.clone());
        let (tensor, _) = spec.versioned(&probe);
        refusal(
            dlpack::import(&client, tensor),
            &probe,
            &["non-contiguous strides", &format!("{strides:?}"), ".contiguous()"],
        );
    }
    for (shape, strides) in [
        (vec![3i64, 1], vec![1i64, 7]),
        (vec![1, 4], vec![99, 1]),
        (vec![2, 1, 3], vec![3, 1, 1]),
        (vec![0, 3], vec![5, 5]),
    ] {
        let probe = Arc::new(Probe::default());
        let elements: i64 = shape.iter().product();
        let mut spec = Spec::new(f32s, &shape, pattern(4 * elements as usize, 3));
        spec.strides = Some(strides.clone());
        let (tensor, _) = spec.versioned(&probe);
        let import = dlpack::import(&client, tensor).unwrap_or_else(|e| panic!("{shape:?} {strides:?}: {e}"));
        assert_eq!(import.shape, shape.iter().map(|&d| d as usize).collect::<Vec<_>>());
        if elements > 0 {
            assert_eq!(&client.read_one(import.handle.clone()).unwrap()[..], &spec.bytes[..]);
        }
    }
    // Null strides: compact, in the legacy ABI and DLPack 1.0/1.1 (1.2
    // made them explicit).
    let probe = Arc::new(Probe::default());
    let mut spec = Spec::new(f32s, &[2, 3], pattern(24, 4));
    spec.null_strides = true;
    let (tensor, data) = spec.legacy(&probe);
    let import = dlpack::import(&client, tensor).unwrap();
    assert_eq!(client.device_address(&import.handle).unwrap(), data as u64);
    assert_eq!(&client.read_one(import.handle.clone()).unwrap()[..], &spec.bytes[..]);
    let (tensor, _) = spec.versioned(&probe);
    // SAFETY: a 1.1 tensor is laid out as a 1.3 one.
    unsafe { (*tensor.as_ptr()).version = DLPackVersion { major: 1, minor: 1 } };
    assert!(dlpack::import(&client, tensor).is_ok());
    // A 1.3 tensor must write its strides out.
    let probe = Arc::new(Probe::default());
    let (tensor, _) = spec.versioned(&probe);
    refusal(dlpack::import(&client, tensor), &probe, &["requires explicit strides"]);
}

/// A `data + byte_offset` that breaks the element's alignment is refused,
/// naming the offset.
#[test]
fn misaligned_byte_offset_is_refused() {
    let client = client();
    for (dtype, offset) in [(DType::F32, 2u64), (DType::F64, 4), (DType::BF16, 1), (DType::I64, 12)] {
        let probe = Arc::new(Probe::default());
        let mut spec = Spec::new(dlpack::dtype_to_dlpack(dtype), &[4], vec![0; 4 * dtype.size()]);
        spec.byte_offset = offset;
        let (tensor, _) = spec.versioned(&probe);
        refusal(
            dlpack::import(&client, tensor),
            &probe,
            &["not aligned", &format!("byte_offset {offset}"), &format!("{} bytes of a {dtype}", dtype.size())],
        );
    }
    // Aligned for its element but off the CPU's 16-byte boundary: refused
    // by the adoption. As DLPack asks, the consumer that took the tensor
    // runs its deleter, once; the producer's memory is untouched.
    let probe = Arc::new(Probe::default());
    let mut spec = Spec::new(DLDataType::F32, &[4], pattern(16, 7));
    spec.byte_offset = 4;
    let (tensor, _) = spec.versioned(&probe);
    refusal(dlpack::import(&client, tensor), &probe, &["16-byte boundary"]);
    assert_eq!(probe.bytes_at_delete(), pattern(16, 7), "the memory as the producer left it");
}

/// Tensors of another device are refused, naming the tensor's device and
/// the client.
#[test]
fn tensors_of_other_devices_are_refused_naming_both() {
    let client = client();
    for (device, names) in [
        (DLDevice::cuda(1), &["a CUDA tensor on GPU 1 handed to cpu:0"][..]),
        (DLDevice { device_type: DLDeviceType::ROCM, device_id: 0 }, &["ROCm", "handed to cpu:0"][..]),
        (DLDevice::metal(0), &["Metal", "handed to cpu:0"][..]),
        (DLDevice { device_type: DLDeviceType::CUDAMANAGED, device_id: 0 }, &["CUDA managed"][..]),
        (DLDevice { device_type: DLDeviceType(99), device_id: 0 }, &["device type 99"][..]),
    ] {
        let probe = Arc::new(Probe::default());
        let mut spec = Spec::new(DLDataType::F32, &[4], vec![0; 16]);
        spec.device = device;
        let (tensor, _) = spec.versioned(&probe);
        refusal(dlpack::import(&client, tensor), &probe, names);
    }
    // Pinned CUDA host memory is host memory: a CPU client takes it.
    let probe = Arc::new(Probe::default());
    let mut spec = Spec::new(DLDataType::F32, &[4], pattern(16, 5));
    spec.device = DLDevice { device_type: DLDeviceType::CUDAHOST, device_id: 0 };
    let (tensor, data) = spec.versioned(&probe);
    let import = dlpack::import(&client, tensor).unwrap();
    assert_eq!(client.device_address(&import.handle).unwrap(), data as u64);
}

/// A tensor flagged read-only is a read-only handle, which cohort reads
/// but refuses to write; exported, it stays flagged read-only (and cannot
/// go out as a legacy tensor, which could not say so).
#[test]
fn read_only_tensors_become_read_only_handles() {
    let client = client();
    let probe = Arc::new(Probe::default());
    let mut spec = Spec::new(DLDataType::U8, &[64], pattern(64, 6));
    spec.flags = DlpackFlags::READ_ONLY;
    let (tensor, data) = spec.versioned(&probe);
    let import = dlpack::import(&client, tensor).unwrap();
    assert_eq!(import.handle.access(), Access::ReadOnly);
    assert_eq!(&client.read_one(import.handle.clone()).unwrap()[..], &spec.bytes[..]);
    // Refused on the device; the refusal comes back by the next sync.
    let refused = client.write(&import.handle, Bytes::from_slice(&[0; 64])).and_then(|()| client.sync());
    let err = refused.expect_err("a read-only handle is not written").to_string();
    assert!(err.contains("read-only"), "{err}");
    client.sync().unwrap();
    assert_eq!(read_raw(data, 64), spec.bytes, "the producer's bytes are untouched");

    let exported = dlpack::export(&client, &import.handle, DType::U8, &[64]).unwrap();
    assert_eq!(exported.flags(), DlpackFlags::READ_ONLY);
    let err = error_of(dlpack::export_legacy(&client, &import.handle, DType::U8, &[64]));
    assert!(err.contains("read-only") && err.contains("legacy"), "{err}");

    // Cohort's own buffers go out writable.
    let own = client.create_from_slice(&[1; 8]);
    assert_eq!(dlpack::export(&client, &own, DType::U8, &[8]).unwrap().flags(), DlpackFlags::empty());
}

/// Holds a CPU kernel until the test opens it (or drops it: a failed
/// assertion never leaves the device blocked).
#[derive(Clone, Default)]
struct Gate(Arc<(Mutex<bool>, Condvar)>);

impl Gate {
    fn open(&self) {
        *self.0 .0.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = true;
        self.0 .1.notify_all();
    }

    fn wait(&self) {
        let (open, opened) = &*self.0;
        let open = open.lock().unwrap();
        let _open = opened.wait_timeout_while(open, Duration::from_secs(60), |open| !*open).unwrap();
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        self.open();
    }
}

/// The producer's memory is freed once, after the work cohort queued on it
/// ran, however early the handle is dropped.
#[test]
fn deleter_runs_once_after_queued_work() {
    let client = client();
    let probe = Arc::new(Probe::default());
    let spec = Spec::new(DLDataType::U8, &[256], vec![0; 256]);
    let (tensor, _) = spec.versioned(&probe);
    let import = dlpack::import(&client, tensor).unwrap();

    // A kernel that writes the memory only once the test lets it.
    let gate = Gate::default();
    let kernel_gate = gate.clone();
    let kernel = Kernel::new("dlpack_gated_fill").with_cpu(move |ctx| {
        kernel_gate.wait();
        ctx.buffer::<u8>(0).fill(0xAB);
    });
    client.launch(&kernel, GridCount::Static(1, 1, 1), KernelArguments::new().buffer(&import.handle)).unwrap();
    drop(import);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(probe.deletes(), 0, "freed while a queued kernel still needs the memory");

    gate.open();
    client.sync().unwrap();
    probe.wait_deletes(1);
    assert_eq!(probe.bytes_at_delete(), vec![0xAB; 256], "the kernel ran before the memory was freed");
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(probe.deletes(), 1, "freed once");
}

/// A clone of the handle (or a slice of it) keeps the producer's memory.
#[test]
fn deleter_waits_for_every_handle_clone() {
    let client = client();
    let probe = Arc::new(Probe::default());
    let spec = Spec::new(DLDataType::I32, &[8], pattern(32, 7));
    let (tensor, data) = spec.legacy(&probe);
    let import = dlpack::import(&client, tensor).unwrap();
    let slice = import.handle.slice(16, 16).unwrap();
    let clone = import.handle.clone();
    drop(import);
    client.sync().unwrap();
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(probe.deletes(), 0, "freed while two handles live");
    drop(clone);
    client.sync().unwrap();
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(probe.deletes(), 0, "freed while a slice lives");
    assert_eq!(client.device_address(&slice).unwrap(), data as u64 + 16);
    assert_eq!(&client.read_one(slice.clone()).unwrap()[..], &spec.bytes[16..]);
    drop(slice);
    probe.wait_deletes(1);
    assert_eq!(probe.bytes_at_delete(), spec.bytes);
}

/// A tensor with no elements is an empty buffer, and exports as one.
#[test]
fn zero_size_tensors_round_trip() {
    let client = client();
    for shape in [vec![0i64], vec![3, 0, 2]] {
        let probe = Arc::new(Probe::default());
        let (tensor, _) = Spec::new(DLDataType::F32, &shape, Vec::new()).versioned(&probe);
        let import = dlpack::import(&client, tensor).unwrap();
        let dims: Vec<usize> = shape.iter().map(|&d| d as usize).collect();
        assert_eq!((import.dtype, &import.shape), (DType::F32, &dims));
        assert_eq!(import.handle.size(), 0);
        assert!(import.is_empty());
        assert_eq!(probe.deletes(), 1, "nothing of an empty tensor is kept");
        let exported = dlpack::export(&client, &import.handle, DType::F32, &dims).unwrap();
        let view = exported.validate().unwrap();
        assert_eq!(view.shape(), &shape[..]);
        assert_eq!(view.num_elements(), 0);
    }
    // A tensor of no dimensions holds one element.
    let probe = Arc::new(Probe::default());
    let (tensor, data) = Spec::new(DLDataType::F64, &[], 2.5f64.to_ne_bytes().to_vec()).versioned(&probe);
    let import = dlpack::import(&client, tensor).unwrap();
    assert_eq!((import.shape.len(), import.len(), import.handle.size()), (0, 1, 8));
    assert_eq!(client.device_address(&import.handle).unwrap(), data as u64);
}

/// Element counts that overflow, and a null data pointer, are refused.
#[test]
fn sizes_that_cannot_be_are_refused() {
    let client = client();
    let probe = Arc::new(Probe::default());
    let mut spec = Spec::new(DLDataType::F32, &[i64::MAX / 2, 4], Vec::new());
    spec.strides = Some(vec![4, 1]);
    let (tensor, _) = spec.versioned(&probe);
    refusal(dlpack::import(&client, tensor), &probe, &["overflows"]);
    let probe = Arc::new(Probe::default());
    let mut spec = Spec::new(DLDataType::U64, &[1 << 60, 2], Vec::new());
    spec.strides = Some(vec![2, 1]);
    let (tensor, _) = spec.versioned(&probe);
    refusal(dlpack::import(&client, tensor), &probe, &["number of bytes overflows"]);

    let probe = Arc::new(Probe::default());
    let (tensor, _) = Spec::new(DLDataType::F32, &[4], vec![0; 16]).versioned(&probe);
    let raw = tensor.into_raw();
    // SAFETY: the test owns the tensor; only its data pointer changes.
    let tensor = unsafe {
        (*raw).dl_tensor.data = std::ptr::null_mut();
        Managed::from_raw(raw).unwrap()
    };
    refusal(dlpack::import(&client, tensor), &probe, &["null data pointer"]);
}

/// An export whose shape does not cover the handle exactly is refused,
/// naming both sizes; so is a handle of another device.
#[test]
fn export_shape_must_match_the_handle() {
    let client = client();
    let handle = client.create_from_slice(&[0; 24]);
    for (dtype, shape) in [(DType::F32, vec![2usize, 2]), (DType::F64, vec![4]), (DType::U8, vec![5, 5])] {
        let err = error_of(dlpack::export(&client, &handle, dtype, &shape));
        assert!(err.contains(&format!("{shape:?}")) && err.contains("24 bytes"), "{err}");
    }
    let err = error_of(dlpack::export(&client, &handle, DType::U8, &[usize::MAX, 2]));
    assert!(err.contains("24 bytes"), "{err}");
    let exported = dlpack::export_legacy(&client, &handle, DType::F32, &[3, 2]).unwrap();
    assert_eq!(exported.validate().unwrap().shape(), &[3, 2]);

    let other = CpuRuntime::client(1).unwrap();
    assert!(matches!(dlpack::export(&other, &handle, DType::U8, &[24]), Err(ServerError::ForeignHandle { .. })));
}

/// Memory lent for a scope (`Handle::lend_for_scope`, as comm's
/// `with_borrowed` marks it) is refused by both exports, through a clone
/// and a slice too, naming the owned forms: the consumer would keep its
/// address past the revoke. Marking a handle cohort allocated does
/// nothing, and adopted memory not so marked exports.
#[test]
fn memory_lent_for_a_scope_is_not_exported() {
    let client = client();
    let mut data = vec![0u128; 4];
    let memory = cohort_runtime::ForeignMemory::Host { ptr: data.as_mut_ptr().cast(), len: 64 };
    // SAFETY: `data` outlives every use of the handle (revoked below).
    let handle = unsafe { client.adopt(memory, Box::new(()), Access::ReadWrite) }.unwrap();
    assert!(dlpack::export(&client, &handle, DType::U8, &[64]).is_ok(), "not lent: exported");
    handle.lend_for_scope();
    let slice = handle.slice(16, 16).unwrap();
    for (what, handle, len) in [("the handle", &handle, 64), ("a slice", &slice, 16)] {
        for err in [
            error_of(dlpack::export(&client, handle, DType::U8, &[len])),
            error_of(dlpack::export_legacy(&client, handle, DType::U8, &[len])),
        ] {
            assert!(err.contains("only lent") && err.contains("Buffer::from_vec"), "{what}: {err}");
        }
    }
    client.revoke(&handle).unwrap();
    let own = client.create_from_slice(&[0u8; 8]);
    own.lend_for_scope();
    assert!(!own.is_lent());
    assert!(dlpack::export(&client, &own, DType::U8, &[8]).is_ok());
}

/// The DLPack device of a CPU client is `kDLCPU`; a wgpu client has none
/// (DLPack cannot carry a wgpu buffer), so it neither imports nor exports.
#[test]
fn dlpack_devices_of_clients() {
    assert_eq!(dlpack::dlpack_device(&client()).unwrap(), DLDevice::CPU);
    #[cfg(feature = "wgpu")]
    {
        use cohort_runtime::WgpuRuntime;
        let wgpu = WgpuRuntime::client(0).unwrap_or_else(|e| panic!("no wgpu device 0: {e}"));
        let err = dlpack::dlpack_device(&wgpu).unwrap_err().to_string();
        assert!(err.contains("cannot carry a wgpu buffer"), "{err}");
        let handle = wgpu.create_from_slice(&[0; 16]);
        let err = error_of(dlpack::export(&wgpu, &handle, DType::F32, &[4]));
        assert!(err.contains("cannot carry a wgpu buffer"), "{err}");
        let probe = Arc::new(Probe::default());
        let (tensor, _) = Spec::new(DLDataType::F32, &[4], vec![0; 16]).versioned(&probe);
        refusal(dlpack::import(&wgpu, tensor), &probe, &["a CPU tensor handed to wgpu:0"]);
    }
}
