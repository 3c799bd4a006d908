//! One GPU as this process sees it: the driver (checked before first use, so a host without
//! one gets a clear error rather than a panic), a context and stream on the chosen GPU, and
//! the embedded kernels loaded for its compute capability.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::CUdevice_attribute;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, DeviceRepr, DriverError, ValidAsZeroBits,
};
use cudarc::nvrtc::Ptx;

use crate::kernels::cuda::embedded::MODULES;

/// Why a GPU cannot be used.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum CudaError {
    #[error("no NVIDIA driver on this host (libcuda.so was not found): install the NVIDIA driver, or use --device cpu")]
    NoDriver,
    #[error("GPU cuda:{gpu} does not exist: this host has {count} CUDA device(s)")]
    NoDevice { gpu: u32, count: i32 },
    #[error("CUDA driver error ({what}): {reason}")]
    Driver { what: &'static str, reason: String },
    #[error("loading the '{module}' kernels on a GPU of compute capability {sm}: {reason}")]
    Module {
        module: &'static str,
        sm: u32,
        reason: String,
    },
}

impl CudaError {
    fn driver(what: &'static str) -> impl FnOnce(DriverError) -> CudaError {
        move |e| CudaError::Driver {
            what,
            reason: e.to_string(),
        }
    }
}

/// What a worker registers about its GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuInfo {
    pub ordinal: u32,
    pub name: String,
    pub total_bytes: usize,
    pub free_bytes: usize,
    pub multiprocessors: u32,
    /// Compute capability as `10 × major + minor` (90 for an H100/H200, 86 for an RTX 3090).
    pub sm: u32,
}

/// The driver is there (checked without touching it otherwise).
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the driver library.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// A context on GPU `ordinal` and what the GPU is, after checking the driver and the ordinal.
fn context(ordinal: u32) -> Result<(Arc<CudaContext>, GpuInfo), CudaError> {
    if !driver_present() {
        return Err(CudaError::NoDriver);
    }
    let count = CudaContext::device_count().map_err(CudaError::driver("counting devices"))?;
    if ordinal as i32 >= count {
        return Err(CudaError::NoDevice { gpu: ordinal, count });
    }
    let ctx = CudaContext::new(ordinal as usize).map_err(CudaError::driver("creating a context"))?;
    let (major, minor) = ctx
        .compute_capability()
        .map_err(CudaError::driver("reading the compute capability"))?;
    let (free_bytes, total_bytes) = ctx.mem_get_info().map_err(CudaError::driver("reading memory"))?;
    let info = GpuInfo {
        ordinal,
        name: ctx.name().map_err(CudaError::driver("reading the name"))?,
        total_bytes,
        free_bytes,
        multiprocessors: ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(CudaError::driver("reading the multiprocessor count"))? as u32,
        sm: (major * 10 + minor) as u32,
    };
    Ok((ctx, info))
}

/// What GPU `ordinal` is (name, memory, multiprocessors, compute capability), without loading
/// any kernel: what a worker registers before it is given layers.
pub fn describe(ordinal: u32) -> Result<GpuInfo, CudaError> {
    context(ordinal).map(|(_, info)| info)
}

/// A GPU with a context, a stream and every kernel loaded.
pub struct Gpu {
    pub info: GpuInfo,
    pub stream: Arc<CudaStream>,
    functions: HashMap<&'static str, CudaFunction>,
    /// The first error a launch or copy met; reported by the backend after the call that met
    /// it (CUDA errors are sticky, so later work is suspect anyway).
    error: Mutex<Option<String>>,
    /// Kernel timing (a diagnostic): each launch records events around itself.
    timing: AtomicBool,
    timings: Mutex<Vec<(&'static str, CudaEvent, CudaEvent)>>,
    /// Driver calls made through [`check`](Self::check) (launches, copies, allocations): what
    /// [`mark`](Self::mark) reads.
    calls: AtomicU64,
}

/// GPU time of one kernel over the launches timed.
#[derive(Debug, Clone, PartialEq)]
pub struct KernelTime {
    pub kernel: &'static str,
    pub launches: usize,
    pub ms: f64,
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu").field("info", &self.info).finish_non_exhaustive()
    }
}

impl Gpu {
    /// Open GPU `ordinal` and load the kernels for it.
    pub fn open(ordinal: u32) -> Result<Self, CudaError> {
        let (ctx, info) = context(ordinal)?;
        let sm = info.sm;
        let mut functions = HashMap::new();
        for module in MODULES {
            let image = match module.cubin_for(sm) {
                Some(cubin) => Ptx::from_binary(cubin.to_vec()),
                None => Ptx::from_src(module.ptx),
            };
            let loaded = ctx.load_module(image).map_err(|e| CudaError::Module {
                module: module.name,
                sm,
                reason: e.to_string(),
            })?;
            for name in kernel_names(module.ptx) {
                let f = loaded.load_function(name).map_err(|e| CudaError::Module {
                    module: module.name,
                    sm,
                    reason: format!("{name}: {e}"),
                })?;
                functions.insert(name, f);
            }
        }
        Ok(Self {
            info,
            stream: ctx.default_stream(),
            functions,
            error: Mutex::new(None),
            timing: AtomicBool::new(false),
            timings: Mutex::new(Vec::new()),
            calls: AtomicU64::new(0),
        })
    }

    /// A loaded kernel. Names come from this crate's own sources, so a missing one is a
    /// build defect; it is recorded as an error rather than panicking.
    pub fn function(&self, name: &'static str) -> Option<&CudaFunction> {
        let f = self.functions.get(name);
        if f.is_none() {
            self.record(format!("kernel {name} is not in this build"));
        }
        f
    }

    /// Remember the first error.
    pub fn record(&self, reason: String) {
        let mut e = self.error.lock().unwrap_or_else(|p| p.into_inner());
        if e.is_none() {
            tracing::error!(gpu = self.info.ordinal, %reason, "CUDA error");
            *e = Some(reason);
        }
    }

    /// `Some(value)`, or `None` with the error recorded.
    pub fn check<T>(&self, what: &str, r: Result<T, DriverError>) -> Option<T> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        match r {
            Ok(v) => Some(v),
            Err(e) => {
                self.record(format!("{what}: {e}"));
                None
            }
        }
    }

    /// The first error since the last call, if any (after waiting for queued work, so errors
    /// of asynchronous launches surface here).
    pub fn take_error(&self) -> Option<String> {
        if let Err(e) = self.stream.synchronize() {
            self.record(format!("synchronizing: {e}"));
        }
        self.error.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    /// A count that moves with every launch, copy or allocation: two equal marks mean nothing
    /// was queued in between (so no buffer was written).
    pub fn mark(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }

    /// Whether launches are being timed.
    pub fn timing(&self) -> bool {
        self.timing.load(Ordering::Relaxed)
    }

    /// Start timing every launch (events around each, which costs a little), or stop.
    pub fn set_timing(&self, on: bool) {
        self.timing.store(on, Ordering::Relaxed);
    }

    /// Keep a timed launch's events.
    pub fn timed(&self, kernel: &'static str, events: (CudaEvent, CudaEvent)) {
        self.timings
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((kernel, events.0, events.1));
    }

    /// GPU time per kernel of the launches timed since the last call, most first.
    pub fn kernel_times(&self) -> Vec<KernelTime> {
        let _ = self.stream.synchronize();
        let timed = std::mem::take(&mut *self.timings.lock().unwrap_or_else(|p| p.into_inner()));
        let mut out: Vec<KernelTime> = Vec::new();
        for (kernel, start, end) in timed {
            let ms = start.elapsed_ms(&end).map_or(0.0, f64::from);
            match out.iter_mut().find(|t| t.kernel == kernel) {
                Some(t) => {
                    t.launches += 1;
                    t.ms += ms;
                }
                None => out.push(KernelTime {
                    kernel,
                    launches: 1,
                    ms,
                }),
            }
        }
        out.sort_by(|a, b| b.ms.total_cmp(&a.ms));
        out
    }

    /// Bytes free on the GPU now.
    pub fn free_bytes(&self) -> usize {
        self.stream.context().mem_get_info().map(|(free, _)| free).unwrap_or(0)
    }
}

/// Copy `host` into `dev`, which grows (zeroed) when too small and otherwise keeps its
/// allocation, so steady serving allocates nothing.
pub fn upload_into<T: DeviceRepr + ValidAsZeroBits>(
    stream: &Arc<CudaStream>,
    host: &[T],
    dev: &mut Option<CudaSlice<T>>,
) -> Result<(), DriverError> {
    if dev.as_ref().is_none_or(|d| d.len() < host.len()) {
        *dev = Some(stream.alloc_zeros::<T>(host.len().max(1))?);
    }
    match dev.as_mut() {
        Some(d) => stream.memcpy_htod(host, &mut d.slice_mut(0..host.len())),
        None => Ok(()),
    }
}

/// The `extern "C"` kernel names a PTX module defines (`.visible .entry NAME(`).
pub fn kernel_names(ptx: &'static str) -> impl Iterator<Item = &'static str> {
    ptx.lines().filter_map(|l| {
        let rest = l.trim_start().strip_prefix(".visible .entry ")?;
        Some(rest.split('(').next()?.trim())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_embedded_module_has_its_kernels_and_a_cubin_per_target() {
        let mut all: Vec<&str> = MODULES.iter().flat_map(|m| kernel_names(m.ptx)).collect();
        all.sort();
        for want in [
            "add",
            "argmax_rows",
            "attention_f16",
            "attention_f32",
            "deinterleave",
            "embed_f32",
            "matmul_bf16",
            "matmul_f16",
            "matmul_f32",
            "matmul_q4",
            "matmul_q8",
            "matmul_q8_mma",
            "quantize_q8",
            "rmsnorm",
            "rope",
            "sample_rows",
            "sigmoid_mul",
            "silu_mul",
            "store_kv_f16",
            "store_kv_f32",
        ] {
            assert!(all.contains(&want), "{want} missing from {all:?}");
        }
        for m in MODULES {
            assert_eq!(m.cubins.iter().map(|c| c.0).collect::<Vec<_>>(), [80, 86, 89, 90]);
            assert!(
                m.cubins.iter().all(|c| c.1.starts_with(b"\x7fELF")),
                "{} cubins are ELF",
                m.name
            );
            // An RTX 3090 (8.6) runs its own cubin, an RTX 4090 (8.9) its own, an A10 (8.6) too;
            // a 12.0 GPU falls back to PTX.
            assert_eq!(m.cubin_for(86).map(|c| c.len()), Some(m.cubins[1].1.len()));
            assert_eq!(m.cubin_for(87).map(|c| c.len()), Some(m.cubins[1].1.len()));
            assert!(m.cubin_for(120).is_none());
            assert!(m.ptx.contains(".target sm_80"));
        }
    }

    #[test]
    fn a_host_without_a_driver_gets_a_clear_error() {
        if driver_present() {
            return;
        }
        let e = Gpu::open(0).unwrap_err();
        assert_eq!(e, CudaError::NoDriver);
        assert!(e.to_string().contains("no NVIDIA driver"), "{e}");
    }
}
