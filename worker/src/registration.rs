//! Joining the cluster: register with the coordinator (retrying with backoff while it is
//! unreachable, e.g. while its DNS name does not resolve yet), then heartbeat; register again
//! whenever the coordinator forgets us.

use std::sync::Arc;
use std::time::Duration;

use baton_shared::auth::PeerAuth;
use baton_shared::proto::registry_client::RegistryClient;
use baton_shared::proto::{DeregisterRequest, HeartbeatRequest, RegisterRequest};

use crate::service::WorkerState;

/// What the worker tells the coordinator about itself.
#[derive(Debug, Clone)]
pub struct WorkerDescription {
    pub worker_id: String,
    pub address: String,
    pub device_kind: String,
    pub cores: u32,
    pub memory_bytes: u64,
    pub features: Vec<String>,
    /// Budget of the paged KV pool.
    pub kv_cache_bytes: u64,
    /// Where `/metrics` is served (empty: nowhere).
    pub metrics_address: String,
}

const MIN_BACKOFF: Duration = Duration::from_millis(200);
const MAX_BACKOFF: Duration = Duration::from_secs(5);

async fn register_once(url: &str, peer: &PeerAuth, desc: &WorkerDescription) -> Result<(String, Duration), String> {
    let channel = peer
        .endpoint(url)
        .map_err(|e| format!("coordinator URL: {e}"))?
        .connect_timeout(Duration::from_secs(3))
        // A coordinator that accepts the connection but never answers is retried, not waited on.
        .timeout(Duration::from_secs(10))
        .connect()
        .await
        .map_err(|e| format!("cannot connect to {url}: {e}"))?;
    let mut client = RegistryClient::with_interceptor(channel, peer.add_token().map_err(|e| e.message().to_string())?);
    let resp = client
        .register(RegisterRequest {
            worker_id: desc.worker_id.clone(),
            address: desc.address.clone(),
            device_kind: desc.device_kind.clone(),
            cores: desc.cores,
            memory_bytes: desc.memory_bytes,
            features: desc.features.clone(),
            kv_cache_bytes: desc.kv_cache_bytes,
            metrics_address: desc.metrics_address.clone(),
        })
        .await
        .map_err(|e| format!("register rejected by {url}: {} ({:?})", e.message(), e.code()))?
        .into_inner();
    Ok((
        resp.worker_id,
        Duration::from_millis(resp.heartbeat_interval_ms.clamp(100, 60_000)),
    ))
}

/// Register and heartbeat forever (until the process ends).
pub async fn run(url: String, peer: PeerAuth, desc: WorkerDescription, state: Arc<WorkerState>) {
    let mut backoff = MIN_BACKOFF;
    loop {
        let (id, interval) = match register_once(&url, &peer, &desc).await {
            Ok(ok) => ok,
            Err(why) => {
                tracing::warn!(coordinator = %url, retry_in = ?backoff, "cannot register: {why}");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
                continue;
            }
        };
        backoff = MIN_BACKOFF;
        tracing::info!(worker_id = %id, coordinator = %url, "registered");
        *state.worker_id.lock().unwrap_or_else(|e| e.into_inner()) = id.clone();
        let Ok(channel) = peer.endpoint(&url) else {
            return;
        };
        // Every heartbeat is bounded: without a deadline one sent while the coordinator was
        // restarting waited forever, and the worker never registered with the new process.
        // At most one interval, so a timed-out beat and the next one still land within the
        // three intervals after which the coordinator declares the worker dead.
        let deadline = interval.max(Duration::from_millis(250));
        let channel = channel.connect_timeout(deadline).timeout(deadline).connect_lazy();
        let Ok(auth) = peer.add_token() else { return };
        let mut client = RegistryClient::with_interceptor(channel, auth);
        let mut misses = 0;
        loop {
            tokio::time::sleep(interval).await;
            let beat = HeartbeatRequest {
                worker_id: id.clone(),
                address: desc.address.clone(),
            };
            match client.heartbeat(beat).await {
                Ok(r) if r.get_ref().known => misses = 0,
                Ok(_) => {
                    tracing::warn!("coordinator no longer knows this worker; registering again");
                    break;
                }
                Err(e) => {
                    misses += 1;
                    tracing::warn!(error = %e.message(), misses, "heartbeat failed");
                    if misses >= 3 {
                        break;
                    }
                }
            }
        }
    }
}

/// Tell the coordinator this worker is leaving (best effort, bounded to one second), so it
/// re-plans at once instead of waiting for missed heartbeats.
pub async fn deregister(url: &str, peer: &PeerAuth, worker_id: &str) {
    if worker_id.is_empty() {
        return;
    }
    let attempt = async {
        let channel = peer.endpoint(url).ok()?.connect().await.ok()?;
        let mut client = RegistryClient::with_interceptor(channel, peer.add_token().ok()?);
        client
            .deregister(DeregisterRequest {
                worker_id: worker_id.to_string(),
            })
            .await
            .ok()
    };
    match tokio::time::timeout(Duration::from_secs(1), attempt).await {
        Ok(Some(_)) => tracing::info!(worker_id, "deregistered"),
        _ => tracing::warn!(worker_id, coordinator = %url, "could not deregister"),
    }
}
