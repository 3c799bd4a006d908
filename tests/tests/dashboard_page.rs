//! The `/dashboard` page in a real browser (headless Chromium) against a real `baton serve`: it
//! draws every stage of a 2-worker pipeline as `/admin/cluster` reports it, its numbers move when
//! tokens are generated, `--workers 0` shows one local stage, and a failed refresh shows a banner.
//!
//! Without Chromium these tests fail, saying how to install it; `BATON_SKIP_BROWSER_TESTS=1`
//! skips the browser part instead and records the skip in the skip report
//! (`baton_shared::skip_report`: it fails without one, and CI fails on it), so a skip is never a
//! pass. `BATON_DASHBOARD_SCREENSHOT=PATH` keeps the screenshot of the live 2-stage cluster
//! (docs/dashboard.png is made that way).

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use baton_tests::default_model;
use baton_tests::serve::{Server, http_request};

const SKIP_VAR: &str = "BATON_SKIP_BROWSER_TESTS";

/// Longest any single browser run may take before it is killed.
const BROWSER_LIMIT: Duration = Duration::from_secs(90);

/// Headless Chromium for `test`, or None when skipping was asked for (the skip is recorded in
/// the skip report). Never a silent pass: a missing browser without the skip variable fails
/// the test, and so does a skip with no report to count it in.
fn browser(test: &str) -> Option<Browser> {
    if std::env::var(SKIP_VAR).is_ok_and(|v| v == "1") {
        baton_shared::skip_report::skip(
            &format!("dashboard_page::{test}"),
            &format!("the browser checks of the /dashboard page were skipped ({SKIP_VAR}=1)"),
        );
        return None;
    }
    let names: Vec<PathBuf> = match std::env::var_os("BATON_CHROMIUM") {
        Some(p) => vec![p.into()],
        None => ["chromium", "chromium-browser", "google-chrome", "google-chrome-stable"]
            .iter()
            .map(PathBuf::from)
            .collect(),
    };
    let found = names.iter().find_map(|n| find_executable(n));
    match found {
        Some(bin) => Some(Browser { bin }),
        None => panic!(
            "headless Chromium is needed to test the /dashboard page and none was found (looked for {names:?}, names \
             on PATH). Install it (Debian/Ubuntu: `apt-get install -y chromium`; .ci/run does this), point \
             BATON_CHROMIUM at a Chromium or Chrome binary, or set {SKIP_VAR}=1 to skip the browser checks"
        ),
    }
}

fn find_executable(name: &Path) -> Option<PathBuf> {
    if name.components().count() > 1 {
        return name.is_file().then(|| name.to_path_buf());
    }
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}

struct Browser {
    bin: PathBuf,
}

impl Browser {
    /// Run headless Chromium on `url` with `args` (its own profile, killed with everything it
    /// started if it outlives [`BROWSER_LIMIT`]); returns its stdout.
    fn run(&self, url: &str, args: &[String]) -> String {
        let profile = tempfile::tempdir().unwrap();
        let stdout = tempfile::NamedTempFile::new().unwrap();
        let stderr = tempfile::NamedTempFile::new().unwrap();
        let mut child = Command::new(&self.bin)
            .args([
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--no-default-browser-check",
                "--disable-extensions",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--mute-audio",
            ])
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .args(args)
            .arg(url)
            .stdin(Stdio::null())
            .stdout(stdout.reopen().unwrap())
            .stderr(stderr.reopen().unwrap())
            // Its own process group, so a timeout can end the renderer and helpers too.
            .process_group(0)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", self.bin.display()));
        let started = Instant::now();
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            if started.elapsed() > BROWSER_LIMIT {
                let _ = Command::new("kill")
                    .args(["-KILL", &format!("-{}", child.id())])
                    .status();
                let _ = child.wait();
                panic!(
                    "headless Chromium did not finish within {BROWSER_LIMIT:?} on {url}; stderr:\n{}",
                    read(stderr.path())
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        let out = read(stdout.path());
        assert!(
            status.success(),
            "headless Chromium failed ({status}) on {url}; stderr:\n{}",
            read(stderr.path())
        );
        out
    }

    /// The page's DOM after `budget_ms` of (virtual) time: several refreshes.
    fn dump_dom(&self, url: &str, budget_ms: u32) -> Dom {
        let html = self.run(
            url,
            &[format!("--virtual-time-budget={budget_ms}"), "--dump-dom".into()],
        );
        assert!(html.contains("</html>"), "no DOM from Chromium:\n{html}");
        Dom(html)
    }

    /// A 1280×800 PNG of the page after `budget_ms`.
    fn screenshot(&self, url: &str, budget_ms: u32, path: &Path) {
        self.run(
            url,
            &[
                format!("--virtual-time-budget={budget_ms}"),
                format!("--screenshot={}", path.display()),
                "--window-size=1280,800".into(),
                "--hide-scrollbars".into(),
            ],
        );
    }
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

/// Chromium's serialized DOM, with just enough parsing for these checks.
struct Dom(String);

impl Dom {
    /// Attributes of every start tag that has attribute `marker`.
    fn tags_with(&self, marker: &str) -> Vec<HashMap<String, String>> {
        let html = &self.0;
        let mut out = Vec::new();
        let needle = format!(" {marker}=\"");
        let mut from = 0;
        while let Some(at) = html[from..].find(&needle) {
            let at = from + at;
            let start = html[..at].rfind('<').unwrap();
            let end = at + html[at..].find('>').unwrap();
            out.push(attributes(&html[start..end]));
            from = end;
        }
        out
    }

    /// The start tag and text of the element with `id` (text up to its first child tag).
    fn by_id(&self, id: &str) -> (HashMap<String, String>, String) {
        let html = &self.0;
        let at = html
            .find(&format!(" id=\"{id}\""))
            .unwrap_or_else(|| panic!("no #{id} in the DOM:\n{html}"));
        let start = html[..at].rfind('<').unwrap();
        let end = at + html[at..].find('>').unwrap();
        let text_end = end + 1 + html[end + 1..].find('<').unwrap();
        (attributes(&html[start..end]), unescape(&html[end + 1..text_end]))
    }

    fn value_of(&self, id: &str) -> u64 {
        let (attrs, text) = self.by_id(id);
        attrs
            .get("data-value")
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("#{id} has no numeric data-value ({attrs:?}, text {text:?})"))
    }

    fn contains(&self, text: &str) -> bool {
        self.0.contains(text)
    }
}

/// `name="value"` pairs of a start tag as Chromium serializes it (double quotes, escaped).
fn attributes(tag: &str) -> HashMap<String, String> {
    let mut out = HashMap::new();
    let mut rest = tag.trim_start_matches('<');
    rest = rest.split_once(' ').map_or("", |(_, r)| r);
    loop {
        rest = rest.trim_start();
        if rest.is_empty() {
            break;
        }
        let name_end = rest.find(['=', ' ']).unwrap_or(rest.len());
        let name = rest[..name_end].to_string();
        rest = &rest[name_end..];
        if let Some(r) = rest.strip_prefix("=\"") {
            let close = r.find('"').unwrap_or(r.len());
            out.insert(name, unescape(&r[..close]));
            rest = r.get(close + 1..).unwrap_or("");
        } else {
            out.insert(name, String::new());
        }
    }
    out
}

fn unescape(s: &str) -> String {
    s.replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", "\"")
        .replace("&nbsp;", "\u{a0}")
        .replace("&amp;", "&")
}

fn cluster_view(addr: &str) -> serde_json::Value {
    let (code, body) = http_request(addr, "GET", "/admin/cluster", "");
    assert_eq!(code, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

fn complete(addr: &str, max_tokens: usize) {
    let body = format!(
        r#"{{"prompt": "Once upon a time", "max_tokens": {max_tokens}, "ignore_eos": true, "temperature": 0}}"#
    );
    let (code, body) = http_request(addr, "POST", "/v1/completions", &body);
    assert_eq!(code, 200, "{body}");
}

/// The stage boxes as the page drew them, by worker id.
fn drawn_stages(dom: &Dom) -> HashMap<String, HashMap<String, String>> {
    dom.tags_with("data-layer-start")
        .into_iter()
        .map(|t| (t["data-worker-id"].clone(), t))
        .collect()
}

/// Every stage `/admin/cluster` reports is drawn with its worker id, address, layer range.
fn assert_stages_drawn(dom: &Dom, view: &serde_json::Value, state: &str) {
    let stages = view["stages"].as_array().unwrap();
    let drawn = drawn_stages(dom);
    assert_eq!(drawn.len(), stages.len(), "one box per stage: {drawn:?}");
    for s in stages {
        let id = s["worker_id"].as_str().unwrap();
        let box_ = drawn
            .get(id)
            .unwrap_or_else(|| panic!("worker {id} is not drawn: {drawn:?}"));
        let (start, end) = (s["layer_start"].as_u64().unwrap(), s["layer_end"].as_u64().unwrap());
        assert_eq!(box_["data-address"], s["address"].as_str().unwrap(), "{box_:?}");
        assert_eq!(box_["data-stage"], s["stage"].to_string(), "{box_:?}");
        assert_eq!(
            (box_["data-layer-start"].as_str(), box_["data-layer-end"].as_str()),
            (start.to_string().as_str(), end.to_string().as_str())
        );
        assert_eq!(box_["data-state"], state, "{box_:?}");
        // What a reader sees, not only attributes.
        assert!(dom.contains(&format!(">{id}<")), "worker id {id} not shown");
        assert!(
            dom.contains(&format!(">{}<", s["address"].as_str().unwrap())),
            "address not shown"
        );
        assert!(
            dom.contains(&format!(">{start}..{end} ({})<", end - start)),
            "layers not shown"
        );
    }
}

fn assert_no_error_banner(dom: &Dom) {
    let (attrs, text) = dom.by_id("error");
    assert!(attrs.contains_key("hidden"), "error banner shown: {text}");
}

/// Forwards requests to `target`, holding each `/admin/cluster` answer for `delay`. Headless
/// Chromium's virtual time skips the page's timers; a held answer makes a refresh take real time,
/// so the page's rates are over real seconds, as in a real browser.
fn pacing_proxy(target: String, delay: Duration) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            let target = target.clone();
            std::thread::spawn(move || {
                let _ = proxy_one(conn, &target, delay);
            });
        }
    });
    addr
}

fn proxy_one(mut conn: TcpStream, target: &str, delay: Duration) -> std::io::Result<()> {
    let mut reader = BufReader::new(conn.try_clone()?);
    let mut request_line = String::new();
    reader.read_line(&mut request_line)?;
    // Skip the headers; the page only sends GETs.
    let mut line = String::new();
    while reader.read_line(&mut line)? > 2 {
        line.clear();
    }
    let path = request_line.split_whitespace().nth(1).unwrap_or("/").to_string();
    if path == "/admin/cluster" {
        std::thread::sleep(delay);
    }
    let (code, body) = http_request(target, "GET", &path, "");
    let kind = if path == "/dashboard" {
        "text/html; charset=utf-8"
    } else {
        "application/json"
    };
    write!(
        conn,
        "HTTP/1.1 {code} X\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    conn.flush()
}

#[test]
fn dashboard_shows_a_live_two_stage_cluster() {
    // A fixed step budget: the batch counts checked below must not depend on how the workers'
    // profiles size it on a loaded machine (a small budget splits the prompt into chunks).
    let (mut server, url) = Server::start(&default_model(), &["--workers", "2", "--max-batch-tokens", "64"]);
    let addr = url.trim_start_matches("http://").trim_end_matches("/v1").to_string();
    let page = format!("http://{addr}/dashboard");

    let (code, html) = http_request(&addr, "GET", "/dashboard", "");
    assert_eq!(code, 200, "{html}");
    assert!(
        html.starts_with("<!doctype html>") && !html.contains("https://"),
        "{html}"
    );

    // The numbers the page draws, from the real cluster.
    let view = cluster_view(&addr);
    let stages = view["stages"].as_array().unwrap();
    assert_eq!(stages.len(), 2, "{view}");
    assert_eq!(view["generated_tokens_total"], 0, "{view}");
    for s in stages {
        assert_eq!(s["alive"], true, "{s}");
        assert!(
            s["device"].is_string() && s["cores"].is_u64(),
            "worker details with each stage: {s}"
        );
    }
    complete(&addr, 8);
    // Stage numbers come from polling the workers (every 500 ms): wait until every stage's
    // numbers include the request, then check them exactly.
    let mut after = serde_json::Value::Null;
    baton_tests::wait_until("every stage's polled numbers include the request", || {
        after = cluster_view(&addr);
        let stages = after["stages"].as_array().cloned().unwrap_or_default();
        let caught_up = stages.len() == 2
            && stages
                .iter()
                .all(|s| s["live"]["forward_batches"].as_u64().is_some_and(|n| n >= 8));
        if caught_up { Ok(()) } else { Err(after.to_string()) }
    });
    assert_eq!(after["generated_tokens_total"], 8, "{after}");
    assert_eq!(after["prompt_tokens_total"], 4, "{after}");
    assert!(after["steps_completed"].as_u64().unwrap() >= 8, "{after}");
    for s in after["stages"].as_array().unwrap() {
        let live = &s["live"];
        assert_eq!(live["loaded"], true, "{s}");
        assert!(live["error"].is_null(), "{s}");
        // 8 tokens: the prefill batch and 7 decode batches (the last token is never fed back).
        assert_eq!(live["forward_batches"], 8, "{s}");
        assert_eq!(live["forward_tokens"], 4 + 7, "{s}");
        assert!(live["forward_seconds"].as_f64().unwrap() > 0.0, "{s}");
        assert_eq!(live["kv_tokens"], 0, "finished sequences are freed: {s}");
    }

    let Some(browser) = browser("dashboard_shows_a_live_two_stage_cluster") else {
        return;
    };
    let before = browser.dump_dom(&page, 4000);
    let view = cluster_view(&addr);
    assert_stages_drawn(&before, &view, "ready");
    assert_no_error_banner(&before);
    let (_, replans) = before.by_id("replans");
    assert!(
        replans.starts_with("0 re-plan(s) while serving, 0 sequence(s) moved"),
        "re-plans are shown: {replans}"
    );
    assert!(
        before.value_of("refreshes") >= 2,
        "the page refreshes by itself: {}",
        before.by_id("refreshes").1
    );
    let (_, updated) = before.by_id("updated");
    assert_ne!(updated, "never", "a last-updated time is shown");
    assert_eq!(before.value_of("generated-total"), 8);

    complete(&addr, 5);
    let after = browser.dump_dom(&page, 3000);
    assert_stages_drawn(&after, &view, "ready");
    assert_eq!(
        after.value_of("generated-total"),
        13,
        "the page shows the new tokens: {}",
        after.by_id("generated-total").1
    );

    // A screenshot under load: two clients generating while the page refreshes in real time.
    let stop = Arc::new(AtomicBool::new(false));
    let load: Vec<_> = (0..2)
        .map(|_| {
            let (addr, stop) = (addr.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    complete(&addr, 24);
                }
            })
        })
        .collect();
    baton_tests::wait_until("the load is generating", || {
        let total = cluster_view(&addr)["generated_tokens_total"].as_u64().unwrap_or(0);
        if total > 13 {
            Ok(())
        } else {
            Err(format!("{total} tokens generated in all"))
        }
    });
    let proxy = pacing_proxy(addr.clone(), Duration::from_millis(900));
    let shot_dir = tempfile::tempdir().unwrap();
    let shot = shot_dir.path().join("dashboard.png");
    let paced = format!("http://{proxy}/dashboard");
    browser.screenshot(&paced, 8000, &shot);
    let during = browser.dump_dom(&paced, 4000);
    stop.store(true, Ordering::Relaxed);
    for t in load {
        t.join().unwrap();
    }
    let (_, tps) = during.by_id("throughput");
    let tps: f64 = tps
        .replace(',', "")
        .parse()
        .unwrap_or_else(|_| panic!("throughput {tps:?}"));
    assert!(tps > 0.0, "tokens/s under load");
    let png = std::fs::read(&shot).unwrap();
    assert!(
        png.starts_with(b"\x89PNG\r\n\x1a\n") && png.len() > 10_000,
        "{} bytes",
        png.len()
    );
    if let Some(keep) = std::env::var_os("BATON_DASHBOARD_SCREENSHOT") {
        std::fs::copy(&shot, &keep).unwrap();
    }
    assert!(server.stderr_text().lines().all(|l| !l.contains("panicked")));
}

#[test]
fn dashboard_shows_the_in_process_engine_as_one_stage() {
    let (_server, url) = Server::start(&default_model(), &["--workers", "0"]);
    let addr = url.trim_start_matches("http://").trim_end_matches("/v1").to_string();
    complete(&addr, 3);
    let view = cluster_view(&addr);
    assert_eq!(view["mode"], "in-process");
    assert_eq!(view["generated_tokens_total"], 3, "{view}");
    let Some(browser) = browser("dashboard_shows_the_in_process_engine_as_one_stage") else {
        return;
    };
    let dom = browser.dump_dom(&format!("http://{addr}/dashboard"), 3000);
    assert_stages_drawn(&dom, &view, "ready");
    assert_eq!(dom.value_of("generated-total"), 3);
    assert!(dom.contains("in-process (--workers 0)"), "the mode is shown");
}

/// Serves the dashboard page and fails every `/admin/cluster` request.
fn broken_server() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for mut conn in listener.incoming().flatten() {
            let mut buf = [0u8; 4096];
            let n = conn.read(&mut buf).unwrap_or(0);
            let head = String::from_utf8_lossy(&buf[..n]).to_string();
            let (status, kind, body) = if head.starts_with("GET /dashboard ") {
                (
                    "200 OK",
                    "text/html",
                    baton_coordinator::api::dashboard::PAGE.to_string(),
                )
            } else {
                (
                    "503 Service Unavailable",
                    "application/json",
                    r#"{"error": "down"}"#.to_string(),
                )
            };
            let _ = write!(
                conn,
                "HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    addr
}

#[test]
fn a_failed_refresh_shows_an_error_banner() {
    let Some(browser) = browser("a_failed_refresh_shows_an_error_banner") else {
        return;
    };
    let addr = broken_server();
    let dom = browser.dump_dom(&format!("http://{addr}/dashboard"), 2500);
    let (attrs, text) = dom.by_id("error");
    assert!(!attrs.contains_key("hidden"), "the banner is visible");
    assert!(
        text.contains("Refresh failed") && text.contains("HTTP 503"),
        "the banner says what failed: {text}"
    );
    assert_eq!(dom.by_id("updated").1, "never", "nothing was ever loaded");
}
