//! The runtime trait every backend implements: how many devices, and a
//! client for each.

use crate::client::Client;
use crate::error::ServerError;

/// A backend's entry point.
pub trait Runtime: Send + Sync + 'static {
    /// The backend's name: "cpu", "cuda", "wgpu".
    const NAME: &'static str;

    /// How many devices this backend sees; an error says why it sees none
    /// (no driver, a bad setting).
    fn device_count() -> Result<usize, ServerError>;

    /// The client of device `index`, starting its server thread on first use.
    fn client(index: usize) -> Result<Client, ServerError>;

    /// A client for every device.
    fn clients() -> Result<Vec<Client>, ServerError> {
        (0..Self::device_count()?).map(Self::client).collect()
    }
}

/// Clients for the first `count` devices (every device when `None`) of the
/// backend named `backend`: "cpu", "cuda" or "wgpu" (the latter two where
/// their cargo features are built). An unknown name, a backend with no
/// devices, or more devices than it has are errors that say which.
pub fn clients_of(backend: &str, count: Option<usize>) -> Result<Vec<Client>, ServerError> {
    clients_from(backend, 0, count)
}

/// Clients for `count` devices of `backend` starting at device `first`
/// (every device from `first` when `None`): one process per GPU opens only
/// its own (`first` = its local rank). Only those devices are opened. Errors
/// as [`clients_of`], and when the range runs past the last device.
pub fn clients_from(backend: &str, first: usize, count: Option<usize>) -> Result<Vec<Client>, ServerError> {
    fn range<R: Runtime>(first: usize, count: Option<usize>, hint: &str) -> Result<Vec<Client>, ServerError> {
        let available = R::device_count()?;
        let n = count.unwrap_or(available.saturating_sub(first));
        if n == 0 || first + n > available {
            return Err(ServerError::InvalidArgument(format!(
                "{n} {} device(s) asked for from device {first}; the backend has {available} ({hint})",
                R::NAME
            )));
        }
        (first..first + n).map(R::client).collect()
    }
    match backend {
        "cpu" => range::<crate::CpuRuntime>(first, count, "set COHORT_CPU_DEVICES for more"),
        #[cfg(feature = "wgpu")]
        "wgpu" => range::<crate::WgpuRuntime>(
            first,
            count,
            "set COHORT_WGPU_DEVICES=N to open N devices on the first adapter",
        ),
        #[cfg(feature = "cuda")]
        "cuda" => range::<crate::CudaRuntime>(first, count, "one per GPU"),
        other => Err(ServerError::InvalidArgument(format!(
            "unknown or unbuilt backend {other:?}: use cpu, wgpu or cuda (the latter two need their cargo features)"
        ))),
    }
}
