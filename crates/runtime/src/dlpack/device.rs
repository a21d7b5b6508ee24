//! Which DLPack device a client is, and whether a tensor's device is the
//! client's.

use dlpark::ffi::{DLDevice, DLDeviceType};

use super::refused;
use crate::client::Client;
use crate::error::ServerError;
use crate::foreign::ForeignMemory;

/// The DLPack device of `client`'s memory: `kDLCPU` for a `cpu` client,
/// `kDLCUDA` with its GPU's ordinal for a `cuda` client (what
/// `__dlpack_device__` answers). A `wgpu` client is refused: a DLPack
/// tensor cannot carry a wgpu buffer.
pub fn dlpack_device(client: &Client) -> Result<DLDevice, ServerError> {
    match client.name() {
        "cpu" => Ok(DLDevice::CPU),
        "cuda" => {
            let gpu = client
                .properties()
                .gpu
                .ok_or_else(|| refused(format!("DLPack: {} does not say which GPU it runs on", client.device_id())))?;
            Ok(DLDevice::cuda(gpu as i32))
        }
        "wgpu" => Err(refused(format!(
            "DLPack cannot carry a wgpu buffer ({} is a wgpu device): use a CPU or CUDA client, or read the \
             buffer to the host",
            client.device_id()
        ))),
        other => Err(refused(format!("DLPack: the {other} backend has no DLPack device"))),
    }
}

/// The foreign memory that `len` bytes at `data` on `device` are for
/// `client`, or an error naming both when the tensor lives elsewhere.
pub(super) fn foreign_memory(
    client: &Client,
    device: DLDevice,
    data: *mut u8,
    len: usize,
) -> Result<ForeignMemory, ServerError> {
    let mismatch = || refused(format!("DLPack: {} handed to {}", tensor_device(device), client_device(client)));
    match device.device_type {
        DLDeviceType::CPU | DLDeviceType::CUDAHOST if client.name() == "cpu" => {
            Ok(ForeignMemory::Host { ptr: data, len })
        }
        #[cfg(feature = "cuda")]
        DLDeviceType::CUDA
            if client.name() == "cuda"
                && client.properties().gpu.is_some_and(|gpu| i64::from(gpu) == i64::from(device.device_id)) =>
        {
            Ok(ForeignMemory::Cuda { ptr: data as u64, len })
        }
        DLDeviceType::CPU | DLDeviceType::CUDAHOST | DLDeviceType::CUDA => Err(mismatch()),
        _ => Err(refused(format!(
            "DLPack: {} handed to {}: cohort takes CPU tensors (kDLCPU, kDLCUDAHost) on a cpu client and CUDA \
             tensors (kDLCUDA) on a cuda client of their GPU",
            tensor_device(device),
            client_device(client)
        ))),
    }
}

/// A tensor's device in words: "a CUDA tensor on GPU 1".
fn tensor_device(device: DLDevice) -> String {
    let id = device.device_id;
    match device.device_type {
        DLDeviceType::CPU => "a CPU tensor".to_string(),
        DLDeviceType::CUDA => format!("a CUDA tensor on GPU {id}"),
        DLDeviceType::CUDAHOST => "a CUDA pinned host tensor".to_string(),
        other => {
            let name = match other {
                DLDeviceType::OPENCL => "an OpenCL",
                DLDeviceType::VULKAN => "a Vulkan",
                DLDeviceType::METAL => "a Metal",
                DLDeviceType::VPI => "a VPI",
                DLDeviceType::ROCM => "a ROCm",
                DLDeviceType::ROCMHOST => "a ROCm pinned host",
                DLDeviceType::EXTDEV => "an extension-device",
                DLDeviceType::CUDAMANAGED => "a CUDA managed-memory",
                DLDeviceType::ONEAPI => "a oneAPI",
                DLDeviceType::WEBGPU => "a WebGPU",
                DLDeviceType::HEXAGON => "a Hexagon",
                DLDeviceType::MAIA => "a MAIA",
                DLDeviceType::TRN => "a Trainium",
                _ => "an unknown-device",
            };
            format!("{name} tensor (DLPack device type {}, id {id})", other.0)
        }
    }
}

/// A client's device in words: "cpu:0", "cuda:1 (GPU 0)".
fn client_device(client: &Client) -> String {
    match client.properties().gpu {
        Some(gpu) => format!("{} (GPU {gpu})", client.device_id()),
        None => client.device_id().to_string(),
    }
}
