//! The CUDA backend (being written).
