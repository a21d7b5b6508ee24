//! The wgpu backend (being written).
