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
        let key = self.key.take();
        let ending = match (mode, key) {
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
        self.key = key;
        ending
    }

    /// Keep `graph`, captured in the region just ended, with its tape.
    pub fn keep(&mut self, graph: G) {
        if let Some(k) = self.key {
            self.graphs.insert(k, (self.tape.clone(), graph));
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
}
