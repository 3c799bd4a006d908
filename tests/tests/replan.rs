//! Live re-planning: two workers pinned to their own cores serve a measured split; a CPU hog
//! started on one worker's core mid-run slows its stage, the coordinator sees the stage times
//! drift from the plan, loads new ranges beside the served stages and switches to them while
//! serving, and every stream's greedy output stays what the undisturbed pipeline produced.

use std::os::unix::process::CommandExt;
use std::time::Duration;

use baton_coordinator::generation::{GenerationRequest, Generator, TokenEvent};
use baton_coordinator::pipeline::replan::ReplanPolicy;
use baton_shared::model_files::ModelFiles;
use baton_shared::sampling::SamplingParams;
use baton_tests::cluster::{Limits, TestCluster};
use baton_tests::{PATIENCE, default_model, wait_until_async};

/// Eight greedy streams of 96 tokens; each stream's tokens.
async fn serve_all(tc: &TestCluster, prompts: &[Vec<u32>]) -> Vec<Vec<u32>> {
    let params = SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(96)
    };
    let streams: Vec<_> = prompts
        .iter()
        .map(|p| {
            let mut rx = tc
                .generator
                .submit(GenerationRequest {
                    prompt: p.clone(),
                    params: params.clone(),
                    top_logprobs: 0,
                    logprobs: false,
                })
                .unwrap();
            tokio::spawn(async move {
                let mut tokens = Vec::new();
                while let Some(ev) = rx.recv().await {
                    match ev {
                        TokenEvent::Token { id, .. } => tokens.push(id),
                        TokenEvent::PromptCached { .. } => {}
                        TokenEvent::Done { .. } => return tokens,
                        TokenEvent::Failed { message, .. } => panic!("a stream failed: {message}"),
                    }
                }
                panic!("a stream ended without Done")
            })
        })
        .collect();
    let mut out = Vec::new();
    for s in streams {
        out.push(
            tokio::time::timeout(4 * PATIENCE, s)
                .await
                .expect("a stream hung")
                .unwrap(),
        );
    }
    out
}

/// A busy loop on one core, in its own process group: dropped, the whole group is killed
/// (killing `timeout` alone would leave its shell spinning).
struct Hog(std::process::Child);

impl Hog {
    fn start(core: usize, seconds: u32) -> Self {
        let child = std::process::Command::new("taskset")
            .args(["-c", &core.to_string(), "timeout", &seconds.to_string()])
            .args(["sh", "-c", "while :; do :; done"])
            .process_group(0)
            .spawn()
            .expect("starting the CPU hog");
        Self(child)
    }
}

impl Drop for Hog {
    fn drop(&mut self) {
        let _ = std::process::Command::new("kill")
            .args(["-KILL", "--", &format!("-{}", self.0.id())])
            .status();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_slowed_by_a_cpu_hog_gives_up_layers_while_serving_and_outputs_stay_the_same() {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    assert!(
        cores >= 2,
        "this test pins two workers to two cores; the machine has {cores}"
    );
    let model = default_model();
    let cfg = ModelFiles::open(&model).unwrap().config().unwrap();
    let limits = Limits {
        measured_split: true,
        pin_cores: true,
        max_running: 8,
        live_replan: Some(ReplanPolicy {
            threshold: 1.15,
            window: Duration::from_secs(1),
            // Three windows in a row, as by default: with two, a 2-vCPU VM's bursts (a worker
            // 1.34x slower than its profile for two seconds) re-planned quiet cores twice in
            // 3 of 8 runs (stop 40); the hog lasts.
            windows: 3,
            settle: Duration::from_secs(2),
            min_batches: 4,
        }),
        ..Limits::default()
    };
    let tc = TestCluster::start_full(&model, &cfg, vec![], &[15], &[], limits).await;
    let prompts: Vec<Vec<u32>> = (0..8u32)
        .map(|i| (0..5 + 3 * i).map(|j| 100 + 37 * i + 11 * j).collect())
        .collect();
    let want = serve_all(&tc, &prompts).await;
    // On quiet cores the plan should hold. One re-plan is tolerated: on a slow 2-vCPU VM the
    // test process (the coordinator) shares the two pinned cores, and its bursts have pushed
    // one stage 15% over its predicted time for two windows once (seen in CI on a Zen 3 EPYC);
    // more than one would be flapping.
    let quiet_replans = tc.generator.status.replans.load(std::sync::atomic::Ordering::Relaxed);
    assert!(
        quiet_replans <= 1,
        "{quiet_replans} re-plans on quiet cores: the plan flaps"
    );
    // What the hog must change: the ranges served now.
    let planned = tc.generator.status.assignment.lock().unwrap().clone();

    // A hog on stage 1's core, bounded so it ends by itself even if the test does not.
    let hog = Hog::start(1, 120);
    let got = serve_all(&tc, &prompts).await;
    assert_eq!(got, want, "outputs across the re-plan equal the undisturbed run's");
    wait_until_async("the split moves layers off the hogged worker", || async {
        let last = tc.generator.status.last_replan.lock().unwrap().clone();
        let now = tc.generator.status.assignment.lock().unwrap().clone();
        let replanned = tc.generator.status.replans.load(std::sync::atomic::Ordering::Relaxed) > quiet_replans;
        let moved = replanned && now.len() == 2 && now[1].layers.len() < planned[1].layers.len();
        match last {
            // Loaded beside the served stages while they served, then activated: no reload.
            Some(l)
                if l.starts_with("measured_drift") && l.contains("loaded beside") && moved && tc.generator.ready() =>
            {
                Ok(())
            }
            other => Err(format!("last re-plan {other:?}, ranges {now:?} (planned {planned:?})")),
        }
    })
    .await;
    drop(hog);
    let now = tc.generator.status.assignment.lock().unwrap().clone();
    let last = tc.generator.status.last_replan.lock().unwrap().clone();
    eprintln!("planned {planned:?}; after the hog {now:?}; {last:?}");
    // The re-planned pipeline still computes the same tokens.
    assert_eq!(serve_all(&tc, &prompts[..2]).await, want[..2]);
}
