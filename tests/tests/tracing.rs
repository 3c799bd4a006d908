//! One request, one trace: an in-process OTLP receiver collects spans from the coordinator (this
//! process) and two real worker processes; the request's trace holds the coordinator's spans and
//! both stages' `stage.forward` spans, parented hop by hop.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use baton_shared::logging::{LoggingOptions, init};
use baton_shared::model_files::ModelFiles;
use baton_shared::sampling::SamplingParams;
use baton_shared::settings::LogFormat;
use baton_tests::cluster::TestCluster;
use baton_tests::fixtures;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue};
use opentelemetry_proto::tonic::trace::v1::Span;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::{Request, Response, Status};
use tracing::Instrument;

/// A span as received, with the `service.name` of the process that sent it.
#[derive(Clone, Debug)]
struct Received {
    service: String,
    span: Span,
}

impl Received {
    fn attr(&self, key: &str) -> Option<&Value> {
        attr(&self.span.attributes, key)
    }

    fn int(&self, key: &str) -> Option<i64> {
        match self.attr(key)? {
            Value::IntValue(i) => Some(*i),
            Value::StringValue(s) => s.parse().ok(),
            _ => None,
        }
    }
}

fn attr<'a>(attrs: &'a [KeyValue], key: &str) -> Option<&'a Value> {
    attrs
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref())
        .and_then(|v: &AnyValue| v.value.as_ref())
}

/// An OTLP/gRPC trace receiver that keeps everything it is sent.
#[derive(Clone, Default)]
struct Receiver {
    spans: Arc<Mutex<Vec<Received>>>,
}

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        req: Request<ExportTraceServiceRequest>,
    ) -> Result<Response<ExportTraceServiceResponse>, Status> {
        let mut spans = self.spans.lock().unwrap();
        for rs in req.into_inner().resource_spans {
            let service = rs
                .resource
                .as_ref()
                .and_then(|r| attr(&r.attributes, "service.name"))
                .map(|v| match v {
                    Value::StringValue(s) => s.clone(),
                    other => format!("{other:?}"),
                })
                .unwrap_or_default();
            for ss in rs.scope_spans {
                for span in ss.spans {
                    spans.push(Received {
                        service: service.clone(),
                        span,
                    });
                }
            }
        }
        Ok(Response::new(ExportTraceServiceResponse { partial_success: None }))
    }
}

/// Start the receiver on a free port; returns its endpoint URL.
async fn start_receiver(receiver: Receiver) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(receiver))
            .serve_with_incoming(TcpListenerStream::new(listener)),
    );
    url
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_request_is_one_trace_across_coordinator_and_both_stages() {
    let receiver = Receiver::default();
    let endpoint = start_receiver(receiver.clone()).await;
    // This process is the coordinator: its spans are exported like `baton coordinator`'s.
    let logging = init(&LoggingOptions {
        log_level: "warn".into(),
        log_format: LogFormat::Text,
        otlp_endpoint: Some(endpoint.clone()),
        service_name: "baton-coordinator".into(),
    })
    .expect("tracing set up");
    assert!(logging.exporting(), "this test owns the process's subscriber");

    let dir = fixtures().join("tiny/llama_tied");
    let cfg = ModelFiles::open(&dir).unwrap().config().unwrap();
    let flags = vec![vec!["--otlp-endpoint".to_string(), endpoint.clone()]; 2];
    let tc = TestCluster::start_with(&dir, &cfg, vec![], &[1], &flags).await;

    // Stands in for the API handler's span (only Baton's own targets are exported).
    let request = tracing::info_span!(target: "baton_coordinator", "http.request", endpoint = "test");
    let (tokens, _) = tc
        .generate(
            &[1, 2, 3],
            SamplingParams {
                ignore_eos: true,
                ..SamplingParams::greedy(4)
            },
        )
        .instrument(request.clone())
        .await
        .unwrap();
    assert_eq!(tokens.len(), 4);
    drop(request);

    // The coordinator's spans end when their work ends; flush them, then wait for the workers'
    // batches (exported every 500 ms).
    let deadline = Instant::now() + Duration::from_secs(30);
    let spans = loop {
        tokio::time::sleep(Duration::from_millis(300)).await;
        logging.flush();
        let spans = receiver.spans.lock().unwrap().clone();
        let stage_spans = spans
            .iter()
            .filter(|s| s.span.name == "stage.forward" && s.service == "baton-worker")
            .count();
        let have_request = spans.iter().any(|s| s.span.name == "http.request");
        // 4 micro-batches (one prefill, three decodes), each on two stages.
        if have_request && stage_spans >= 8 {
            break spans;
        }
        assert!(
            Instant::now() < deadline,
            "spans did not arrive: {:?}",
            spans.iter().map(|s| (&s.service, &s.span.name)).collect::<Vec<_>>()
        );
    };

    let by_id: HashMap<Vec<u8>, &Received> = spans.iter().map(|s| (s.span.span_id.clone(), s)).collect();
    let parent_name = |s: &Received| by_id.get(&s.span.parent_span_id).map(|p| p.span.name.as_str());
    let root = spans.iter().find(|s| s.span.name == "http.request").unwrap();
    assert_eq!(root.service, "baton-coordinator");
    let trace = &root.span.trace_id;
    let in_trace: Vec<&Received> = spans.iter().filter(|s| &s.span.trace_id == trace).collect();
    let named = |name: &str| {
        in_trace
            .iter()
            .filter(|s| s.span.name == name)
            .copied()
            .collect::<Vec<_>>()
    };

    let seq = named("sequence");
    assert_eq!(seq.len(), 1, "one sequence span");
    assert_eq!(seq[0].span.parent_span_id, root.span.span_id);
    assert_eq!(seq[0].int("prompt_tokens"), Some(3));
    let queue = named("queue.wait");
    assert_eq!(queue.len(), 1);
    assert_eq!(parent_name(queue[0]), Some("sequence"));

    let steps = named("pipeline.step");
    assert_eq!(steps.len(), 4, "one step span per micro-batch");
    for s in &steps {
        assert_eq!(s.service, "baton-coordinator");
        assert_eq!(s.span.parent_span_id, seq[0].span.span_id);
    }

    let forwards = named("stage.forward");
    assert_eq!(
        forwards.len(),
        8,
        "every micro-batch on both stages, in the request's trace"
    );
    let mut workers = std::collections::BTreeSet::new();
    for f in &forwards {
        assert_eq!(f.service, "baton-worker");
        let stage = f.int("stage").expect("stage attribute");
        let (start, end) = (f.int("layer_start").unwrap(), f.int("layer_end").unwrap());
        assert_eq!(
            (start, end),
            if stage == 0 { (0, 1) } else { (1, 3) },
            "layer range of stage {stage}"
        );
        assert!(f.int("batch_tokens").unwrap() >= 1);
        assert_eq!(f.int("sequences"), Some(1));
        let Some(Value::StringValue(worker)) = f.attr("worker_id") else {
            panic!("stage.forward without worker_id: {f:?}");
        };
        assert!(!worker.is_empty());
        workers.insert((stage, worker.clone()));
        let parent = by_id
            .get(&f.span.parent_span_id)
            .expect("stage.forward's parent was exported");
        if stage == 0 {
            // Stage 0 works for the coordinator's step.
            assert_eq!(parent.span.name, "pipeline.step");
        } else {
            // Stage 1 works for stage 0's transfer, which is part of stage 0's forward.
            assert_eq!(parent.span.name, "stage.transfer");
            assert!(parent.int("bytes").unwrap() > 0);
            let grand = by_id.get(&parent.span.parent_span_id).unwrap();
            assert_eq!(grand.span.name, "stage.forward");
            assert_eq!(grand.int("stage"), Some(0));
        }
    }
    assert_eq!(workers.len(), 2, "two workers, one per stage: {workers:?}");
    let prefill: Vec<_> = forwards.iter().filter(|f| f.int("batch_tokens") == Some(3)).collect();
    assert_eq!(prefill.len(), 2, "the 3-token prefill ran on both stages");

    // Loading the stages was traced through gRPC metadata, under the coordinator's build span.
    let loads: Vec<_> = spans.iter().filter(|s| s.span.name == "stage.load").collect();
    assert_eq!(loads.len(), 2);
    for l in loads {
        assert_eq!(parent_name(l), Some("pipeline.build"));
    }
}

#[test]
fn an_absent_collector_costs_one_warning_and_a_bad_endpoint_is_named() {
    // Nothing listens on the port: generation works, and the failure is reported once.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let model = baton_tests::default_model();
    let model = model.to_str().unwrap();
    let endpoint = format!("http://127.0.0.1:{port}");
    let args = [
        "--otlp-endpoint",
        &endpoint,
        "--log-level",
        "warn",
        "generate",
        "--model",
        model,
        "--tokens",
        "1,2,3",
        "--max-tokens",
        "24",
    ];
    let out = baton_tests::baton(&args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "baton generate failed: {stderr}");
    // The spans are exported (at exit at the latest), fail, and say so exactly once.
    let warnings = stderr.matches("trace export failed").count();
    assert_eq!(warnings, 1, "one warning, not one per batch: {stderr}");

    let out = baton_tests::baton(&["--otlp-endpoint", "localhost:4317", "tokenize", "--text", "hi"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("otlp_endpoint 'localhost:4317'") && stderr.contains("http://"),
        "{stderr}"
    );
}
