//! The worker plane's message-size limit (`[grpc] max_message_mib`) against a real worker
//! process: an oversized unary call and an oversized micro-batch on the Forward stream are
//! refused with OUT_OF_RANGE, each counted in `baton_grpc_limit_hits_total`, and the worker
//! keeps serving.

use std::sync::Arc;
use std::time::Duration;

use baton_coordinator::registry::{self, Cluster};
use baton_shared::auth::PeerAuth;
use baton_shared::proto::{HealthRequest, LoadStageRequest, MicroBatch, Tensor};
use baton_tests::cluster::{spawn_worker_from, wait_for_a_worker, worker_command};
use baton_worker::service::connect_worker;

fn hits(metrics: &str) -> u64 {
    metrics
        .lines()
        .find(|l| l.starts_with("baton_grpc_limit_hits_total{limit=\"max_message_mib\"}"))
        .and_then(|l| l.rsplit_once(' '))
        .map_or(0, |(_, v)| v.parse().expect("a counter value"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_messages_are_refused_counted_and_the_worker_serves_on() {
    let token = "grpc-limit-token";
    let cluster = Arc::new(Cluster::new(Duration::from_secs(60)));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let c = cluster.clone();
    tokio::spawn(async move {
        registry::serve(
            listener,
            c,
            &PeerAuth::plaintext(token),
            &Default::default(),
            std::future::pending(),
        )
        .await
    });
    let mut cmd = worker_command();
    cmd.env("BATON_GRPC__MAX_MESSAGE_MIB", "1");
    let _worker = spawn_worker_from(cmd, &url, token, &["--metrics-listen".into(), "127.0.0.1:0".into()]);
    wait_for_a_worker(&cluster, "the worker registers").await;
    let address = cluster.alive()[0].address.clone();
    // The worker bound a free port and registered it.
    let metrics_addr = cluster.alive()[0].metrics_address.clone();
    let peer = PeerAuth::plaintext(token);
    let mut client = connect_worker(&address, &peer).await.unwrap();
    let scrape = || baton_tests::serve::http_request(&metrics_addr, "GET", "/metrics", "").1;
    assert_eq!(hits(&scrape()), 0);

    // A unary call two MiB long.
    let big = LoadStageRequest {
        model: "m".repeat(2 << 20),
        ..Default::default()
    };
    let e = client.load_stage(big).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::OutOfRange, "{e}");
    assert!(e.message().contains("too large"), "{e}");
    client.health(HealthRequest {}).await.expect("the worker still serves");
    assert_eq!(hits(&scrape()), 1);

    // A micro-batch of two MiB of hidden rows on the Forward stream: the stream ends with the
    // error rather than quietly.
    let batch = MicroBatch {
        batch_id: 1,
        hidden: Some(Tensor {
            data: vec![0u8; 2 << 20],
            ..Default::default()
        }),
        ..Default::default()
    };
    let outcome = async {
        let mut answers = client.forward(tokio_stream::iter([batch])).await?.into_inner();
        while answers.message().await?.is_some() {}
        Ok::<_, tonic::Status>(())
    };
    let e = tokio::time::timeout(Duration::from_secs(60), outcome)
        .await
        .expect("the stream ends")
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::OutOfRange, "{e}");
    client.health(HealthRequest {}).await.expect("the worker still serves");
    assert_eq!(hits(&scrape()), 2);
}
