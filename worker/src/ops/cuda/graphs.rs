//! CUDA graphs for a stage's decode steps.
//!
//! A decode step of an 8B model is about 400 launches of a few microseconds each; launched one
//! by one from the host, the GPU waits between them. A CUDA graph launches the whole step at
//! once. The model code stays as it is (one call per operation): what changes is where a
//! step's work goes.
//!
//! A *region* (one forward of a stage) runs in one of these modes:
//!
//! * **eager**: every launch and copy goes to the stream as it is made (no region, and the
//!   first step of each shape, which sizes every buffer);
//! * **capture**: the second step of a shape is captured into a graph, then the graph runs;
//! * **replay**: the host runs the forward again but launches nothing; it writes down every
//!   launch (kernel, geometry, argument bytes) and copy into a [`Tape`], and the step's uploads
//!   into the page-locked [`Arena`] at the offsets the captured copies read. Only if the tape
//!   equals the captured one, byte for byte, does the graph run: the same kernels with the same
//!   pointers and scalars, reading this step's uploads;
//! * **spoiled**: something the graph cannot hold happened (a tape that differs, an allocation
//!   while capturing, an arena too small); nothing ran, and the caller runs the step again,
//!   eagerly.
//!
//! So a graph never runs work other than what eager launches would run: the tape is the proof.
//! This file holds the parts that need no GPU (argument packing, the tape, the arena's offsets,
//! the choice of mode); `device.rs` drives the driver with them.

use std::collections::{HashMap, HashSet};
use std::ffi::c_void;

use crate::kernels::cuda::Geometry;

/// Most parameters a Baton kernel takes.
pub const MAX_ARGS: usize = 24;
/// 8-byte words of parameter values a launch may hold (a `MatmulGroup` is 17 of them).
const MAX_WORDS: usize = 80;

/// A kernel's parameters as it receives them: each value in its own 8-byte-aligned slot, so
/// the driver can read it through a pointer, and the tape can compare them as bytes.
pub struct Args {
    words: [u64; MAX_WORDS],
    starts: [u16; MAX_ARGS],
    count: usize,
    used: usize,
    overflow: bool,
}

impl Default for Args {
    fn default() -> Self {
        Self {
            words: [0; MAX_WORDS],
            starts: [0; MAX_ARGS],
            count: 0,
            used: 0,
            overflow: false,
        }
    }
}

impl Args {
    /// One parameter's bytes, as the kernel declares it (a device address, an `int`, a struct).
    pub fn push_bytes(&mut self, bytes: &[u8]) {
        let words = bytes.len().div_ceil(8).max(1);
        if self.count == MAX_ARGS || self.used + words > MAX_WORDS {
            self.overflow = true;
            return;
        }
        let slot = &mut self.words[self.used..self.used + words];
        slot.fill(0);
        // SAFETY: `slot` is `words * 8 >= bytes.len()` bytes of plain integers.
        let dst = unsafe { std::slice::from_raw_parts_mut(slot.as_mut_ptr().cast::<u8>(), words * 8) };
        dst[..bytes.len()].copy_from_slice(bytes);
        self.starts[self.count] = self.used as u16;
        self.count += 1;
        self.used += words;
    }

    /// Whether a parameter did not fit (a build defect: the limits hold every kernel here).
    pub fn overflowed(&self) -> bool {
        self.overflow
    }

    /// The parameters' bytes, slot after slot (what the tape compares).
    pub fn bytes(&self) -> &[u8] {
        let words = &self.words[..self.used];
        // SAFETY: plain integers viewed as their bytes.
        unsafe { std::slice::from_raw_parts(words.as_ptr().cast::<u8>(), words.len() * 8) }
    }

    /// A pointer to each parameter's slot, in order (what `cuLaunchKernel` takes); valid while
    /// `self` is neither moved nor changed.
    pub fn pointers(&mut self) -> ([*mut c_void; MAX_ARGS], usize) {
        let mut out = [std::ptr::null_mut(); MAX_ARGS];
        let base = self.words.as_mut_ptr();
        for (o, &s) in out.iter_mut().zip(&self.starts[..self.count]) {
            // SAFETY: every start is below `used <= MAX_WORDS`.
            *o = unsafe { base.add(s as usize) }.cast::<c_void>();
        }
        (out, self.count)
    }
}

/// The shape of one graph: the rows of a decode step and whether it hands feature taps out.
/// The tape, not the key, decides whether a graph may run; the key only picks the candidate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GraphKey {
    pub rows: usize,
    pub taps: bool,
}

/// Everything a step queued, in order, as bytes: what makes two steps the same graph.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Tape(Vec<u8>);

impl Tape {
    const LAUNCH: u8 = 1;
    const UPLOAD: u8 = 2;
    const MEMSET: u8 = 3;

    fn clear(&mut self) {
        self.0.clear();
    }

    fn put(&mut self, words: &[u64]) {
        for w in words {
            self.0.extend_from_slice(&w.to_ne_bytes());
        }
    }

    /// A launch of `function` over `grid` × `block` with `args`.
    pub fn launch(&mut self, function: u64, grid: (u32, u32, u32), block: (u32, u32, u32), args: &Args) {
        self.0.push(Self::LAUNCH);
        let g = |d: (u32, u32, u32)| [d.0 as u64, d.1 as u64, d.2 as u64];
        self.put(&[function]);
        self.put(&g(grid));
        self.put(&g(block));
        self.put(&[args.count as u64, args.used as u64]);
        self.0.extend_from_slice(args.bytes());
    }

    /// A copy of `bytes` bytes from arena offset `at` to device address `dst`.
    pub fn upload(&mut self, dst: u64, at: usize, bytes: usize) {
        self.0.push(Self::UPLOAD);
        self.put(&[dst, at as u64, bytes as u64]);
    }

    /// Zeroing `bytes` bytes at device address `dst`.
    pub fn memset(&mut self, dst: u64, bytes: usize) {
        self.0.push(Self::MEMSET);
        self.put(&[dst, bytes as u64]);
    }

    /// Bytes written down.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// Where a region's uploads go in the page-locked arena: each at the next 256-byte boundary,
/// so a step's offsets depend only on the sizes of its uploads, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Arena {
    pub capacity: usize,
    used: usize,
}

impl Arena {
    /// Alignment of each upload in the arena.
    pub const ALIGN: usize = 256;
    /// Bytes the arena starts with (a batch of 32 rows of 8,192 f32s is 1 MiB).
    pub const INITIAL: usize = 4 << 20;

    pub fn new(capacity: usize) -> Self {
        Self { capacity, used: 0 }
    }

    /// Start a region's uploads from the beginning.
    pub fn reset(&mut self) {
        self.used = 0;
    }

    /// The offset for `bytes` more, or `None` when the arena is full.
    pub fn take(&mut self, bytes: usize) -> Option<usize> {
        let at = self.used.next_multiple_of(Self::ALIGN);
        let end = at.checked_add(bytes)?;
        if end > self.capacity {
            return None;
        }
        self.used = end;
        Some(at)
    }
}

/// How the current region's work is queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Launched as made (no region, or after the region's graph ran).
    Eager,
    /// Captured into a new graph.
    Capture,
    /// Written down only, for the captured graph to run if the tape matches.
    Replay,
    /// Nothing is queued; the caller runs the step again, eagerly.
    Spoiled,
}

/// What ending a region asks of the driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// Nothing: the work went out eagerly.
    Eager,
    /// End the capture, keep the graph under the key and launch it.
    Captured,
    /// Launch the graph kept under the key.
    Replayed,
    /// End the capture if one was going, and run the step again eagerly.
    Rerun,
}

/// How many steps ran which way (the `baton_cuda_graph_steps_total` outcomes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GraphCounts {
    /// Steps launched one kernel at a time (graphs off, a first step of its shape, a prompt).
    pub eager: u64,
    /// Steps captured into a graph (then launched as one).
    pub captured: u64,
    /// Steps that launched a graph captured before.
    pub replayed: u64,
    /// Steps whose tape differed from the graph's, or that could not be captured: run again
    /// eagerly.
    pub rerun: u64,
}

/// Graphs kept at most; a batch size that is new once the limit is reached starts them over.
pub const MAX_GRAPHS: usize = 64;

/// The choice of mode for each region and the graphs' tapes, apart from the driver: `G` is
/// the driver's graph (a test uses a stand-in).
pub struct Regions<G> {
    pub enabled: bool,
    pub mode: Mode,
    key: Option<GraphKey>,
    pub tape: Tape,
    pub arena: Arena,
    /// The arena overflowed in this region: it grows before the next one.
    arena_full: bool,
    graphs: HashMap<GraphKey, (Tape, G)>,
    seen: HashSet<GraphKey>,
    pub counts: GraphCounts,
}

impl<G> Regions<G> {
    pub fn new(enabled: bool) -> Self {
        Self {
            enabled,
            mode: Mode::Eager,
            key: None,
            tape: Tape::default(),
            arena: Arena::new(Arena::INITIAL),
            arena_full: false,
            graphs: HashMap::new(),
            seen: HashSet::new(),
            counts: GraphCounts::default(),
        }
    }

    /// Whether the arena must grow (to `Some(bytes)`) before the next region; the graphs,
    /// which read the old one, are dropped with it.
    pub fn arena_growth(&mut self) -> Option<usize> {
        if !std::mem::take(&mut self.arena_full) {
            return None;
        }
        self.graphs.clear();
        self.arena = Arena::new(self.arena.capacity * 2);
        Some(self.arena.capacity)
    }

    /// Start a region for a step of shape `key` (`None`: a step no graph serves); returns
    /// its mode. A shape's first step runs eagerly, sizing every buffer it needs; its second
    /// is captured; later ones replay.
    pub fn begin(&mut self, key: Option<GraphKey>) -> Mode {
        self.tape.clear();
        self.arena.reset();
        self.key = key.filter(|_| self.enabled);
        self.mode = match self.key {
            None => Mode::Eager,
            Some(k) if self.graphs.contains_key(&k) => Mode::Replay,
            Some(k) if self.seen.contains(&k) => {
                if self.graphs.len() >= MAX_GRAPHS {
                    self.graphs.clear();
                }
                Mode::Capture
            }
            Some(k) => {
                self.seen.insert(k);
                Mode::Eager
            }
        };
        self.mode
    }

    /// Nothing more of this region can go into a graph.
    pub fn spoil(&mut self) {
        if matches!(self.mode, Mode::Capture | Mode::Replay) {
            self.mode = Mode::Spoiled;
        }
    }

    /// The arena has no room for an upload: spoil the region and grow the arena after it.
    pub fn arena_is_full(&mut self) {
        self.arena_full = true;
        self.spoil();
    }

    /// End the region: what the driver must do. A replay whose tape differs drops its graph,
    /// so the shape's next step captures a fresh one.
    pub fn end(&mut self) -> Ending {
        let mode = std::mem::replace(&mut self.mode, Mode::Eager);
        let ending = match (mode, self.key) {
            (Mode::Capture, Some(_)) => Ending::Captured,
            (Mode::Replay, Some(k)) => match self.graphs.get(&k) {
                Some((tape, _)) if *tape == self.tape => Ending::Replayed,
                _ => {
                    self.graphs.remove(&k);
                    Ending::Rerun
                }
            },
            (Mode::Spoiled, Some(k)) => {
                self.graphs.remove(&k);
                Ending::Rerun
            }
            _ => Ending::Eager,
        };
        match ending {
            Ending::Eager => self.counts.eager += 1,
            Ending::Captured => self.counts.captured += 1,
            Ending::Replayed => self.counts.replayed += 1,
            Ending::Rerun => self.counts.rerun += 1,
        }
        ending
    }

    /// Keep `graph`, captured in the region just ended, with its tape.
    pub fn keep(&mut self, graph: G) {
        if let Some(k) = self.key {
            self.graphs.insert(k, (std::mem::take(&mut self.tape), graph));
        }
    }

    /// The graph of the region just ended.
    pub fn graph(&self) -> Option<&G> {
        self.graphs.get(&self.key?).map(|(_, g)| g)
    }

    /// Capturing failed on this GPU: run eagerly from now on.
    pub fn disable(&mut self) {
        self.enabled = false;
        self.graphs.clear();
    }

    /// Turn graphs on or off (off drops them).
    pub fn set_enabled(&mut self, on: bool) {
        self.enabled = on;
        if !on {
            self.graphs.clear();
            self.seen.clear();
        }
    }
}

/// The driver calls a region makes: the GPU's stream (`device.rs`), or a recording stand-in in
/// the tests, which so check the order of a region's calls without a GPU.
pub trait Queue {
    /// An instantiated graph.
    type Graph;
    /// Page-locked host memory (the arena).
    type Arena;
    type Error: std::fmt::Display;
    /// Launch `function` over `g` with `args` on the stream (into the capture, while one is
    /// open).
    fn launch(&self, function: u64, g: Geometry, args: &mut Args) -> Result<(), Self::Error>;
    /// Copy `bytes` bytes from host address `src` (in the arena) to device address `dst`.
    fn upload(&self, dst: u64, src: usize, bytes: usize) -> Result<(), Self::Error>;
    /// Zero `bytes` bytes at device address `dst`.
    fn memset(&self, dst: u64, bytes: usize) -> Result<(), Self::Error>;
    /// Start capturing what the stream is given.
    fn begin_capture(&self) -> Result<(), Self::Error>;
    /// End the open capture, discarding what it holds.
    fn discard_capture(&self);
    /// End the open capture as an instantiated graph.
    fn end_capture(&self) -> Result<Self::Graph, Self::Error>;
    fn launch_graph(&self, graph: &Self::Graph) -> Result<(), Self::Error>;
    /// Wait for everything queued.
    fn synchronize(&self) -> Result<(), Self::Error>;
    /// `bytes` of page-locked host memory and its address.
    fn alloc_arena(&self, bytes: usize) -> Result<(Self::Arena, usize), Self::Error>;
}

/// How a region ended, for the caller of [`Recorder::finish`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RegionEnd {
    /// The step's work ran (eagerly or as a graph).
    Ran,
    /// Nothing ran: run the step again (the region is eager then).
    Rerun,
}

/// A stream's regions: what each launch, upload and memset of a forward becomes (queued now,
/// captured, written down, or dropped), and how the region ends. Work in no region, or in an
/// eager one, is the caller's to queue (`launch` and the rest return `false`).
pub struct Recorder<Q: Queue> {
    queue: Q,
    regions: Regions<Q::Graph>,
    arena: Option<Q::Arena>,
    /// The arena's host address, taken once when it is allocated (reading it again waits on an
    /// event, which a capture does not allow).
    arena_at: usize,
    /// A region is open (begun, not yet ended).
    open: bool,
    /// A capture is open on the stream.
    capturing: bool,
    /// A region ended without running its work: the caller runs the step again, and until it
    /// does no download may read the rows the step did not compute.
    rerun: bool,
    /// Regions begun so far.
    epoch: u64,
}

impl<Q: Queue> Recorder<Q> {
    pub fn new(queue: Q, enabled: bool) -> Self {
        Self {
            queue,
            regions: Regions::new(enabled),
            arena: None,
            arena_at: 0,
            open: false,
            capturing: false,
            rerun: false,
            epoch: 0,
        }
    }

    /// The launch of `function` within a region: onto the tape, and into the capture; `false`
    /// (nothing done) where the caller launches it now.
    pub fn launch(&mut self, name: &str, function: u64, g: Geometry, args: &mut Args) -> bool {
        match self.regions.mode {
            Mode::Eager => false,
            Mode::Capture => {
                self.regions.tape.launch(function, g.grid, g.block, args);
                if let Err(e) = self.queue.launch(function, g, args) {
                    tracing::warn!(kernel = name, error = %e, "a launch could not be captured; the step runs eagerly");
                    self.spoil();
                }
                true
            }
            Mode::Replay => {
                self.regions.tape.launch(function, g.grid, g.block, args);
                true
            }
            Mode::Spoiled => true,
        }
    }

    /// Copy `host` to device address `dst` within a region, through the arena; `false` where
    /// the caller copies it now.
    pub fn upload(&mut self, host: &[u8], dst: u64) -> bool {
        let mode = self.regions.mode;
        if mode == Mode::Eager {
            return false;
        }
        if mode == Mode::Spoiled || host.is_empty() {
            return true;
        }
        let bytes = host.len();
        let Some(at) = self.regions.arena.take(bytes) else {
            self.regions.arena_is_full();
            self.close_capture();
            return true;
        };
        if self.arena_at == 0 {
            self.spoil();
            return true;
        }
        self.regions.tape.upload(dst, at, bytes);
        // SAFETY: `take` kept `at + bytes` within the arena's capacity, the length allocated
        // at `arena_at`; the host writes it only while no graph reads it (a region begins
        // after the stream has finished the last one).
        let room = unsafe { std::slice::from_raw_parts_mut((self.arena_at as *mut u8).add(at), bytes) };
        room.copy_from_slice(host);
        if mode == Mode::Capture
            && let Err(e) = self.queue.upload(dst, self.arena_at + at, bytes)
        {
            tracing::warn!(error = %e, "an upload could not be captured; the step runs eagerly");
            self.spoil();
        }
        true
    }

    /// Zero `bytes` bytes at `dst` within a region; `false` where the caller zeroes them now.
    pub fn memset(&mut self, dst: u64, bytes: usize) -> bool {
        let mode = self.regions.mode;
        if mode == Mode::Eager {
            return false;
        }
        if mode == Mode::Spoiled {
            return true;
        }
        self.regions.tape.memset(dst, bytes);
        if mode == Mode::Capture
            && let Err(e) = self.queue.memset(dst, bytes)
        {
            tracing::warn!(error = %e, "a memset could not be captured; the step runs eagerly");
            self.spoil();
        }
        true
    }

    /// Before an allocation: its memory would belong to a graph being captured, so the capture
    /// is given up (the step runs again).
    pub fn before_alloc(&mut self) {
        if self.regions.mode == Mode::Capture {
            self.spoil();
        }
    }

    /// The open region cannot become a graph: nothing more of it is queued, a capture is
    /// discarded, and the step runs again.
    fn spoil(&mut self) {
        self.regions.spoil();
        self.close_capture();
    }

    /// End a capture that can no longer become a graph.
    fn close_capture(&mut self) {
        if self.capturing && self.regions.mode != Mode::Capture {
            self.capturing = false;
            self.queue.discard_capture();
        }
    }

    /// Open a region for a step of shape `key` (`None`: no graph serves it; `timing`: kernels
    /// are being timed, every step eager). The error is a failed wait for the stream.
    pub fn begin(&mut self, key: Option<GraphKey>, timing: bool) -> Option<String> {
        self.epoch += 1;
        // A region left open (its forward failed before ending it) ends now.
        self.end();
        self.rerun = false;
        self.open = true;
        let key = key.filter(|_| !timing && self.regions.enabled);
        let mut error = None;
        if key.is_some() {
            // The host is about to write the arena, and may drop graphs: the last graph must
            // have finished with both.
            if let Err(e) = self.queue.synchronize() {
                error = Some(format!("synchronizing: {e}"));
            }
            if let Some(bytes) = self.regions.arena_growth() {
                self.arena = None;
                self.arena_at = 0;
                tracing::info!(bytes, "CUDA graph upload arena grown");
            }
            if self.arena.is_none() {
                match self.queue.alloc_arena(self.regions.arena.capacity) {
                    Ok((arena, at)) => {
                        self.arena = Some(arena);
                        self.arena_at = at;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "no page-locked arena for CUDA graphs; running eagerly");
                        self.regions.disable();
                    }
                }
            }
        }
        if self.regions.begin(key) == Mode::Capture {
            match self.queue.begin_capture() {
                Ok(()) => self.capturing = true,
                Err(e) => {
                    tracing::warn!(error = %e, "CUDA graph capture unavailable; running eagerly");
                    self.regions.spoil();
                    self.regions.disable();
                }
            }
        }
        error
    }

    /// End the open region, if one is: capture or launch its graph, or ask for a rerun.
    fn end(&mut self) {
        if !std::mem::take(&mut self.open) {
            return;
        }
        let outcome = match self.regions.end() {
            Ending::Eager => "eager",
            Ending::Captured => {
                self.capturing = false;
                let graph = self.queue.end_capture();
                match graph.and_then(|g| self.queue.launch_graph(&g).map(|()| g)) {
                    Ok(g) => {
                        self.regions.keep(g);
                        "captured"
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "a CUDA graph could not be captured or launched; running eagerly from now on");
                        self.regions.disable();
                        self.rerun = true;
                        "rerun"
                    }
                }
            }
            Ending::Replayed => match self.regions.graph().map(|g| self.queue.launch_graph(g)) {
                Some(Ok(())) => "replayed",
                failed => {
                    if let Some(Err(e)) = failed {
                        tracing::warn!(error = %e, "a CUDA graph could not be launched; running eagerly from now on");
                        self.regions.disable();
                    }
                    self.rerun = true;
                    "rerun"
                }
            },
            Ending::Rerun => {
                // A capture spoiled on its last call may still be open.
                if self.capturing {
                    self.capturing = false;
                    self.queue.discard_capture();
                }
                self.rerun = true;
                "rerun"
            }
        };
        metrics::counter!("baton_cuda_graph_steps_total", "outcome" => outcome).increment(1);
    }

    /// Before the host reads what the stream computed: the open region ends (its graph runs).
    /// `false` when the step did not run (it will be run again), so the read must be skipped.
    pub fn sync_point(&mut self) -> bool {
        self.end();
        !self.rerun
    }

    /// End the step's region (if a download has not) and say whether the step ran.
    pub fn finish(&mut self) -> RegionEnd {
        self.end();
        match std::mem::take(&mut self.rerun) {
            true => RegionEnd::Rerun,
            false => RegionEnd::Ran,
        }
    }

    /// Regions begun so far: host-side caches of uploads are valid only within one.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Steps by how they ran, so far.
    pub fn counts(&self) -> GraphCounts {
        self.regions.counts
    }

    /// Turn graphs on or off (off drops those captured).
    pub fn set_enabled(&mut self, on: bool) {
        self.regions.set_enabled(on);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(values: &[u32]) -> Args {
        let mut a = Args::default();
        for v in values {
            a.push_bytes(&v.to_ne_bytes());
        }
        a
    }

    #[test]
    fn each_parameter_sits_in_its_own_aligned_slot() {
        let mut a = Args::default();
        a.push_bytes(&7u64.to_ne_bytes());
        a.push_bytes(&3i32.to_ne_bytes());
        let group = [0xabu8; 136];
        a.push_bytes(&group);
        a.push_bytes(&1.5f32.to_ne_bytes());
        let (ptrs, n) = a.pointers();
        assert_eq!(n, 4);
        // SAFETY: each pointer is to its slot, read as the type pushed there.
        unsafe {
            assert_eq!(*(ptrs[0] as *const u64), 7);
            assert_eq!(*(ptrs[1] as *const i32), 3);
            assert_eq!(std::slice::from_raw_parts(ptrs[2] as *const u8, 136), &group[..]);
            assert_eq!(*(ptrs[3] as *const f32), 1.5);
        }
        assert!(ptrs.iter().take(n).all(|p| (*p as usize).is_multiple_of(8)));
        // 1 + 1 + 17 + 1 words.
        assert_eq!(a.bytes().len(), 20 * 8);
        assert!(!a.overflowed());
    }

    #[test]
    fn too_many_parameters_are_reported_not_written_past_the_end() {
        let mut a = Args::default();
        for i in 0..MAX_ARGS + 2 {
            a.push_bytes(&(i as u32).to_ne_bytes());
        }
        assert!(a.overflowed());
        assert_eq!(a.pointers().1, MAX_ARGS);
        let mut b = Args::default();
        b.push_bytes(&[1u8; MAX_WORDS * 8 + 1]);
        assert!(b.overflowed());
    }

    #[test]
    fn tapes_differ_by_any_kernel_geometry_parameter_or_copy() {
        let tape = |f: u64, grid: u32, a: &[u32], upload: (u64, usize)| {
            let mut t = Tape::default();
            t.launch(f, (grid, 1, 1), (256, 1, 1), &args(a));
            t.upload(upload.0, upload.1, 64);
            t.memset(9, 16);
            t
        };
        let base = tape(1, 4, &[1, 2], (100, 0));
        assert_eq!(base, tape(1, 4, &[1, 2], (100, 0)));
        for other in [
            tape(2, 4, &[1, 2], (100, 0)),
            tape(1, 5, &[1, 2], (100, 0)),
            tape(1, 4, &[1, 3], (100, 0)),
            tape(1, 4, &[1, 2, 0], (100, 0)),
            tape(1, 4, &[1, 2], (101, 0)),
            tape(1, 4, &[1, 2], (100, 256)),
        ] {
            assert_ne!(base, other);
        }
    }

    #[test]
    fn the_arena_aligns_each_upload_and_says_when_it_is_full() {
        let mut a = Arena::new(1024);
        assert_eq!(a.take(10), Some(0));
        assert_eq!(a.take(300), Some(256));
        assert_eq!(a.take(256), Some(768));
        assert_eq!(a.take(1), None);
        a.reset();
        assert_eq!(a.take(1024), Some(0));
        assert_eq!(Arena::new(8).take(usize::MAX), None);
    }

    fn step(r: &mut Regions<&'static str>, key: Option<GraphKey>, launches: &[u32]) -> (Mode, Ending) {
        let mode = r.begin(key);
        for &l in launches {
            r.tape.launch(1, (l, 1, 1), (32, 1, 1), &args(&[l]));
        }
        let ending = r.end();
        if ending == Ending::Captured {
            r.keep("graph");
        }
        (mode, ending)
    }

    #[test]
    fn a_shape_runs_eagerly_then_is_captured_then_replays_while_its_tape_holds() {
        let mut r = Regions::new(true);
        let k = Some(GraphKey { rows: 4, taps: false });
        assert_eq!(step(&mut r, k, &[1, 2]), (Mode::Eager, Ending::Eager));
        assert_eq!(step(&mut r, k, &[1, 2]), (Mode::Capture, Ending::Captured));
        assert_eq!(r.graph(), Some(&"graph"));
        assert_eq!(step(&mut r, k, &[1, 2]), (Mode::Replay, Ending::Replayed));
        // A step that queues something else is run again eagerly, and its shape recaptured.
        assert_eq!(step(&mut r, k, &[1, 3]), (Mode::Replay, Ending::Rerun));
        assert_eq!(step(&mut r, k, &[1, 3]), (Mode::Capture, Ending::Captured));
        assert_eq!(step(&mut r, k, &[1, 3]), (Mode::Replay, Ending::Replayed));
        // Steps no graph serves (prompts) stay eager.
        assert_eq!(step(&mut r, None, &[5]), (Mode::Eager, Ending::Eager));
        assert_eq!(
            r.counts,
            GraphCounts {
                eager: 2,
                captured: 2,
                replayed: 2,
                rerun: 1
            }
        );
    }

    #[test]
    fn a_spoiled_region_reruns_and_a_full_arena_grows_and_drops_the_graphs() {
        let mut r = Regions::new(true);
        let k = Some(GraphKey { rows: 1, taps: true });
        step(&mut r, k, &[1]);
        step(&mut r, k, &[1]);
        assert_eq!(r.begin(k), Mode::Replay);
        r.arena_is_full();
        assert_eq!(r.mode, Mode::Spoiled);
        assert_eq!(r.end(), Ending::Rerun);
        let before = r.arena.capacity;
        assert_eq!(r.arena_growth(), Some(before * 2));
        assert_eq!(r.arena_growth(), None);
        assert_eq!(r.begin(k), Mode::Capture);
        r.spoil();
        assert_eq!(r.end(), Ending::Rerun);
        // Graphs off: every step eager, nothing kept.
        r.set_enabled(false);
        assert_eq!(step(&mut r, k, &[1]), (Mode::Eager, Ending::Eager));
        assert_eq!(step(&mut r, k, &[1]), (Mode::Eager, Ending::Eager));
        assert_eq!(r.graph(), None);
    }
    /// What the stand-in queue was asked, in order.
    #[derive(Debug, Clone, PartialEq)]
    enum Call {
        Launch(u64),
        /// A copy, with the bytes its source held when the copy ran.
        Upload(u64, Vec<u8>),
        Memset(u64),
        BeginCapture,
        Discard,
        EndCapture,
        /// A graph ran: its copies read the arena now.
        Graph(Vec<Call>),
        Sync,
        Arena(usize),
    }

    /// A queue that writes its calls down; a capture keeps its calls as the graph, and a graph
    /// "runs" by reading its copies' sources again.
    #[derive(Default)]
    struct Fake {
        calls: std::cell::RefCell<Vec<Call>>,
        capture: std::cell::RefCell<Option<Vec<(u64, usize, usize)>>>,
    }

    impl Fake {
        fn take(&self) -> Vec<Call> {
            std::mem::take(&mut *self.calls.borrow_mut())
        }
    }

    fn read(src: usize, bytes: usize) -> Vec<u8> {
        // SAFETY: the recorder passes addresses inside its live arena.
        unsafe { std::slice::from_raw_parts(src as *const u8, bytes) }.to_vec()
    }

    impl Queue for Fake {
        type Graph = Vec<(u64, usize, usize)>;
        type Arena = Vec<u8>;
        type Error = String;

        fn launch(&self, function: u64, _: Geometry, _: &mut Args) -> Result<(), String> {
            self.calls.borrow_mut().push(Call::Launch(function));
            Ok(())
        }

        fn upload(&self, dst: u64, src: usize, bytes: usize) -> Result<(), String> {
            if let Some(c) = self.capture.borrow_mut().as_mut() {
                c.push((dst, src, bytes));
            }
            self.calls.borrow_mut().push(Call::Upload(dst, read(src, bytes)));
            Ok(())
        }

        fn memset(&self, dst: u64, _: usize) -> Result<(), String> {
            self.calls.borrow_mut().push(Call::Memset(dst));
            Ok(())
        }

        fn begin_capture(&self) -> Result<(), String> {
            *self.capture.borrow_mut() = Some(Vec::new());
            self.calls.borrow_mut().push(Call::BeginCapture);
            Ok(())
        }

        fn discard_capture(&self) {
            *self.capture.borrow_mut() = None;
            self.calls.borrow_mut().push(Call::Discard);
        }

        fn end_capture(&self) -> Result<Self::Graph, String> {
            self.calls.borrow_mut().push(Call::EndCapture);
            self.capture
                .borrow_mut()
                .take()
                .ok_or_else(|| "not capturing".to_string())
        }

        fn launch_graph(&self, graph: &Self::Graph) -> Result<(), String> {
            let copies = graph
                .iter()
                .map(|&(dst, src, n)| Call::Upload(dst, read(src, n)))
                .collect();
            self.calls.borrow_mut().push(Call::Graph(copies));
            Ok(())
        }

        fn synchronize(&self) -> Result<(), String> {
            self.calls.borrow_mut().push(Call::Sync);
            Ok(())
        }

        fn alloc_arena(&self, bytes: usize) -> Result<(Vec<u8>, usize), String> {
            self.calls.borrow_mut().push(Call::Arena(bytes));
            let mut a = vec![0u8; bytes];
            let at = a.as_mut_ptr() as usize;
            Ok((a, at))
        }
    }

    const KEY: Option<GraphKey> = Some(GraphKey { rows: 2, taps: false });
    const GEOM: Geometry = Geometry {
        grid: (4, 1, 1),
        block: (128, 1, 1),
    };

    /// A forward as the operations make it: the step's rows up, two kernels, a memset, then
    /// the download's sync point. Returns whether each launch was taken by the recorder and
    /// whether the download may read.
    fn forward(r: &mut Recorder<Fake>, rows: u8, second_kernel: u64) -> (Vec<bool>, bool) {
        let mut taken = vec![r.upload(&[rows; 40], 0x1000)];
        for f in [7, second_kernel] {
            taken.push(r.launch("k", f, GEOM, &mut args(&[1, 2])));
        }
        taken.push(r.memset(0x2000, 64));
        (taken, r.sync_point())
    }

    #[test]
    fn a_region_is_captured_then_replayed_with_each_steps_uploads() {
        let mut r = Recorder::new(Fake::default(), true);
        // First step of its shape: everything is the caller's to queue.
        assert_eq!(r.begin(KEY, false), None);
        assert_eq!(forward(&mut r, 1, 8), (vec![false; 4], true));
        assert_eq!(r.finish(), RegionEnd::Ran);
        let setup = r.queue.take();
        assert_eq!(setup, [Call::Sync, Call::Arena(Arena::INITIAL)]);

        // Second: captured, then the graph runs once, at the download.
        r.begin(KEY, false);
        assert_eq!(forward(&mut r, 2, 8), (vec![true; 4], true));
        assert_eq!(r.finish(), RegionEnd::Ran);
        let up = |b: u8| Call::Upload(0x1000, vec![b; 40]);
        assert_eq!(
            r.queue.take(),
            [
                Call::Sync,
                Call::BeginCapture,
                up(2),
                Call::Launch(7),
                Call::Launch(8),
                Call::Memset(0x2000),
                Call::EndCapture,
                Call::Graph(vec![up(2)]),
            ]
        );

        // Third: nothing queued but the graph, whose copy reads this step's rows.
        r.begin(KEY, false);
        assert_eq!(forward(&mut r, 3, 8), (vec![true; 4], true));
        assert_eq!(r.finish(), RegionEnd::Ran);
        assert_eq!(r.queue.take(), [Call::Sync, Call::Graph(vec![up(3)])]);
        assert_eq!(r.counts().replayed, 1);

        // A step that launches another kernel: nothing runs, the download is skipped, and the
        // caller is told to run it again (eagerly: the recorder takes nothing then).
        r.begin(KEY, false);
        assert_eq!(forward(&mut r, 4, 9), (vec![true; 4], false));
        assert_eq!(r.finish(), RegionEnd::Rerun);
        assert_eq!(r.queue.take(), [Call::Sync]);
        r.begin(None, false);
        assert_eq!(forward(&mut r, 4, 9), (vec![false; 4], true));
        assert_eq!(r.finish(), RegionEnd::Ran);
        // The shape is captured afresh.
        r.begin(KEY, false);
        forward(&mut r, 5, 9);
        assert_eq!(r.finish(), RegionEnd::Ran);
        assert!(r.queue.take().contains(&Call::Graph(vec![up(5)])));
        assert_eq!(
            r.counts(),
            GraphCounts {
                eager: 2,
                captured: 2,
                replayed: 1,
                rerun: 1
            }
        );
    }

    #[test]
    fn an_allocation_while_capturing_discards_the_capture_and_the_step_reruns() {
        let mut r = Recorder::new(Fake::default(), true);
        for _ in 0..2 {
            r.begin(KEY, false);
            if r.regions.mode == Mode::Capture {
                r.upload(&[1; 8], 0x1000);
                r.before_alloc();
                // Nothing more is queued, and no download may read.
                assert!(r.launch("k", 7, GEOM, &mut args(&[1])));
                assert!(!r.sync_point());
            }
            r.finish();
        }
        let calls = r.queue.take();
        assert_eq!(calls.iter().filter(|c| **c == Call::Discard).count(), 1, "{calls:?}");
        assert!(!calls.contains(&Call::Launch(7)), "{calls:?}");
        assert!(
            !calls.iter().any(|c| matches!(c, Call::EndCapture | Call::Graph(_))),
            "{calls:?}"
        );
        assert_eq!(r.counts().rerun, 1);
        // An allocation outside a capture changes nothing.
        r.begin(None, false);
        r.before_alloc();
        assert!(!r.launch("k", 7, GEOM, &mut args(&[1])));
        assert_eq!(r.finish(), RegionEnd::Ran);
    }

    #[test]
    fn uploads_beyond_the_arena_rerun_and_grow_it_and_timing_keeps_steps_eager() {
        let mut r = Recorder::new(Fake::default(), true);
        let big = vec![9u8; Arena::INITIAL + 1];
        for _ in 0..2 {
            r.begin(KEY, false);
            r.upload(&big, 0x1000);
            r.finish();
        }
        assert_eq!(r.counts().rerun, 1);
        r.begin(KEY, false);
        assert_eq!(r.finish(), RegionEnd::Ran);
        let calls = r.queue.take();
        assert!(calls.contains(&Call::Arena(2 * Arena::INITIAL)), "{calls:?}");
        // With kernels timed, no region takes anything.
        for _ in 0..3 {
            r.begin(KEY, true);
            assert!(!r.launch("k", 7, GEOM, &mut args(&[1])));
            assert_eq!(r.finish(), RegionEnd::Ran);
        }
        let epoch = r.epoch();
        r.begin(None, false);
        assert_eq!(r.epoch(), epoch + 1);
    }
}
