//! The worker processes `baton serve` starts on this machine: spawned at startup, watched
//! while serving (one that exits is started again with backoff and re-registers; the pipeline
//! moves its requests and rebuilds), and stopped with the server.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use baton_coordinator::generation::Generator;
use tokio::process::{Child, Command};

/// How long `baton serve` waits for its workers to register and load their layers.
const READY_TIMEOUT: Duration = Duration::from_secs(300);
/// First wait before restarting a worker that exited; doubled per exit in a row.
const MIN_BACKOFF: Duration = Duration::from_millis(500);
/// Longest wait between restarts of a crash-looping worker.
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// A worker that ran this long before exiting was healthy: its next restart waits the least.
const HEALTHY_RUN: Duration = Duration::from_secs(60);
/// Exits in a row (each soon after its start) from which a worker is reported crash-looping.
const CRASH_LOOP: u32 = 3;
/// How often exits are looked for.
const POLL: Duration = Duration::from_millis(100);

/// The wait before restarting a worker after its `exits`-th exit in a row (each soon after
/// its start): 0.5 s, doubling, at most 30 s.
fn restart_backoff(exits: u32) -> Duration {
    MIN_BACKOFF
        .saturating_mul(1 << exits.saturating_sub(1).min(6))
        .min(MAX_BACKOFF)
}

/// How to start one worker process (the same command every time, so a restart is the same
/// worker).
pub(super) struct WorkerCommand {
    pub program: std::path::PathBuf,
    pub args: Vec<String>,
    pub envs: Vec<(String, String)>,
    /// `--device` of worker `i`: `devices[i % len]` (none: the args say).
    pub devices: Vec<String>,
}

impl WorkerCommand {
    fn spawn(&self, index: usize) -> Result<Child> {
        let device = match self.devices.is_empty() {
            true => Vec::new(),
            false => vec!["--device".to_string(), self.devices[index % self.devices.len()].clone()],
        };
        let child = Command::new(&self.program)
            .args(&self.args)
            .args(&device)
            .envs(self.envs.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting worker {index} ({})", self.program.display()))?;
        tracing::info!(worker = index, pid = child.id(), "worker process started");
        Ok(child)
    }
}

/// One supervised worker process.
struct Slot {
    child: Option<Child>,
    started: Instant,
    /// Exits in a row, each before [`HEALTHY_RUN`].
    quick_exits: u32,
    /// When to start it again after an exit.
    restart_at: Option<Instant>,
}

/// Worker processes started by `baton serve` (none with `--workers 0`).
pub(super) struct LocalWorkers {
    command: Option<WorkerCommand>,
    slots: Vec<Slot>,
}

impl LocalWorkers {
    /// No worker processes (the model runs in this process).
    pub fn none() -> Self {
        Self {
            command: None,
            slots: Vec::new(),
        }
    }

    /// Start `count` workers with `command`.
    pub fn start(command: WorkerCommand, count: usize) -> Result<Self> {
        let slots = (0..count)
            .map(|i| {
                Ok(Slot {
                    child: Some(command.spawn(i)?),
                    started: Instant::now(),
                    quick_exits: 0,
                    restart_at: None,
                })
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            command: Some(command),
            slots,
        })
    }

    /// Wait until the generator is ready; fail at once if a worker process exits first (a bad
    /// model or flag would only exit again).
    pub async fn wait_until_ready(&mut self, generator: &dyn Generator) -> Result<()> {
        let start = Instant::now();
        while !generator.ready() {
            for (i, slot) in self.slots.iter_mut().enumerate() {
                if let Some(status) = slot.child.as_mut().map(Child::try_wait).transpose()?.flatten() {
                    bail!("worker {i} exited during startup ({status}); see its log lines above");
                }
            }
            if start.elapsed() > READY_TIMEOUT {
                bail!("the pipeline was not ready after {READY_TIMEOUT:?}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(())
    }

    /// Watch the workers until `stop` resolves, starting again any that exits; then stop them
    /// all. Restarts back off (0.5 s doubling to 30 s) while a worker keeps exiting soon after
    /// its start, which is logged as a crash loop instead of being spun on.
    pub async fn supervise(mut self, stop: impl std::future::Future<Output = ()>) {
        for _ in &self.slots {
            metrics::counter!("baton_worker_restarts_total").increment(0);
        }
        tokio::pin!(stop);
        loop {
            tokio::select! {
                () = &mut stop => break,
                () = tokio::time::sleep(POLL) => self.check(),
            }
        }
        self.stop().await;
    }

    /// Notice exits and start workers whose backoff is over.
    fn check(&mut self) {
        let Some(command) = &self.command else { return };
        for (i, slot) in self.slots.iter_mut().enumerate() {
            if let Some(child) = &mut slot.child {
                let status = match child.try_wait() {
                    Ok(Some(status)) => status.to_string(),
                    Ok(None) => continue,
                    Err(e) => format!("unknown status ({e})"),
                };
                slot.child = None;
                let ran = slot.started.elapsed();
                slot.quick_exits = if ran < HEALTHY_RUN { slot.quick_exits + 1 } else { 1 };
                let backoff = restart_backoff(slot.quick_exits);
                slot.restart_at = Some(Instant::now() + backoff);
                if slot.quick_exits >= CRASH_LOOP {
                    tracing::error!(worker = i, %status, exits_in_a_row = slot.quick_exits, restart_in = ?backoff,
                        "worker is crash-looping: it keeps exiting soon after it starts; see its log lines above");
                } else {
                    tracing::warn!(worker = i, %status, ran_seconds = ran.as_secs_f64(), restart_in = ?backoff,
                        "worker process exited; restarting it");
                }
            }
            if slot.restart_at.is_some_and(|t| Instant::now() >= t) {
                slot.restart_at = None;
                slot.started = Instant::now();
                metrics::counter!("baton_worker_restarts_total").increment(1);
                match command.spawn(i) {
                    Ok(child) => slot.child = Some(child),
                    Err(e) => {
                        slot.quick_exits += 1;
                        slot.restart_at = Some(Instant::now() + MAX_BACKOFF);
                        tracing::error!(worker = i, "restarting the worker failed: {e:#}");
                    }
                }
            }
        }
    }

    /// Stop every worker process and wait for it.
    pub async fn stop(&mut self) {
        for child in self.slots.iter_mut().filter_map(|s| s.child.as_mut()) {
            let _ = child.start_kill();
        }
        for child in self.slots.iter_mut().filter_map(|s| s.child.as_mut()) {
            let _ = child.wait().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn restarts_back_off_from_half_a_second_to_thirty() {
        let waits: Vec<f64> = (1..=9).map(|n| restart_backoff(n).as_secs_f64()).collect();
        assert_eq!(waits, [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]);
        assert_eq!(restart_backoff(u32::MAX), MAX_BACKOFF);
    }

    #[tokio::test]
    async fn an_exited_worker_is_started_again_and_a_crash_loop_backs_off() {
        // `false` exits at once: every start is a quick exit.
        let command = WorkerCommand {
            program: "false".into(),
            args: Vec::new(),
            envs: Vec::new(),
            devices: Vec::new(),
        };
        let mut workers = LocalWorkers::start(command, 1).unwrap();
        let start = Instant::now();
        while workers.slots[0].quick_exits < 3 {
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "the worker was not restarted"
            );
            workers.check();
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Three exits in a row: 0.5 + 1 s of backoff at least, and 2 s before the next start.
        assert!(start.elapsed() >= Duration::from_millis(1500), "{:?}", start.elapsed());
        let next = workers.slots[0].restart_at.expect("a restart is scheduled");
        assert!(next > Instant::now() + Duration::from_millis(1500));
        workers.stop().await;
    }
}
