//! `baton serve` as a child process for end-to-end tests, and a minimal HTTP/1.1 client.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::baton_bin;

/// Test inputs that share baton's `BATON_` prefix but are not settings, kept away from baton.
const NOT_SETTINGS: &[&str] = &["BATON_TEST_PYTHON", "BATON_BASE_URL"];

/// A `baton serve` child process, killed when dropped.
pub struct Server {
    child: Child,
    stderr: tempfile::NamedTempFile,
}

impl Server {
    /// Start `baton serve EXTRA --port 0` on a free port; returns it and its `/v1` base URL.
    pub fn start(model: &Path, extra: &[&str]) -> (Self, String) {
        let stderr = tempfile::NamedTempFile::new().unwrap();
        let mut cmd = Command::new(baton_bin());
        cmd.arg("serve")
            .args(extra)
            .args(["--port", "0", "--model"])
            .arg(model)
            .stdout(Stdio::piped())
            .stderr(stderr.reopen().unwrap());
        for var in NOT_SETTINGS {
            cmd.env_remove(var);
        }
        let mut child = cmd.spawn().expect("starting baton serve");
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let mut server = Self { child, stderr };
        // "Baton serving NAME at http://HOST:PORT/v1"
        let line = rx.recv_timeout(Duration::from_secs(180)).unwrap_or_else(|e| {
            panic!(
                "baton serve printed no ready line ({e}); stderr:\n{}",
                server.stderr_text()
            )
        });
        let url = line
            .split_whitespace()
            .find(|w| w.starts_with("http://"))
            .unwrap_or_else(|| panic!("no URL in {line:?}"))
            .to_string();
        assert!(line.starts_with("Baton serving "), "{line}");
        server.wait_ready(&url);
        (server, url)
    }

    pub fn stderr_text(&mut self) -> String {
        let mut s = String::new();
        let _ = self.stderr.reopen().and_then(|mut f| f.read_to_string(&mut s));
        s
    }

    /// Poll `GET /ready` until it answers 200.
    pub fn wait_ready(&mut self, base_url: &str) {
        let addr = base_url
            .trim_start_matches("http://")
            .trim_end_matches("/v1")
            .to_string();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!("baton serve exited ({status}); stderr:\n{}", self.stderr_text());
            }
            if http_status(&addr, "/ready") == Some(200) {
                return;
            }
            assert!(Instant::now() < deadline, "/ready never answered 200");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Server {
    /// Process id of the server.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Process ids of the server's child processes (its workers), from /proc.
    pub fn children(&self) -> Vec<u32> {
        let me = self.pid().to_string();
        let mut out = Vec::new();
        for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
                continue;
            };
            // "pid (comm) state ppid ..."; comm may contain spaces, so split after the last ')'.
            let Some(rest) = stat.rfind(')').map(|i| &stat[i + 1..]) else {
                continue;
            };
            if rest.split_whitespace().nth(1) == Some(me.as_str())
                && let Ok(pid) = entry.file_name().to_string_lossy().parse()
            {
                out.push(pid);
            }
        }
        out
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The status code of `GET path`, or None if the server does not answer.
pub fn http_status(addr: &str, path: &str) -> Option<u16> {
    let mut conn = TcpStream::connect(addr).ok()?;
    conn.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(conn, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").ok()?;
    let mut head = [0u8; 12];
    conn.read_exact(&mut head).ok()?;
    std::str::from_utf8(&head[9..12]).ok()?.parse().ok()
}

/// Send one request (`Connection: close`) and return the status code and body.
pub fn http_request(addr: &str, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut conn = TcpStream::connect(addr).expect("connecting");
    conn.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    write!(
        conn,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = String::new();
    let _ = conn.read_to_string(&mut raw);
    let status = raw.get(9..12).and_then(|s| s.parse().ok()).unwrap_or(0);
    let body = raw.split_once("\r\n\r\n").map_or(String::new(), |(_, b)| b.to_string());
    (status, body)
}
