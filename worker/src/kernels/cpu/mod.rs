//! CPU kernels. `reference` is the fp32 correctness oracle every faster kernel is tested against.

pub mod reference;
