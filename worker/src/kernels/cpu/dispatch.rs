//! Runtime choice of the SIMD code path, detected once from the CPU's features.
//!
//! A [`Kernels`] value can only be made for a path this CPU supports, which is what makes the
//! safe dispatching functions sound: every `#[target_feature]` function they call is guarded by it.

use std::sync::OnceLock;

/// A family of kernel implementations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum KernelPath {
    /// Portable Rust, no `target_feature`.
    Scalar,
    /// AVX2 + FMA: 256-bit f32, Q8_0 through `vpmaddubsw`.
    Avx2,
    /// AVX2 + AVX-VNNI (the 256-bit VEX `vpdpbusd` of CPUs without AVX-512, e.g. Alder Lake):
    /// Q8_0 through `vpdpbusd`, everything else as AVX2.
    AvxVnni,
    /// AVX-512 F/BW/VL: 512-bit f32; Q8_0 as AVX2.
    Avx512,
    /// AVX-512 with VNNI: Q8_0 through `vpdpbusd`.
    Avx512Vnni,
}

impl KernelPath {
    /// Every path, slowest first.
    pub const ALL: [KernelPath; 5] = [Self::Scalar, Self::Avx2, Self::AvxVnni, Self::Avx512, Self::Avx512Vnni];

    /// The name reported in logs and benchmarks.
    pub fn name(self) -> &'static str {
        match self {
            Self::Scalar => "scalar",
            Self::Avx2 => "avx2",
            Self::AvxVnni => "avx-vnni",
            Self::Avx512 => "avx512",
            Self::Avx512Vnni => "avx512-vnni",
        }
    }

    /// Whether this CPU can run the path.
    pub fn is_supported(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            // F16C (16-bit float conversion) came with AVX2 on every x86 CPU; the half-float kernels use it.
            let avx2 = std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
                && std::arch::is_x86_feature_detected!("f16c");
            let avx512 = avx2
                && std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bw")
                && std::arch::is_x86_feature_detected!("avx512vl");
            match self {
                Self::Scalar => true,
                Self::Avx2 => avx2,
                Self::AvxVnni => avx2 && std::arch::is_x86_feature_detected!("avxvnni"),
                Self::Avx512 => avx512,
                Self::Avx512Vnni => avx512 && std::arch::is_x86_feature_detected!("avx512vnni"),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            self == Self::Scalar
        }
    }
}

impl std::fmt::Display for KernelPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Errors choosing a kernel path.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DispatchError {
    #[error("kernel path {0} is not supported by this CPU")]
    Unsupported(KernelPath),
    #[error("unknown kernel path {0:?} (expected scalar, avx2, avx-vnni, avx512 or avx512-vnni)")]
    Unknown(String),
}

impl std::str::FromStr for KernelPath {
    type Err = DispatchError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| DispatchError::Unknown(s.to_string()))
    }
}

/// A kernel path checked against this CPU; see the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Kernels {
    path: KernelPath,
}

impl Kernels {
    /// The fastest path this CPU supports (detected once).
    pub fn detect() -> Self {
        static BEST: OnceLock<KernelPath> = OnceLock::new();
        let path = *BEST.get_or_init(|| {
            let best = KernelPath::ALL
                .into_iter()
                .rev()
                .find(|p| p.is_supported())
                .unwrap_or(KernelPath::Scalar);
            tracing::info!(kernel_path = best.name(), "CPU kernel path");
            best
        });
        Self { path }
    }

    /// A specific path, if this CPU supports it.
    pub fn with_path(path: KernelPath) -> Result<Self, DispatchError> {
        if path.is_supported() {
            Ok(Self { path })
        } else {
            Err(DispatchError::Unsupported(path))
        }
    }

    /// Every path this CPU supports (tests run each of them).
    pub fn all_supported() -> Vec<Self> {
        KernelPath::ALL
            .into_iter()
            .filter_map(|p| Self::with_path(p).ok())
            .collect()
    }

    /// The chosen path.
    pub fn path(self) -> KernelPath {
        self.path
    }
}

impl Default for Kernels {
    fn default() -> Self {
        Self::detect()
    }
}

/// Define `$name(k, args..)`, which runs `reference::$name` (the `reference` in scope where
/// it is invoked) compiled for the path `k` names. Plain element-wise f32 code compiled with
/// AVX2 or AVX-512 enabled rounds exactly as the scalar code does, so each twin gives the
/// reference's bits.
macro_rules! dispatched {
    ($(#[$doc:meta])* $name:ident($($arg:ident: $ty:ty),*)) => {
        $(#[$doc])*
        #[allow(clippy::too_many_arguments)]
        pub fn $name(k: Kernels, $($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            {
                use $crate::kernels::cpu::dispatch::KernelPath;
                #[allow(clippy::too_many_arguments)]
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2($($arg: $ty),*) {
                    reference::$name($($arg),*)
                }
                #[allow(clippy::too_many_arguments)]
                #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
                unsafe fn avx512($($arg: $ty),*) {
                    reference::$name($($arg),*)
                }
                match k.path() {
                    // SAFETY: `Kernels` is only made for paths the CPU supports.
                    KernelPath::Avx2 | KernelPath::AvxVnni => return unsafe { avx2($($arg),*) },
                    // SAFETY: as above.
                    KernelPath::Avx512 | KernelPath::Avx512Vnni => return unsafe { avx512($($arg),*) },
                    KernelPath::Scalar => {}
                }
            }
            let _ = k;
            reference::$name($($arg),*)
        }
    };
}
pub(crate) use dispatched;
