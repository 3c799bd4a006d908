//! Compute kernels, one module per backend.

pub mod cpu;
pub mod cuda;
