//! Recognising cohort's own exports when they come back: the context every
//! [`export`](super::export) installs in its tensor, and a registry of the
//! contexts alive, so that [`import`](super::import) hands back a slice of
//! the exported handle (the same allocation, which cohort's overlap checks
//! compare) instead of a second, unrelated handle over the same bytes.
//!
//! A tensor is recognised by its `manager_ctx` pointer alone: a registered
//! address is an [`Exported`] that is alive (it leaves the registry before
//! it is freed), whatever the tensor's other fields say. The deleter's
//! function pointer is no proof (dlpark's deleter is generic, and Rust may
//! give one instantiation several addresses), so it is not compared.

use std::collections::BTreeSet;
use std::ffi::c_void;

use parking_lot::Mutex;

use crate::handle::Handle;

/// The addresses of the [`Exported`] contexts alive.
static EXPORTED: Mutex<BTreeSet<usize>> = Mutex::new(BTreeSet::new());

/// The context of a tensor cohort exported: a clone of the handle, which
/// keeps the memory reserved until the tensor's deleter drops it.
pub(super) struct Exported {
    handle: Handle,
}

impl Exported {
    /// A registered context holding `handle`, boxed: the box's address is
    /// the tensor's `manager_ctx` (dlpark's `Box` context keeps it), and the
    /// registry's key until the box is dropped.
    pub(super) fn new(handle: Handle) -> Box<Exported> {
        let exported = Box::new(Exported { handle });
        EXPORTED.lock().insert(exported.address());
        exported
    }

    fn address(&self) -> usize {
        std::ptr::from_ref(self).addr()
    }
}

impl Drop for Exported {
    /// Leaves the registry before the context is freed. It runs in place,
    /// inside the box (dlpark's deleter drops the `Box`), so `self` is at
    /// the registered address.
    fn drop(&mut self) {
        EXPORTED.lock().remove(&self.address());
    }
}

/// The handle a tensor whose `manager_ctx` is `context` was exported
/// from, where cohort exported it (and the tensor was not deleted yet);
/// `None` for any other producer's tensor. Never reads through `context`
/// unless it is registered.
pub(super) fn exported_handle(context: *mut c_void) -> Option<Handle> {
    let registry = EXPORTED.lock();
    if !registry.contains(&context.addr()) {
        return None;
    }
    // SAFETY: a registered address is a live `Exported` (`new` registers
    // its box; its `Drop` unregisters it under this lock before the box is
    // freed), and the lock held here keeps that `Drop` from finishing
    // until the clone below is made. The context is only read.
    let exported = unsafe { &*context.cast::<Exported>() };
    Some(exported.handle.clone())
}
