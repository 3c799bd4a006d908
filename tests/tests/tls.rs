//! Mutual TLS on the worker plane: certificates from `baton certs` carry a pipeline end to end
//! (coordinator → workers, stage → stage, workers → registry); a worker refuses a plain-text
//! client, a certificate from another CA, an expired certificate, and a good certificate without
//! the cluster token; the registry refuses a stranger too; plain text off loopback is refused at
//! start-up.

use std::path::{Path, PathBuf};
use std::process::Command;

use baton_shared::auth::PeerAuth;
use baton_shared::model_files::ModelFiles;
use baton_shared::proto::registry_client::RegistryClient;
use baton_shared::proto::worker_client::WorkerClient;
use baton_shared::proto::{HealthRequest, RegisterRequest};
use baton_shared::sampling::SamplingParams;
use baton_shared::tls::{ClusterTls, DevCa, write_pem};
use baton_tests::cluster::{TestCluster, TlsFiles};
use baton_tests::{baton_bin, fixtures};
use baton_worker::engine::Engine;
use baton_worker::model::StageWeights;
use baton_worker::service::connect_worker;

fn run_certs(out: &Path, nodes: &[&str]) -> String {
    let o = Command::new(baton_bin())
        .args(["certs", "--out"])
        .arg(out)
        .args(["--san", "127.0.0.1", "--san", "localhost", "--days", "2"])
        .args(nodes)
        .output()
        .expect("running baton certs");
    assert!(
        o.status.success(),
        "baton certs: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// A client identity written next to the cluster's files: `cert`/`key` with `ca` trusted.
fn client(token: &str, cert: &Path, key: &Path, ca: &Path) -> PeerAuth {
    PeerAuth::with_tls(
        token,
        ClusterTls::load(cert, key, ca).expect("loading a client identity"),
    )
}

/// Whether a Health call over `peer` to `address` fails (at connect or at the call).
async fn health_fails(address: &str, peer: &PeerAuth) -> Result<(), String> {
    match connect_worker(address, peer).await {
        Err(_) => Ok(()),
        Ok(mut c) => match c.health(HealthRequest {}).await {
            Err(_) => Ok(()),
            Ok(_) => Err(format!("{address} answered a client it should refuse")),
        },
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_pipeline_runs_end_to_end_and_workers_refuse_strangers() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // Two runs: the second reuses the CA, so the workers' certificates prove a reloaded CA
    // issues certificates that chain to the first run's ca.pem.
    let first = run_certs(d, &["coordinator"]);
    assert!(first.contains("new CA"), "{first}");
    let second = run_certs(d, &["worker"]);
    assert!(second.contains("reused CA"), "{second}");
    #[cfg(unix)]
    for key in ["ca.key", "coordinator.key", "worker.key"] {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(d.join(key)).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "{key} is readable by others");
    }
    let files = TlsFiles {
        ca: d.join("ca.pem"),
        coordinator: (d.join("coordinator.pem"), d.join("coordinator.key")),
        worker: (d.join("worker.pem"), d.join("worker.key")),
    };

    // Strangers: a node of another CA, and an expired certificate of this one.
    let names = ["127.0.0.1".to_string(), "localhost".into()];
    let other = DevCa::generate(2).unwrap().issue_now(&names, 2).unwrap();
    let ca = DevCa::load(
        std::fs::read_to_string(d.join("ca.pem")).unwrap(),
        std::fs::read_to_string(d.join("ca.key")).unwrap(),
    )
    .unwrap();
    let past = time::OffsetDateTime::now_utc() - time::Duration::days(10);
    let expired = ca.issue(&names, past, 1).unwrap();
    let write = |name: &str, pem: &str| -> PathBuf {
        let p = d.join(name);
        write_pem(&p, pem, true).unwrap();
        p
    };
    let (other_cert, other_key) = (write("other.pem", &other.cert), write("other.key", &other.key));
    let (old_cert, old_key) = (write("old.pem", &expired.cert), write("old.key", &expired.key));

    let model = fixtures().join("tiny/llama_untied");
    let files_ = ModelFiles::open(&model).unwrap();
    let cfg = files_.config().unwrap();
    let tc = TestCluster::start_tls(&model, &cfg, &[1], &files).await;
    let assignment = tc.generator.status.assignment.lock().unwrap().clone();
    assert_eq!(assignment.len(), 2);
    assert!(
        assignment.iter().all(|a| a.address.starts_with("https://")),
        "{assignment:?}"
    );

    // End to end over TLS (two stages, so stage → stage is TLS too): the same greedy tokens as
    // the single-process engine.
    let params = SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(10)
    };
    let prompt = [5u32, 17, 200, 3, 99];
    let mut engine = Engine::new(StageWeights::load_full(&files_, &cfg, true).unwrap());
    let want = engine.generate(&prompt, &params, None, |_| {}).unwrap().tokens;
    let (got, _) = tc.generate(&prompt, params).await.unwrap();
    assert_eq!(got, want);

    let worker = assignment[0].address.clone();
    let token = tc.token.clone();
    // The control: a cluster certificate and the token are served.
    let good = client(&token, &files.worker.0, &files.worker.1, &files.ca);
    connect_worker(&worker, &good)
        .await
        .expect("a cluster member connects")
        .health(HealthRequest {})
        .await
        .expect("a cluster member is served");

    // Plain text to the TLS port.
    let plain_url = worker.replacen("https://", "http://", 1);
    match WorkerClient::connect(plain_url.clone()).await {
        Err(_) => {}
        Ok(mut c) => assert!(c.health(HealthRequest {}).await.is_err(), "plain text served"),
    }
    // Another CA's certificate, and an expired one (each trusting the real CA, so only the
    // worker's check of the client is under test).
    health_fails(&worker, &client(&token, &other_cert, &other_key, &files.ca))
        .await
        .expect("another CA's certificate");
    health_fails(&worker, &client(&token, &old_cert, &old_key, &files.ca))
        .await
        .expect("an expired certificate");
    // A good certificate without the token: TLS passes, the call does not.
    let channel = good.endpoint(&worker).unwrap().connect().await.unwrap();
    let e = WorkerClient::new(channel).health(HealthRequest {}).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e}");

    // The registry refuses a worker from another CA.
    let rogue = client(&token, &other_cert, &other_key, &files.ca);
    let registered = async {
        let channel = rogue.endpoint(&tc.registry_url).ok()?.connect().await.ok()?;
        let mut registry = RegistryClient::with_interceptor(channel, rogue.add_token().ok()?);
        let req = RegisterRequest {
            address: "https://127.0.0.1:1".into(),
            ..Default::default()
        };
        registry.register(req).await.ok()
    };
    assert!(registered.await.is_none(), "the registry took a worker of another CA");
    // And the pipeline still serves.
    let (again, _) = tc.generate(&prompt, SamplingParams::greedy(3)).await.unwrap();
    assert_eq!(again.len(), 3);
}

fn start_refused(args: &[&str], envs: &[(&str, &str)]) -> String {
    let o = Command::new(baton_bin())
        .args(args)
        .env("BATON_CLUSTER_TOKEN", "t")
        .envs(envs.iter().copied())
        .stdin(std::process::Stdio::null())
        .output()
        .expect("running baton");
    assert!(!o.status.success(), "{args:?} started");
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn plain_text_off_loopback_and_mismatched_schemes_are_refused_at_start() {
    let e = start_refused(
        &["worker", "--listen", "0.0.0.0:0", "--coordinator", "http://127.0.0.1:1"],
        &[],
    );
    assert!(e.contains("0.0.0.0:0") && e.contains("allow_plaintext"), "{e}");
    let e = start_refused(&["coordinator", "--listen", "0.0.0.0:0", "--http", "127.0.0.1:0"], &[]);
    assert!(e.contains("allow_plaintext"), "{e}");
    // TLS on but an http:// coordinator URL: tonic would quietly use plain text.
    let dir = tempfile::tempdir().unwrap();
    run_certs(dir.path(), &["w"]);
    let p = |f: &str| dir.path().join(f).display().to_string();
    let (cert, key, ca) = (p("w.pem"), p("w.key"), p("ca.pem"));
    let e = start_refused(
        &[
            "worker",
            "--coordinator",
            "http://127.0.0.1:1",
            "--tls-cert",
            &cert,
            "--tls-key",
            &key,
            "--tls-ca",
            &ca,
        ],
        &[],
    );
    assert!(e.contains("https://"), "{e}");
    // Only part of the TLS files, and a key where the certificate belongs.
    let e = start_refused(
        &["worker", "--coordinator", "https://127.0.0.1:1"],
        &[("BATON_TLS_CERT", cert.as_str())],
    );
    assert!(e.contains("tls_key"), "{e}");
    let e = start_refused(
        &[
            "worker",
            "--coordinator",
            "https://127.0.0.1:1",
            "--tls-cert",
            &key,
            "--tls-key",
            &key,
            "--tls-ca",
            &ca,
        ],
        &[],
    );
    assert!(e.contains("tls_cert") && e.contains("w.key"), "{e}");
}
