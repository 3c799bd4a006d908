//! CPU kernels. `reference` is the fp32 correctness oracle every faster kernel is tested against;
//! `f32` and `q8` are its SIMD twins (picked at run time by `dispatch`), `q8_gemm` the tiled
//! many-token Q8_0 kernel, `q4` the Q4_0/Q4_1 kernels, `half` the bf16/f16 ones, `elementwise` the row-wise ones
//! (norms, RoPE, SiLU, softmax) on the dispatched path, and `matmul` runs them over weight matrices on a thread pool.

pub mod aligned;
pub mod attention;
pub mod dispatch;
pub mod elementwise;
pub mod f32;
pub mod half;
pub mod matmul;
pub mod q4;
pub mod q8;
pub mod q8_gemm;
pub mod reference;
pub mod testdata;
