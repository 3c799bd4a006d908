//! A persistent thread pool for the CPU kernels.
//!
//! `n` threads take part in every job: the caller plus `n - 1` workers created once. A job is
//! "run task i for i in 0..tasks"; each thread starts on its own contiguous range of tasks and
//! then steals what is left of the others'. Which thread runs a task never changes what the task
//! computes (kernels split work into fixed chunks of output rows), so results are identical for
//! any thread count. Submitting a job allocates nothing. A panicking task is caught, the job is
//! finished, and the panic is raised again in the caller.
//!
//! Waiting threads spin briefly (consecutive matrix products in a layer are microseconds apart)
//! and then block on a condition variable: this machine is shared, and threads that spin forever
//! collapse throughput when another process takes a core.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long a waiting thread spins before it blocks.
const SPIN: Duration = Duration::from_micros(50);

/// Spin until `ready()` or `SPIN` has passed; returns whether it became ready.
fn spin_until(ready: impl Fn() -> bool) -> bool {
    let start = Instant::now();
    loop {
        // Check the clock only every 64 rounds: `pause` is cheap, `Instant::now` is not.
        for _ in 0..64 {
            if ready() {
                return true;
            }
            std::hint::spin_loop();
        }
        if start.elapsed() > SPIN {
            return ready();
        }
    }
}

/// A job's task function with its lifetime erased; valid only while `run` is on the stack.
#[derive(Clone, Copy)]
struct JobPtr(*const (dyn Fn(usize) + Sync));

// SAFETY: the pointee is `Sync`, and it is only called for a task claimed in its own job, which
// `run` waits for before returning.
unsafe impl Send for JobPtr {}

#[derive(Clone, Copy)]
struct Job {
    func: JobPtr,
    tasks: usize,
    generation: u32,
}

impl Job {
    /// End of the task range thread `j` of `n` starts with.
    fn range_end(&self, j: usize, n: usize) -> usize {
        self.tasks * (j + 1) / n
    }
}

/// An atomic on its own cache line (two, against adjacent-line prefetch).
#[repr(align(128))]
struct Padded(AtomicU64);

struct Shared {
    /// The current job, published under the lock.
    job: Mutex<Option<Job>>,
    wake: Condvar,
    /// Generation of the latest job; workers spin on it.
    generation: AtomicU64,
    /// Per thread: job generation (high 32 bits) and next task index (low 32 bits) of the
    /// contiguous task range that thread starts with. Each thread claims from its own line
    /// (claims from one shared counter bounce it between cores on every task, which cost more
    /// than small products themselves) and then steals from the others. Packing the generation
    /// in means a worker that wakes late can never claim a later job's task with an earlier
    /// job's function.
    claims: Vec<Padded>,
    /// Tasks of the current job finished.
    completed: AtomicUsize,
    /// Whether a task of the current job panicked.
    panicked: AtomicBool,
    done_lock: Mutex<()>,
    done: Condvar,
    shutdown: AtomicBool,
}

/// A fixed set of threads that run index-parallel jobs; see the module docs.
pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// Serialises callers (one job at a time) and counts jobs.
    submit: Mutex<u32>,
}

impl std::fmt::Debug for ThreadPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadPool").field("threads", &self.threads()).finish()
    }
}

impl ThreadPool {
    /// A pool of `threads` threads in all (the caller counts as one; 0 is treated as 1).
    pub fn new(threads: usize) -> Self {
        let shared = Arc::new(Shared {
            job: Mutex::new(None),
            wake: Condvar::new(),
            generation: AtomicU64::new(0),
            claims: (0..threads.max(1)).map(|_| Padded(AtomicU64::new(0))).collect(),
            completed: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            done_lock: Mutex::new(()),
            done: Condvar::new(),
            shutdown: AtomicBool::new(false),
        });
        let workers = (1..threads.max(1))
            .map(|i| {
                let s = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!("baton-cpu-{i}"))
                    .spawn(move || worker_loop(&s, i))
                    .expect("spawning a kernel thread")
            })
            .collect();
        Self {
            shared,
            workers,
            submit: Mutex::new(0),
        }
    }

    /// A pool with one thread per available core.
    pub fn with_available_parallelism() -> Self {
        Self::new(std::thread::available_parallelism().map_or(1, |n| n.get()))
    }

    /// Threads taking part in each job, the caller included.
    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Run `f(i)` for every `i` in `0..tasks`, spread over the pool; returns when all are done.
    ///
    /// The caller works too and waits only for tasks, never for a worker to show up: a worker
    /// that has no core right now (another process took it) costs nothing.
    pub fn run(&self, tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        if tasks == 0 {
            return;
        }
        if self.workers.is_empty() || tasks == 1 {
            (0..tasks).for_each(f);
            return;
        }
        assert!(tasks < 1 << 32, "too many tasks for one job");
        let mut gen_guard = self.submit.lock().unwrap_or_else(|e| e.into_inner());
        *gen_guard = gen_guard.wrapping_add(1);
        let generation = *gen_guard;
        let s = &*self.shared;
        // SAFETY: only the lifetime is erased; see `JobPtr`.
        let func = JobPtr(unsafe {
            std::mem::transmute::<*const (dyn Fn(usize) + Sync + '_), *const (dyn Fn(usize) + Sync)>(f)
        });
        let job = Job {
            func,
            tasks,
            generation,
        };
        s.completed.store(0, Ordering::Relaxed);
        s.panicked.store(false, Ordering::Relaxed);
        let n = s.claims.len();
        for (j, c) in s.claims.iter().enumerate() {
            let start = if j == 0 { 0 } else { job.range_end(j - 1, n) };
            c.0.store(u64::from(generation) << 32 | start as u64, Ordering::Relaxed);
        }
        *s.job.lock().unwrap_or_else(|e| e.into_inner()) = Some(job);
        s.generation.store(u64::from(generation), Ordering::Release);
        s.wake.notify_all();
        let mine = claim_tasks(s, job, 0);
        if s.completed.fetch_add(mine, Ordering::AcqRel) + mine < tasks {
            let finished = || s.completed.load(Ordering::Acquire) >= tasks;
            if !spin_until(finished) {
                let mut guard = s.done_lock.lock().unwrap_or_else(|e| e.into_inner());
                while !finished() {
                    guard = s.done.wait(guard).unwrap_or_else(|e| e.into_inner());
                }
            }
        }
        *s.job.lock().unwrap_or_else(|e| e.into_inner()) = None;
        if s.panicked.load(Ordering::Acquire) {
            panic!("a thread-pool task panicked");
        }
    }
}

/// Claim and run tasks of `job`, from thread `me`'s own range first, then from the others';
/// returns how many this thread ran.
fn claim_tasks(s: &Shared, job: Job, me: usize) -> usize {
    let n = s.claims.len();
    let mut ran = 0;
    for k in 0..n {
        let j = (me + k) % n;
        let (counter, end) = (&s.claims[j].0, job.range_end(j, n));
        let mut c = counter.load(Ordering::Acquire);
        loop {
            let (generation, i) = ((c >> 32) as u32, (c & 0xFFFF_FFFF) as usize);
            if generation != job.generation || i >= end {
                break;
            }
            match counter.compare_exchange_weak(c, c + 1, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => {
                    // SAFETY: task i of this job is unfinished, so `run` is still waiting and
                    // the closure alive.
                    let task = std::panic::AssertUnwindSafe(|| unsafe { (*job.func.0)(i) });
                    // A panic must not unwind past this point: the caller would return while
                    // workers still use its closure, or a worker would die and never report.
                    if std::panic::catch_unwind(task).is_err() {
                        s.panicked.store(true, Ordering::Release);
                    }
                    ran += 1;
                    c = counter.load(Ordering::Acquire);
                }
                Err(now) => c = now,
            }
        }
    }
    ran
}

fn worker_loop(s: &Shared, me: usize) {
    let mut seen = 0u32;
    loop {
        // Spin first: the next job usually follows within microseconds.
        spin_until(|| s.generation.load(Ordering::Acquire) as u32 != seen || s.shutdown.load(Ordering::Relaxed));
        let job = {
            let mut job = s.job.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                if s.shutdown.load(Ordering::Relaxed) {
                    return;
                }
                match *job {
                    Some(j) if j.generation != seen => break j,
                    _ => job = s.wake.wait(job).unwrap_or_else(|e| e.into_inner()),
                }
            }
        };
        seen = job.generation;
        let ran = claim_tasks(s, job, me);
        if ran > 0 && s.completed.fetch_add(ran, Ordering::AcqRel) + ran >= job.tasks {
            // Possibly the last: take the lock so the wake-up cannot fall between the caller's
            // check and its wait.
            let _g = s.done_lock.lock().unwrap_or_else(|e| e.into_inner());
            s.done.notify_one();
        }
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        {
            let _job = self.shared.job.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.shutdown.store(true, Ordering::Relaxed);
        }
        self.shared.wake.notify_all();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

/// A mutable slice that tasks of one job write to at disjoint indices.
pub struct SharedMut<'a, T> {
    ptr: *mut T,
    len: usize,
    _life: std::marker::PhantomData<&'a mut [T]>,
}

// SAFETY: callers of `slice` guarantee disjoint ranges across threads.
unsafe impl<T: Send> Sync for SharedMut<'_, T> {}
unsafe impl<T: Send> Send for SharedMut<'_, T> {}

impl<'a, T> SharedMut<'a, T> {
    /// Wrap `s` for the duration of a job.
    pub fn new(s: &'a mut [T]) -> Self {
        Self {
            ptr: s.as_mut_ptr(),
            len: s.len(),
            _life: std::marker::PhantomData,
        }
    }

    /// The sub-slice `start..start + len`.
    ///
    /// # Safety
    /// No two live sub-slices handed out by one `SharedMut` may overlap.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice(&self, start: usize, len: usize) -> &mut [T] {
        assert!(start + len <= self.len, "SharedMut range out of bounds");
        // SAFETY: in bounds (checked); disjointness is the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(start), len) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn squares(pool: &ThreadPool, n: usize) -> Vec<u64> {
        let mut out = vec![0u64; n];
        let shared = SharedMut::new(&mut out);
        pool.run(n.div_ceil(7), &|chunk| {
            let start = chunk * 7;
            let len = 7.min(n - start);
            // SAFETY: chunks are disjoint.
            let dst = unsafe { shared.slice(start, len) };
            for (j, d) in dst.iter_mut().enumerate() {
                let i = (start + j) as u64;
                *d = i * i + 1;
            }
        });
        out
    }

    #[test]
    fn results_do_not_depend_on_thread_count() {
        let want = squares(&ThreadPool::new(1), 1000);
        for threads in [2, 3] {
            let pool = ThreadPool::new(threads);
            for _ in 0..200 {
                assert_eq!(squares(&pool, 1000), want, "{threads} threads");
            }
        }
    }

    #[test]
    fn every_task_runs_exactly_once_after_idle_periods() {
        let pool = ThreadPool::new(3);
        for round in 0..5 {
            let count = AtomicUsize::new(0);
            pool.run(100, &|_| {
                count.fetch_add(1, Ordering::Relaxed);
            });
            assert_eq!(count.load(Ordering::Relaxed), 100);
            if round == 2 {
                // Long enough for the workers to stop spinning and block.
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
        }
    }

    #[test]
    fn a_panicking_task_reaches_the_caller_and_the_pool_survives() {
        let pool = ThreadPool::new(2);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.run(10, &|i| assert!(i != 7, "task 7 fails"));
        }));
        assert!(r.is_err());
        assert_eq!(squares(&pool, 50)[3], 10);
    }

    #[test]
    fn pool_can_be_shared_between_callers() {
        let pool = Arc::new(ThreadPool::new(2));
        let handles: Vec<_> = (0..3)
            .map(|_| {
                let p = Arc::clone(&pool);
                std::thread::spawn(move || {
                    for _ in 0..50 {
                        assert_eq!(squares(&p, 100)[9], 82);
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
    }
}
