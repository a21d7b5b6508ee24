//! Peer access between devices of one runtime: whether one device can
//! address another's memory, and sharing a buffer with the devices that can.

use std::collections::HashMap;
use std::sync::OnceLock;

use parking_lot::Mutex;

use super::Client;
use crate::error::ServerError;
use crate::handle::Handle;
use crate::id::ServiceId;

impl Client {
    /// Whether this client's device can address `other`'s memory directly
    /// (CUDA peer access over NVLink or PCIe). Asked of the driver once per
    /// pair of device openings and cached; `true` for the same device,
    /// `false` across runtimes and on backends without peer access. The
    /// first call for a pair waits for one task on this device's thread.
    pub fn can_access_peer(&self, other: &Client) -> bool {
        static KNOWN: OnceLock<Mutex<HashMap<(ServiceId, ServiceId), bool>>> = OnceLock::new();
        if self.name() != other.name() {
            return false;
        }
        if self.service_id() == other.service_id() {
            return true;
        }
        let key = (self.service_id(), other.service_id());
        let known = KNOWN.get_or_init(|| Mutex::new(HashMap::new()));
        if let Some(&answer) = known.lock().get(&key) {
            return answer;
        }
        let peer = other.device_id();
        let answer = self
            .device()
            .run(self.stream_id(), move |state| {
                state.backend.device_collectives().is_some_and(|dc| dc.can_access_peer(peer))
            })
            .unwrap_or(false);
        known.lock().insert(key, answer);
        answer
    }

    /// Lets every device of this runtime that can reach this device's memory
    /// address it (CUDA: `cuCtxEnablePeerAccess` in each such peer's
    /// context, once per device), and returns the handle to pass to them:
    /// peer copies from it (`to_client` in cohort-comm) then go device to
    /// device without the driver staging them. Waits for one task on this
    /// device's thread. Refuses a handle of another device; on backends
    /// without peer access it returns [`ServerError::Unsupported`].
    pub fn share_with_peers(&self, handle: &Handle) -> Result<Handle, ServerError> {
        self.check_owned(handle)?;
        let backend = self.name();
        self.device().run(self.stream_id(), move |state| match state.backend.device_collectives() {
            Some(dc) => dc.share_with_peers().map(|_| ()),
            None => Err(ServerError::Unsupported { feature: "peer access", backend }),
        })??;
        Ok(handle.clone())
    }
}
