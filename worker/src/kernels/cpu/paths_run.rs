//! For the kernel tests: which paths a test ran, checked against the CPU's own feature list.
//!
//! A test that compares every path with the reference compares the reference with itself on a
//! CPU without SIMD paths. So each such test records the paths it ran and ends with
//! [`PathsRun::check`]: every path the CPU supports must have run, every path the kernel
//! `/proc/cpuinfo` flags claim must be supported (so a wrong feature test cannot quietly leave
//! only the scalar path), and where no SIMD path ran the test records a skip in the skip report
//! (`baton_shared::skip_report`) instead of passing.

use std::collections::BTreeSet;

use super::dispatch::KernelPath;

/// The paths the CPU's flags in `/proc/cpuinfo` claim, read independently of
/// `is_x86_feature_detected!`; None where there is no such file (not Linux).
pub(crate) fn claimed_by_cpuinfo() -> Option<BTreeSet<KernelPath>> {
    let info = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    let flags: BTreeSet<&str> = info
        .lines()
        .find(|l| l.starts_with("flags"))?
        .split_once(':')?
        .1
        .split_whitespace()
        .collect();
    Some(claimed_by_flags(&flags))
}

/// The kernel paths a CPU with these `/proc/cpuinfo` flags can run.
fn claimed_by_flags(flags: &BTreeSet<&str>) -> BTreeSet<KernelPath> {
    let has = |names: &[&str]| names.iter().all(|n| flags.contains(n));
    let mut paths = BTreeSet::from([KernelPath::Scalar]);
    if cfg!(target_arch = "x86_64") && has(&["avx2", "fma", "f16c"]) {
        paths.insert(KernelPath::Avx2);
        if has(&["avx_vnni"]) {
            paths.insert(KernelPath::AvxVnni);
        }
        if has(&["avx512f", "avx512bw", "avx512vl"]) {
            paths.insert(KernelPath::Avx512);
            if has(&["avx512_vnni"]) {
                paths.insert(KernelPath::Avx512Vnni);
            }
        }
    }
    paths
}

/// What a check is made against: which paths the dispatcher supports, which the CPU's flags
/// claim (None: unknown), and where a skip goes.
struct Machine<'a> {
    supported: &'a dyn Fn(KernelPath) -> bool,
    claimed: Option<BTreeSet<KernelPath>>,
    skip: &'a mut dyn FnMut(&str, &str),
}

impl Machine<'_> {
    /// This machine: `is_supported`, `/proc/cpuinfo`, the skip report.
    fn this<R>(f: impl FnOnce(&mut Machine<'_>) -> R) -> R {
        let mut skip = |test: &str, why: &str| baton_shared::skip_report::skip(test, why);
        f(&mut Machine {
            supported: &|p: KernelPath| p.is_supported(),
            claimed: claimed_by_cpuinfo(),
            skip: &mut skip,
        })
    }

    /// Fails if the CPU's flags claim `path` but the dispatcher says it is unsupported.
    fn assert_not_missed(&self, test: &str, path: KernelPath) {
        if let Some(claimed) = &self.claimed {
            assert!(
                !claimed.contains(&path) || (self.supported)(path),
                "{test}: /proc/cpuinfo claims the features of the {path} path, but KernelPath::is_supported says no"
            );
        }
    }

    fn require(&mut self, test: &str, path: KernelPath) -> bool {
        self.assert_not_missed(test, path);
        if (self.supported)(path) {
            return true;
        }
        (self.skip)(
            test,
            &format!("this CPU lacks the {path} path, whose kernel the test is about"),
        );
        false
    }

    fn check(&mut self, test: &str, ran: &BTreeSet<KernelPath>, paths: &[KernelPath]) {
        for &p in paths {
            self.assert_not_missed(test, p);
            assert!(
                !(self.supported)(p) || ran.contains(&p),
                "{test}: this CPU supports the {p} path but the test did not run it (ran {ran:?})"
            );
        }
        assert!(
            ran.iter().all(|&p| (self.supported)(p)),
            "{test}: ran paths this CPU does not support: {ran:?}"
        );
        if !ran.iter().any(|&p| p != KernelPath::Scalar) {
            let simd: Vec<_> = paths.iter().filter(|&&p| p != KernelPath::Scalar).collect();
            (self.skip)(
                test,
                &format!("no SIMD path ran (this CPU has none of {simd:?}): nothing but the scalar path was compared"),
            );
        }
    }
}

/// Whether `test` can run code of `path`: true if the CPU supports it; otherwise the skip is
/// recorded (and the test fails if the CPU's flags say the path should have been supported).
pub(crate) fn require(test: &str, path: KernelPath) -> bool {
    Machine::this(|m| m.require(test, path))
}

/// The paths one test ran.
pub(crate) struct PathsRun {
    test: &'static str,
    ran: BTreeSet<KernelPath>,
}

impl PathsRun {
    pub(crate) fn new(test: &'static str) -> Self {
        Self {
            test,
            ran: BTreeSet::new(),
        }
    }

    /// Note that the test ran (and compared) code of `path`.
    pub(crate) fn record(&mut self, path: KernelPath) {
        self.ran.insert(path);
    }

    /// The test has kernels for `paths`: each of them this CPU supports must have run, each the
    /// CPU's flags claim must be supported, and if only the scalar path ran the skip is recorded.
    pub(crate) fn check(self, paths: &[KernelPath]) {
        Machine::this(|m| m.check(self.test, &self.ran, paths));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_map_to_the_paths_they_enable() {
        let set = |s: &'static str| s.split_whitespace().collect::<BTreeSet<&str>>();
        use KernelPath::*;
        assert_eq!(claimed_by_flags(&set("sse2 avx")), BTreeSet::from([Scalar]));
        assert_eq!(
            claimed_by_flags(&set("avx2 fma")),
            BTreeSet::from([Scalar]),
            "f16c is needed"
        );
        if cfg!(target_arch = "x86_64") {
            assert_eq!(
                claimed_by_flags(&set("avx2 fma f16c avx_vnni")),
                BTreeSet::from([Scalar, Avx2, AvxVnni])
            );
            assert_eq!(
                claimed_by_flags(&set("avx2 fma f16c avx512f avx512bw avx512vl avx512_vnni")),
                BTreeSet::from([Scalar, Avx2, Avx512, Avx512Vnni])
            );
            assert_eq!(
                claimed_by_flags(&set("avx2 fma f16c avx512f avx512vl avx512_vnni")),
                BTreeSet::from([Scalar, Avx2]),
                "no avx512bw"
            );
        }
    }

    /// Runs `f` against a machine supporting `supported` whose flags claim `claimed`; returns
    /// the skips it recorded, or the panic message.
    fn on_machine(
        supported: &[KernelPath],
        claimed: &[KernelPath],
        f: impl FnOnce(&mut Machine<'_>),
    ) -> Result<Vec<String>, String> {
        let supported: BTreeSet<KernelPath> = supported.iter().copied().collect();
        let claimed: BTreeSet<KernelPath> = claimed.iter().copied().collect();
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut skips = Vec::new();
            let mut skip = |test: &str, why: &str| skips.push(format!("{test}: {why}"));
            f(&mut Machine {
                supported: &|p| supported.contains(&p),
                claimed: Some(claimed.clone()),
                skip: &mut skip,
            });
            skips
        }))
        .map_err(|e| *e.downcast::<String>().unwrap())
    }

    #[test]
    fn checks_fail_on_a_left_out_or_missed_path_and_record_a_scalar_only_run() {
        use KernelPath::*;
        let ran = |paths: &[KernelPath]| paths.iter().copied().collect::<BTreeSet<_>>();
        // Every supported path ran: nothing to say.
        assert_eq!(
            on_machine(&[Scalar, Avx2], &[Scalar, Avx2], |m| m.check(
                "t",
                &ran(&[Scalar, Avx2]),
                &KernelPath::ALL
            )),
            Ok(vec![])
        );
        // A supported path left out fails.
        let e = on_machine(&[Scalar, Avx2], &[Scalar, Avx2], |m| {
            m.check("t", &ran(&[Scalar]), &KernelPath::ALL)
        })
        .unwrap_err();
        assert!(e.contains("supports the avx2 path but the test did not run it"), "{e}");
        // A path the flags claim but the dispatcher denies fails, even if nothing else ran.
        let e = on_machine(&[Scalar], &[Scalar, Avx2], |m| {
            m.check("t", &ran(&[Scalar]), &KernelPath::ALL)
        })
        .unwrap_err();
        assert!(e.contains("/proc/cpuinfo claims the features of the avx2 path"), "{e}");
        // A CPU without SIMD: the scalar-only run is a recorded skip, not a pass.
        let skips = on_machine(&[Scalar], &[Scalar], |m| {
            m.check("t", &ran(&[Scalar]), &KernelPath::ALL)
        })
        .unwrap();
        assert_eq!(skips.len(), 1, "{skips:?}");
        assert!(skips[0].starts_with("t: no SIMD path ran"), "{skips:?}");
        // A test about one path: run where supported, a recorded skip where not.
        assert_eq!(
            on_machine(&[Scalar, Avx2], &[Scalar, Avx2], |m| assert!(m.require("t", Avx2))),
            Ok(vec![])
        );
        let skips = on_machine(&[Scalar, Avx2], &[Scalar, Avx2], |m| {
            assert!(!m.require("t", Avx512Vnni))
        })
        .unwrap();
        assert_eq!(
            skips,
            ["t: this CPU lacks the avx512-vnni path, whose kernel the test is about"]
        );
    }

    #[test]
    fn every_path_the_cpu_claims_is_supported() {
        let claimed = claimed_by_cpuinfo();
        eprintln!("/proc/cpuinfo claims {claimed:?}");
        for p in claimed.into_iter().flatten() {
            assert!(
                p.is_supported(),
                "{p}: claimed by /proc/cpuinfo, not supported by dispatch"
            );
        }
    }
}
