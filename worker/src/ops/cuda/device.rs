//! One GPU as this process sees it: the driver (checked before first use, so a host without
//! one gets a clear error rather than a panic), a context and stream on the chosen GPU, and
//! the embedded kernels loaded for its compute capability.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::CUdevice_attribute;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaGraph, CudaSlice, CudaStream, DevicePtr, DeviceRepr, DriverError,
    PinnedHostSlice, ValidAsZeroBits, result, sys,
};
use cudarc::nvrtc::Ptx;

use super::graphs::{Args, GraphCounts, GraphKey, Queue, Recorder, RegionEnd};
use crate::kernels::cuda::Geometry;
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
    /// Decode steps as CUDA graphs ([`super::graphs`]).
    graphs: Mutex<Recorder<CudaQueue>>,
}

/// The GPU's stream as a region's [`Queue`]: the driver calls of capturing and replaying.
pub struct CudaQueue {
    stream: Arc<CudaStream>,
}

/// A captured graph, kept in the recorder behind `Gpu::graphs`'s lock.
pub struct Graph(CudaGraph);

// SAFETY: a graph is used only under `Gpu::graphs`'s lock, one thread at a time, which is what
// the driver asks of graph objects.
unsafe impl Send for Graph {}

impl Queue for CudaQueue {
    type Graph = Graph;
    type Arena = PinnedHostSlice<u8>;
    type Error = DriverError;

    fn launch(&self, function: u64, g: Geometry, args: &mut Args) -> Result<(), DriverError> {
        launch_raw(&self.stream, function as sys::CUfunction, g, args)
    }

    fn upload(&self, dst: u64, src: usize, bytes: usize) -> Result<(), DriverError> {
        self.stream.context().bind_to_thread()?;
        // SAFETY: `src` is `bytes` bytes of the arena (page-locked, alive as long as any graph
        // that copies from it), `dst` as many of a live device buffer (the caller's).
        unsafe {
            let host = std::slice::from_raw_parts(src as *const u8, bytes);
            result::memcpy_htod_async(dst, host, self.stream.cu_stream())
        }
    }

    fn memset(&self, dst: u64, bytes: usize) -> Result<(), DriverError> {
        self.stream.context().bind_to_thread()?;
        // SAFETY: `dst` holds `bytes` bytes (the caller's).
        unsafe { result::memset_d8_async(dst, 0, bytes, self.stream.cu_stream()) }
    }

    fn begin_capture(&self) -> Result<(), DriverError> {
        self.stream.context().bind_to_thread()?;
        // SAFETY: the stream is ours and not capturing; thread-local mode turns a call that
        // cannot be captured into an error (a rerun) rather than a silent mistake.
        unsafe {
            result::stream::begin_capture(
                self.stream.cu_stream(),
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
        }
    }

    fn discard_capture(&self) {
        let _ = self.stream.context().bind_to_thread();
        // SAFETY: the stream is capturing (the recorder began it); the graph it gives back is
        // ours to destroy.
        if let Ok(g) = unsafe { result::stream::end_capture(self.stream.cu_stream()) }
            && !g.is_null()
        {
            // SAFETY: as above; nothing else holds the graph.
            let _ = unsafe { result::graph::destroy(g) };
        }
    }

    fn end_capture(&self) -> Result<Graph, DriverError> {
        let graph = self.stream.end_capture(sys::CUgraphInstantiate_flags(0))?;
        graph
            .map(Graph)
            .ok_or(DriverError(sys::cudaError_enum::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED))
    }

    fn launch_graph(&self, graph: &Graph) -> Result<(), DriverError> {
        graph.0.launch()
    }

    fn synchronize(&self) -> Result<(), DriverError> {
        self.stream.synchronize()
    }

    fn alloc_arena(&self, bytes: usize) -> Result<(PinnedHostSlice<u8>, usize), DriverError> {
        // SAFETY: the arena is written by the host before any copy reads it.
        let mut arena = unsafe { self.stream.context().alloc_pinned_with_flags::<u8>(bytes, 0) }?;
        let at = arena.as_mut_ptr()? as usize;
        Ok((arena, at))
    }
}

/// Launch `function` over `g` with `args` on `stream`.
fn launch_raw(stream: &CudaStream, function: sys::CUfunction, g: Geometry, args: &mut Args) -> Result<(), DriverError> {
    let (mut params, n) = args.pointers();
    stream.context().bind_to_thread()?;
    // SAFETY: `params` points at each parameter's bytes, in the kernel's order and types (the
    // launch! macro's callers pass them so), and `args` outlives the call, which copies them.
    unsafe { result::launch_kernel(function, g.grid, g.block, 0, stream.cu_stream(), &mut params[..n]) }
}

/// Whether decode steps run as CUDA graphs unless told otherwise: `BATON_CUDA_GRAPHS=0` (or
/// `off`, `false`) turns them off, as llama.cpp's `GGML_CUDA_DISABLE_GRAPHS` and vLLM's
/// `--enforce-eager` do.
pub fn graphs_wanted() -> bool {
    !switched_off("BATON_CUDA_GRAPHS")
}

/// Whether mixtures whose experts run in one go are routed on the GPU unless told otherwise:
/// `BATON_CUDA_DEVICE_ROUTING=0` routes them on the host, as the CPU does (a wait per layer,
/// and no graphs for such a stage).
pub fn device_routing_wanted() -> bool {
    !switched_off("BATON_CUDA_DEVICE_ROUTING")
}

/// Whether environment variable `name` says `0`, `off`, `false` or `no`.
fn switched_off(name: &str) -> bool {
    matches!(
        std::env::var(name).as_deref().map(str::to_ascii_lowercase).as_deref(),
        Ok("0" | "off" | "false" | "no")
    )
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
        // Every buffer and copy of this process is on the one stream below, so stream order is
        // all the synchronization there is: cudarc's per-buffer events (for several streams)
        // would only add two event calls per argument of every launch. Off before any buffer.
        // SAFETY: nothing has been allocated on this context yet.
        unsafe { ctx.disable_event_tracking() };
        // A stream of our own: the legacy default stream cannot be captured into a graph.
        let stream = ctx.new_stream().map_err(CudaError::driver("creating a stream"))?;
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
            stream: stream.clone(),
            functions,
            error: Mutex::new(None),
            timing: AtomicBool::new(false),
            timings: Mutex::new(Vec::new()),
            calls: AtomicU64::new(0),
            graphs: Mutex::new(Recorder::new(CudaQueue { stream: stream.clone() }, graphs_wanted())),
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

    /// Launch kernel `name` over `g` with `args` (its parameters in order): now, into the
    /// graph being captured, or onto the tape of a replay, as the region's mode says. A
    /// failure is recorded.
    pub fn launch(&self, name: &'static str, g: Geometry, args: &mut Args) {
        let Some(f) = self.function(name) else { return };
        if args.overflowed() {
            self.record(format!("kernel {name}: more parameters than a launch holds"));
            return;
        }
        if self.recorder().launch(name, f.cu_function() as u64, g, args) {
            self.calls.fetch_add(1, Ordering::Relaxed);
            return;
        }
        // Events that keep their times (the default flags), around the launch.
        let event = || self.stream.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT));
        let timed = self.timing().then(event);
        let r = launch_raw(&self.stream, f.cu_function(), g, args);
        let end = self.timing().then(event);
        if self.check(name, r).is_some()
            && let (Some(Ok(start)), Some(Ok(end))) = (timed, end)
        {
            self.timed(name, (start, end));
        }
    }

    fn recorder(&self) -> std::sync::MutexGuard<'_, Recorder<CudaQueue>> {
        self.graphs.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A zeroed buffer of `n` values (at least one). Allocating would end a capture (its
    /// memory would belong to the graph), so a region capturing is given up first.
    pub fn alloc_zeros<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> Result<CudaSlice<T>, DriverError> {
        self.recorder().before_alloc();
        self.stream.alloc_zeros::<T>(n.max(1))
    }

    /// Copy `host` to device address `dst` within a region (through the arena); `false` when
    /// no region is open, for the caller to copy as it does outside one.
    pub fn region_upload<T: DeviceRepr>(&self, host: &[T], dst: u64) -> bool {
        // SAFETY: plain data viewed as its bytes.
        let bytes = unsafe { std::slice::from_raw_parts(host.as_ptr().cast::<u8>(), size_of_val(host)) };
        let queued = self.recorder().upload(bytes, dst);
        if queued {
            self.calls.fetch_add(1, Ordering::Relaxed);
        }
        queued
    }

    /// Zero `bytes` bytes at device address `dst` within a region; `false` when no region is
    /// open.
    pub fn region_memset(&self, dst: u64, bytes: usize) -> bool {
        let queued = self.recorder().memset(dst, bytes);
        if queued {
            self.calls.fetch_add(1, Ordering::Relaxed);
        }
        queued
    }

    /// Open a region for a step of shape `key` (`None`: no graph serves it); with kernel
    /// timing on, every step is eager.
    pub fn begin_region(&self, key: Option<GraphKey>) {
        let error = self.recorder().begin(key, self.timing());
        if let Some(e) = error {
            self.record(e);
        }
    }

    /// Before the host reads what the stream computed: the open region ends (its graph runs).
    /// `false` when the step did not run (it will be run again), so the read must be skipped.
    pub fn sync_point(&self) -> bool {
        self.recorder().sync_point()
    }

    /// End the step's region (if a download has not) and say whether the step ran.
    pub fn finish_region(&self) -> RegionEnd {
        self.recorder().finish()
    }

    /// Regions begun so far: host-side caches of uploads are valid only within one.
    pub fn region_epoch(&self) -> u64 {
        self.recorder().epoch()
    }

    /// Steps by how they ran, so far.
    pub fn graph_counts(&self) -> GraphCounts {
        self.recorder().counts()
    }

    /// Turn decode-step graphs on or off (off drops those captured).
    pub fn set_graphs(&self, on: bool) {
        self.recorder().set_enabled(on);
    }

    /// Bytes free on the GPU now.
    pub fn free_bytes(&self) -> usize {
        self.stream.context().mem_get_info().map(|(free, _)| free).unwrap_or(0)
    }
}

impl Gpu {
    /// Copy `host` into `dev`, which grows (zeroed, to a power of two) when too small and
    /// otherwise keeps its allocation, so steady serving allocates nothing and a step's
    /// buffers keep their addresses (what lets a graph serve the next step).
    pub fn upload_into<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        host: &[T],
        dev: &mut Option<CudaSlice<T>>,
    ) -> Result<(), DriverError> {
        if dev.as_ref().is_none_or(|d| d.len() < host.len()) {
            *dev = Some(self.alloc_zeros::<T>(host.len().max(1).next_power_of_two())?);
        }
        let Some(d) = dev.as_mut() else { return Ok(()) };
        let dst = d.device_ptr(&self.stream).0;
        if self.region_upload(host, dst) {
            return Ok(());
        }
        self.stream.memcpy_htod(host, &mut d.slice_mut(0..host.len()))
    }

    /// Zero `values` values of `dev` from its start, on the stream (within a region: into its
    /// graph).
    pub fn zero<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        dev: &mut CudaSlice<T>,
        range: std::ops::Range<usize>,
    ) -> Result<(), DriverError> {
        let base = dev.device_ptr(&self.stream).0;
        let bytes = range.len() * size_of::<T>();
        if self.region_memset(base + (range.start * size_of::<T>()) as u64, bytes) {
            return Ok(());
        }
        self.stream.memset_zeros(&mut dev.slice_mut(range))
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
