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
