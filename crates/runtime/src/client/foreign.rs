//! Adopting foreign memory: [`Client::adopt`] and what gives it back
//! ([`Client::reclaim`], [`Client::revoke`]), and [`Client::device_address`]
//! (see the `foreign` module).

use std::any::Any;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use parking_lot::Mutex;

use super::Client;
use crate::error::ServerError;
use crate::foreign::{Access, AdoptError, Adopted, Fences, ForeignMemory, ForeignOwner};
use crate::handle::Handle;
use crate::state::DeviceState;

impl Client {
    /// Names `memory`, which cohort did not allocate, with a [`Handle`] of
    /// this device, without a copy: every call and collective then takes it
    /// as it takes cohort's own buffers (clones and [`Handle::slice`]s
    /// included). Nothing is allocated: [`Client::memory_usage`] does not
    /// change.
    ///
    /// The memory is checked, and registered as a page of the device's
    /// storage that no memory pool sees, by a task on the device (run on
    /// the calling thread where the device is idle); this waits for it, and
    /// so for the work queued on the device before it. Refused, with an
    /// error naming the problem, before anything else is queued: zero
    /// bytes; memory of another backend; on the CPU a null or not 16-byte
    /// aligned pointer (kernels and host-staged collectives view memory as
    /// elements of any type in place); on CUDA memory of another context or
    /// GPU, host memory, or a range past its allocation; on wgpu a buffer
    /// of another device, without `STORAGE | COPY_SRC | COPY_DST`, or an
    /// offset or length the device cannot bind; a closed device. A refusal
    /// loses nothing: the [`AdoptError`] gives `memory` and `owner` back
    /// as they were given (converting it into its [`ServerError`] with `?`
    /// drops them).
    ///
    /// `owner` is kept with the memory: when the last clone of the handle
    /// is dropped, the device forgets the memory (it never frees it) and
    /// `owner` is dropped once the work queued on the memory until then
    /// (on each stream that queued some) has finished: by that drop itself,
    /// on its thread, where the device is idle and that work is over
    /// (always on an idle CPU device), else by the device's thread, which
    /// the drop never waits for (on a closed device, at once: its work is
    /// over). Take it back sooner with [`Client::reclaim`]; end a borrow with
    /// [`Client::revoke`]. [`Access::ReadOnly`] memory is refused as the
    /// destination of writes, kernel launches and collectives
    /// ([`Handle::access`]).
    ///
    /// # Safety
    /// `memory` must be valid for its whole length, for reads and (unless
    /// `access` is read-only) writes by the device, for as long as `owner`
    /// lives; nobody may free it meanwhile, nor access it while cohort's
    /// queued work on it runs. A wgpu buffer must come from this client's
    /// `wgpu::Instance` (its device, or the device it adopted with
    /// `WgpuRuntime::adopt`): wgpu names buffers by ids of their instance,
    /// and one of another instance is refused where this instance has no
    /// such id, but may name one of this instance's buffers otherwise.
    pub unsafe fn adopt(
        &self,
        memory: ForeignMemory,
        owner: ForeignOwner,
        access: Access,
    ) -> Result<Handle, AdoptError> {
        let size = memory.len();
        if size == 0 {
            let error = ServerError::InvalidArgument(format!(
                "adopting {} of 0 bytes: there is nothing to share; make an empty cohort buffer instead",
                memory.kind()
            ));
            return Err(AdoptError::new(error, memory, owner));
        }
        let stream = self.stream_id();
        let offset = memory.page_offset();
        // The memory stays here while the task looks at it, so a refusal
        // (or a device that never runs the task) gives it back.
        let shared = Mutex::new(memory);
        let registered = self.device().run_inline_or_wait(stream, |state: &mut DeviceState| {
            let page = state.backend.storage().adopt_page(&shared.lock())?;
            Ok::<_, ServerError>((page, state.foreign.queue()))
        });
        let (page, releases) = match registered.and_then(|registered| registered) {
            Ok(registered) => registered,
            Err(error) => return Err(AdoptError::new(error, shared.into_inner(), owner)),
        };
        let adopted = Adopted::new(access, page, offset, owner, releases, Arc::downgrade(&self.device));
        Ok(Handle::adopted(self.service_id(), stream, size, adopted))
    }

    /// Takes adopted memory back from its last handle: waits for the work
    /// queued on the memory so far (on each stream that queued some),
    /// forgets the memory, and returns its owner (a `Vec` taken back whole:
    /// a round trip without a copy). Refused, with the handle given back,
    /// for a handle cohort allocated, one of another device, and while
    /// other clones of it live (slices, graphs or queued tasks holding one
    /// count; those queued before this call have run by the time it looks).
    /// On a device closed since (its work ended), the last handle gives its
    /// owner back at once.
    pub fn reclaim(&self, handle: Handle) -> Result<ForeignOwner, (Handle, ServerError)> {
        self.reclaim_owner(handle, &Wanted { is: |_| true, name: "" })
    }

    /// [`Client::reclaim`] for an owner of type `O`, given back unboxed (a
    /// `Vec<f32>` adopted as the owner comes back as one). An owner of
    /// another type is refused as the rest is, the handle given back and
    /// nothing forgotten: ask again with the type it was adopted with.
    pub fn reclaim_as<O: Any>(&self, handle: Handle) -> Result<O, (Handle, ServerError)> {
        let wanted = Wanted { is: |owner| owner.is::<O>(), name: std::any::type_name::<O>() };
        let owner = self.reclaim_owner(handle, &wanted)?;
        Ok(*owner.downcast::<O>().expect("the owner taken was checked to be an O"))
    }

    /// [`Client::reclaim`], taking the owner only where it is `wanted`.
    fn reclaim_owner(&self, handle: Handle, wanted: &Wanted) -> Result<ForeignOwner, (Handle, ServerError)> {
        if let Err(err) = self.check_owned(&handle).and_then(|()| Self::adopted_only(&handle, "reclaim")) {
            return Err((handle, err));
        }
        let stream = self.stream_id();
        // The handle stays here while the task looks at it (it holds one
        // count), so it comes back whatever the task does.
        let shared = Mutex::new(handle);
        let taken = self.device().run_inline_or_wait(stream, |state: &mut DeviceState| {
            let handle = shared.lock();
            let others = Arc::strong_count(&handle.alloc) - 1;
            if others > 0 {
                return Err(ServerError::InvalidState {
                    operation: "reclaim",
                    reason: format!(
                        "{others} other clone(s) of this handle still live (slices, graphs, queued work); drop \
                         them first, or end the borrow with revoke"
                    ),
                });
            }
            let adopted = handle.alloc.foreign.as_ref().expect("checked adopted");
            let owner = wanted.take(adopted)?;
            Ok((owner, forget(state, adopted)))
        });
        let handle = shared.into_inner();
        // A device closed after its work ended: nothing runs on the memory
        // any more, and its storage is gone; the owner is the caller's.
        let taken = match taken {
            Err(ServerError::DeviceClosed { .. }) if Self::closed_and_unshared(&handle) => {
                let adopted = handle.alloc.foreign.as_ref().expect("checked adopted");
                let owner = wanted.take(adopted);
                if owner.is_ok() {
                    adopted.given_back.store(true, Ordering::Release);
                }
                return owner.map_err(|err| (handle, err));
            }
            taken => taken,
        };
        match taken.and_then(|taken| taken) {
            Ok((owner, fences)) => {
                // Its page forgotten and its owner taken: dropping it
                // releases nothing.
                drop(handle);
                for fence in fences {
                    // A failed device runs nothing more on the memory.
                    let _ = fence.wait();
                }
                Ok(owner)
            }
            Err(err) => Err((handle, err)),
        }
    }

    /// Ends the use of adopted memory now, for a scoped borrow: the device
    /// forgets it (any clone used later gets an error saying the memory was
    /// given back, never a dangling access), and this returns once the work
    /// queued on the memory so far (on each stream that queued some) has
    /// finished. The owner is dropped when the last clone goes. Ordered on
    /// the device after every task queued before it (a collective's part
    /// waiting for its peers included). Refused for a handle cohort
    /// allocated or of another device; a second revoke is a no-op.
    pub fn revoke(&self, handle: &Handle) -> Result<(), ServerError> {
        self.check_owned(handle)?;
        Self::adopted_only(handle, "revoke")?;
        let adopted = handle.alloc.foreign.as_ref().expect("checked adopted");
        let fences =
            self.device().run_inline_or_wait(self.stream_id(), |state: &mut DeviceState| forget(state, adopted))?;
        for fence in fences {
            let _ = fence.wait();
        }
        // Nothing runs on the memory any more, and nothing can be queued
        // on it: its release waits for nothing.
        adopted.settled();
        Ok(())
    }

    /// The address of the handle's first byte outside cohort: the host
    /// pointer on the CPU, the `CUdeviceptr` on CUDA (for DLPack export).
    /// Waits for the handle's reservation (work queued before this call);
    /// an error on wgpu, whose buffers have no address, and for memory
    /// given back.
    pub fn device_address(&self, handle: &Handle) -> Result<u64, ServerError> {
        self.check_owned(handle)?;
        let handle = handle.clone();
        let backend = self.name();
        self.device().run_inline_or_wait(self.stream_id(), move |state: &mut DeviceState| {
            let binding = state.binding(&handle)?;
            state.backend.address(binding).ok_or(ServerError::Unsupported { feature: "device addresses", backend })
        })?
    }

    /// Whether `handle` is the last of its adopted memory and its device
    /// closed with its work ended (see [`Client::reclaim`]).
    fn closed_and_unshared(handle: &Handle) -> bool {
        let adopted = handle.alloc.foreign.as_ref().expect("checked adopted");
        Arc::strong_count(&handle.alloc) == 1 && adopted.device_closed()
    }

    /// Refuses a handle cohort allocated for `operation`.
    fn adopted_only(handle: &Handle, operation: &'static str) -> Result<(), ServerError> {
        if !handle.is_foreign() {
            return Err(ServerError::InvalidArgument(format!(
                "{operation} takes a handle of adopted memory (Client::adopt); this one was allocated by cohort"
            )));
        }
        Ok(())
    }
}

/// The owner [`Client::reclaim`] may take.
struct Wanted {
    is: fn(&(dyn Any + Send)) -> bool,
    /// The type asked for, for the refusal.
    name: &'static str,
}

impl Wanted {
    /// Takes the owner of `adopted` if it is the one wanted; else leaves
    /// it there, refused.
    fn take(&self, adopted: &Adopted) -> Result<ForeignOwner, ServerError> {
        let mut slot = adopted.owner.lock();
        match slot.take() {
            Some(owner) if (self.is)(&*owner) => Ok(owner),
            Some(owner) => {
                *slot = Some(owner);
                Err(ServerError::InvalidArgument(format!(
                    "reclaim: the owner of this memory is not a {}: ask for the type it was adopted with",
                    self.name
                )))
            }
            None => Err(ServerError::InvalidState {
                operation: "reclaim",
                reason: "this memory's owner was already taken back".into(),
            }),
        }
    }
}

/// Has the storage forget the `adopted` page (once: later binds of any
/// clone fail) and returns fences after the work queued so far on the
/// streams that used it.
fn forget(state: &mut DeviceState, adopted: &Adopted) -> Fences {
    if !adopted.given_back.swap(true, Ordering::AcqRel) {
        state.backend.storage().free_page(adopted.page);
    }
    adopted.fences(state.backend.as_mut())
}
