//! How a test that cannot check what it is named for says so: it records a skip, which CI
//! counts, instead of passing.
//!
//! A skip is a line `SKIPPED <test>: <why>` appended to the file named by `BATON_SKIP_REPORT`
//! (`.ci/test` sets it, prints the file at the end, and `.ci/run` fails on any skip not listed
//! in `.ci/expected-skips`). Without that variable a skip could not be counted, so [`skip`]
//! fails the test instead: a skip is never a pass.

use std::io::Write;

/// The variable naming the skip report file.
pub const VAR: &str = "BATON_SKIP_REPORT";

/// Record that `test` checked nothing (or less than its name says) because of `why`.
///
/// Panics when `BATON_SKIP_REPORT` is unset or the file cannot be written.
pub fn skip(test: &str, why: &str) {
    record(std::env::var_os(VAR), test, why);
}

/// [`skip`] into `report` (the variable's value).
fn record(report: Option<std::ffi::OsString>, test: &str, why: &str) {
    let line = format!("SKIPPED {test}: {}", why.replace('\n', " "));
    eprintln!("{line}");
    let Some(path) = report.filter(|p| !p.is_empty()) else {
        panic!(
            "{line}\nA skip must be counted, and {VAR} names no file to count it in: set {VAR}=FILE (as \
             .ci/test does) to record the skip, or provide what the test needs"
        );
    };
    let written = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        // One write per line, so lines of parallel tests do not interleave.
        .and_then(|mut f| f.write_all(format!("{line}\n").as_bytes()));
    if let Err(e) = written {
        panic!("{line}\ncannot record it in {VAR}={}: {e}", path.to_string_lossy());
    }
}

#[cfg(test)]
mod tests {
    use super::record;

    #[test]
    fn a_skip_is_appended_as_one_line_and_fails_where_nobody_counts_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("skips.txt");
        std::fs::write(&path, "SKIPPED earlier: reason\n").unwrap();
        record(Some(path.clone().into()), "my_test", "no widget\non this machine");
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "SKIPPED earlier: reason\nSKIPPED my_test: no widget on this machine\n"
        );
        for unset in [None, Some("".into())] {
            let unrecorded = std::panic::catch_unwind(|| record(unset, "my_test", "why"));
            assert!(unrecorded.is_err(), "a skip nobody counts fails its test");
        }
        let unwritable = std::panic::catch_unwind(|| record(Some(dir.path().into()), "my_test", "why"));
        assert!(unwritable.is_err(), "a skip that cannot be recorded fails its test");
    }
}
