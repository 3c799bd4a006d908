//! Row-wise kernels of the forward pass (RMSNorm, RoPE, SiLU·mul, softmax) on the dispatched
//! path.
//!
//! The reference functions are written as plain element-wise loops with fixed-width partial
//! sums and an `exp` made of ordinary f32 operations, so compiling the very same code with
//! AVX2 or AVX-512 enabled vectorizes it without changing a single result: vector and scalar
//! instructions round identically, and Rust never fuses a multiply and an add on its own. Each
//! twin here is that compilation, and the tests check the bits.

use super::dispatch::{Kernels, dispatched};
use super::reference;
#[cfg(test)]
use super::reference as r;

dispatched!(
    /// [`reference::rmsnorm`] on path `k`.
    rmsnorm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32])
);
dispatched!(
    /// [`reference::rmsnorm_inplace`] on path `k`.
    rmsnorm_inplace(x: &mut [f32], weight: &[f32], eps: f32)
);
dispatched!(
    /// [`reference::rope_rotate_half`] on path `k`.
    rope_rotate_half(x: &mut [f32], head_dim: usize, cos: &[f32], sin: &[f32])
);
dispatched!(
    /// [`reference::silu_mul`] on path `k`.
    silu_mul(gate: &mut [f32], up: &[f32])
);
dispatched!(
    /// [`reference::softmax`] on path `k`.
    softmax(x: &mut [f32])
);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cpu::dispatch::KernelPath;
    use crate::kernels::cpu::paths_run::PathsRun;
    use crate::kernels::cpu::testdata::noise;

    /// Lengths around the vector widths, and values that reach the clamps.
    fn inputs() -> Vec<Vec<f32>> {
        let mut v: Vec<Vec<f32>> = [1, 7, 16, 17, 64, 576, 1000]
            .iter()
            .map(|&n| noise(n, n as u64, 20.0))
            .collect();
        v.push(vec![-1e30, 0.0, 1e30, -88.5, 88.5, -0.0, 1e-30, f32::MIN_POSITIVE]);
        v
    }

    #[test]
    fn every_path_gives_the_reference_bits() {
        let mut paths = PathsRun::new("kernels::cpu::elementwise::tests::every_path_gives_the_reference_bits");
        for k in Kernels::all_supported() {
            paths.record(k.path());
            for x in inputs() {
                let n = x.len();
                let (mut a, mut b) = (x.clone(), x.clone());
                r::softmax(&mut a);
                softmax(k, &mut b);
                assert_eq!(a, b, "softmax {} n={n}", k.path());
                let up = noise(n, 3, 1.0);
                let (mut a, mut b) = (x.clone(), x.clone());
                r::silu_mul(&mut a, &up);
                silu_mul(k, &mut b, &up);
                assert_eq!(a, b, "silu {} n={n}", k.path());
                if n % 2 == 0 {
                    let (cos, sin) = (noise(n / 2, 4, 1.0), noise(n / 2, 5, 1.0));
                    let (mut a, mut b) = (x.clone(), x.clone());
                    r::rope_rotate_half(&mut a, n, &cos, &sin);
                    rope_rotate_half(k, &mut b, n, &cos, &sin);
                    assert_eq!(a, b, "rope {} n={n}", k.path());
                }
                let w = noise(n, 6, 1.0);
                let (mut a, mut b) = (vec![0f32; n], vec![0f32; n]);
                r::rmsnorm(&x, &w, 1e-5, &mut a);
                rmsnorm(k, &x, &w, 1e-5, &mut b);
                assert_eq!(a, b, "rmsnorm {} n={n}", k.path());
                let (mut a, mut b) = (x.clone(), x.clone());
                r::rmsnorm_inplace(&mut a, &w, 1e-5);
                rmsnorm_inplace(k, &mut b, &w, 1e-5);
                assert_eq!(a, b, "rmsnorm_inplace {} n={n}", k.path());
            }
        }
        paths.check(&KernelPath::ALL);
    }

    #[test]
    fn exp_is_within_a_few_ulp_and_softmax_sums_to_one() {
        let mut worst = 0f64;
        for i in 0..=200_000 {
            let x = -87.0 + 175.0 * i as f32 / 200_000.0;
            let want = (x as f64).exp();
            let got = r::exp(x) as f64;
            worst = worst.max(((got - want) / want).abs());
        }
        // 2^-23 ≈ 1.2e-7 is one ulp.
        assert!(worst < 4.0 * 1.2e-7, "worst relative error {worst:e}");
        assert_eq!(r::exp(0.0), 1.0);
        assert!(r::exp(-1e30) > 0.0 && r::exp(1e30).is_finite());
        let mut x = noise(100, 9, 30.0);
        softmax(Kernels::detect(), &mut x);
        let sum: f32 = x.iter().sum();
        assert!((sum - 1.0).abs() < 1e-5 && x.iter().all(|&p| (0.0..=1.0).contains(&p)));
    }

    /// `exp` builds `2^n` from float bits; it must give the bits the integer cast gave (the
    /// fixtures' logits and every cached result were made with that).
    #[test]
    fn exp_scales_by_the_same_power_of_two_as_the_integer_cast() {
        let by_cast = |x: f32| {
            let x = x.clamp(-87.0, 88.0);
            let n = (x * std::f32::consts::LOG2_E + 0.5).floor();
            let r = x - n * (355.0 / 512.0) - n * -2.121_944_4e-4;
            let mut p = 1.0 / 5040.0;
            for c in [1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
                p = p * r + c;
            }
            p * f32::from_bits(((n as i32 + 127) as u32) << 23)
        };
        for i in 0..=400_000 {
            let x = -100.0 + 200.0 * i as f32 / 400_000.0;
            assert_eq!(r::exp(x).to_bits(), by_cast(x).to_bits(), "x = {x}");
        }
        for x in [
            f32::MIN,
            -87.0,
            -86.999,
            87.999,
            88.0,
            f32::MAX,
            f32::INFINITY,
            f32::NEG_INFINITY,
        ] {
            assert_eq!(r::exp(x).to_bits(), by_cast(x).to_bits(), "x = {x}");
        }
        assert!(r::exp(f32::NAN).is_nan());
    }
}
