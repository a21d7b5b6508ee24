//! CUDA foreign memory tests (written below).
