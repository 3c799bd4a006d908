//! Fuzz targets for Baton's parsers: one function per target in [`targets`], called by the
//! libFuzzer binaries in `fuzz_targets/` and, without libFuzzer, by `tests/replay.rs` (which
//! replays `corpus/` and `regressions/`). A target's only check is that nothing panics, hangs
//! or allocates without bound: every `Err` a parser returns is a correct answer.

pub mod fixtures;
pub mod targets;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// A scratch directory of this process (under `$TMPDIR`), for parsers that only take a path.
pub fn scratch() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let base = if Path::new("/dev/shm").is_dir() && std::env::var_os("TMPDIR").is_none() {
            PathBuf::from("/dev/shm")
        } else {
            std::env::temp_dir()
        };
        let dir = base.join(format!("baton-fuzz-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create the fuzz scratch directory");
        dir
    })
}

/// A fresh, empty subdirectory `name` of [`scratch`].
pub fn scratch_dir(name: &str) -> PathBuf {
    let dir = scratch().join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create a fuzz scratch subdirectory");
    dir
}

/// Write `bytes` to `dir/name` and return the path.
pub fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, bytes).expect("write a fuzz input file");
    path
}

/// Split `data` at every `sep` byte (at most `n` parts; the last keeps the rest).
pub fn split_parts(data: &[u8], sep: u8, n: usize) -> Vec<&[u8]> {
    data.splitn(n, |&b| b == sep).collect()
}

/// Length-delimited prost messages, each preceded by one tag byte: `(tag, message bytes)`,
/// until the input ends or a length does not fit.
pub fn tagged_messages(mut data: &[u8], max: usize) -> Vec<(u8, &[u8])> {
    let mut out = Vec::new();
    while out.len() < max && !data.is_empty() {
        let tag = data[0];
        data = &data[1..];
        let mut buf = data;
        let Ok(len) = prost::encoding::decode_varint(&mut buf) else {
            break;
        };
        let Ok(len) = usize::try_from(len) else { break };
        if len > buf.len() {
            break;
        }
        out.push((tag, &buf[..len]));
        data = &buf[len..];
    }
    out
}

/// Append `tag` and `msg` (length-delimited) to `out`: the inverse of [`tagged_messages`].
pub fn push_tagged(out: &mut Vec<u8>, tag: u8, msg: &impl prost::Message) {
    out.push(tag);
    msg.encode_length_delimited(out).expect("a Vec grows");
}
