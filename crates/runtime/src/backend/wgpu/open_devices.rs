//! The wgpu devices open in this process, cohort's own and adopted ones
//! (`WgpuRuntime::adopt`): how `WgpuRuntime::device_and_queue` finds a
//! client's device and queue, and how adopting a device twice finds the
//! first adoption. An entry lives as long as the backend on its device
//! (registered when the `Gpu` is made, removed when it drops), so cohort
//! keeps nothing of an adopted device once its client is closed.

use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use crate::error::ServerError;

use super::adapter::{enumerated_devices, ErrorScopes};

/// One open device.
struct OpenDevice {
    serial: u64,
    index: usize,
    device: wgpu::Device,
    queue: wgpu::Queue,
}

static OPEN: Mutex<Vec<OpenDevice>> = Mutex::new(Vec::new());

/// Numbers the entries of [`OPEN`].
static NEXT_SERIAL: AtomicU64 = AtomicU64::new(1);

/// Device indexes given to adopted devices so far (the next is the
/// enumerated devices' count plus this).
static ADOPTED_SO_FAR: AtomicU64 = AtomicU64::new(0);

/// A device the caller made, to adopt: found in [`OPEN`] (adopted before,
/// or cohort's own) or registered there under a new index.
pub(crate) struct Adoption {
    pub index: usize,
    pub serial: u64,
    /// Whether this call registered it (to forget if opening fails).
    pub new: bool,
}

/// The index (and entry) `device` has or gets: the one it was opened or
/// adopted under while that backend lives; otherwise a new index after
/// every enumerated device (and every earlier adoption). Adopting the same
/// device with another queue is refused.
pub(crate) fn adoption(device: &wgpu::Device, queue: &wgpu::Queue) -> Result<Adoption, ServerError> {
    let mut open = OPEN.lock();
    if let Some(entry) = open.iter().rev().find(|e| same_device(&e.device, device)) {
        if entry.queue != *queue {
            return Err(ServerError::InvalidArgument(format!(
                "this wgpu device is open as wgpu:{} with another queue: pass the queue `request_device` returned with the device",
                entry.index
            )));
        }
        return Ok(Adoption { index: entry.index, serial: entry.serial, new: false });
    }
    // With no adapter of cohort's own (another backend than the caller's,
    // say) the adopted devices are numbered from 0.
    let index = enumerated_devices() + ADOPTED_SO_FAR.fetch_add(1, Ordering::Relaxed) as usize;
    let serial = NEXT_SERIAL.fetch_add(1, Ordering::Relaxed);
    open.push(OpenDevice { serial, index, device: device.clone(), queue: queue.clone() });
    Ok(Adoption { index, serial, new: true })
}

/// Whether `a` and `b` are one device. wgpu compares devices by their id
/// alone, which the devices of different `wgpu::Instance`s share (each
/// instance numbers its own from the start: cohort's first device and a
/// caller's have the same id), so equal ids are probed: an error made on
/// `b` inside a scope pushed on each reaches `a`'s scope only when they are
/// one device (error scopes belong to the device object, per thread). The
/// error (a buffer without usages) goes nowhere else.
fn same_device(a: &wgpu::Device, b: &wgpu::Device) -> bool {
    if a != b {
        return false;
    }
    // Every kind of error is caught on both sides (a lost device may
    // report another kind), so none reaches a handler.
    let on_b = ErrorScopes::push(b);
    let on_a = ErrorScopes::push(a);
    drop(b.create_buffer(&wgpu::BufferDescriptor {
        label: Some("cohort device identity probe"),
        size: 4,
        usage: wgpu::BufferUsages::empty(),
        mapped_at_creation: false,
    }));
    let reached_a = !on_a.pop().is_empty();
    on_b.pop();
    reached_a
}

/// Registers a device cohort opened as device `index`: its entry's serial.
pub(crate) fn register(index: usize, device: &wgpu::Device, queue: &wgpu::Queue) -> u64 {
    let serial = NEXT_SERIAL.fetch_add(1, Ordering::Relaxed);
    OPEN.lock().push(OpenDevice { serial, index, device: device.clone(), queue: queue.clone() });
    serial
}

/// Forgets entry `serial`: its backend is gone, or its adoption could not
/// be opened.
pub(crate) fn unregister(serial: u64) {
    OPEN.lock().retain(|e| e.serial != serial);
}

/// The device and queue of an adopted device `index` still open (to open
/// it again for `WgpuRuntime::client`), with its entry's serial.
pub(crate) fn adopted(index: usize) -> Option<(wgpu::Device, wgpu::Queue, u64)> {
    if index < enumerated_devices() {
        return None;
    }
    OPEN.lock().iter().rev().find(|e| e.index == index).map(|e| (e.device.clone(), e.queue.clone(), e.serial))
}

/// The device and queue of open device `index` (cohort's own or adopted).
pub(crate) fn device_and_queue(index: usize) -> Option<(wgpu::Device, wgpu::Queue)> {
    OPEN.lock().iter().rev().find(|e| e.index == index).map(|e| (e.device.clone(), e.queue.clone()))
}
