//! The worker registry: workers register, heartbeat and deregister over gRPC; the pipeline
//! supervisor reads who is alive.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use baton_shared::proto::registry_server::Registry;
use baton_shared::proto::{
    DeregisterRequest, DeregisterResponse, HeartbeatRequest, HeartbeatResponse, RegisterRequest, RegisterResponse,
};
use tokio::sync::Notify;
use tonic::{Request, Response, Status};

/// One registered worker.
#[derive(Debug, Clone)]
pub struct WorkerEntry {
    pub id: String,
    pub address: String,
    pub device_kind: String,
    pub cores: u32,
    pub memory_bytes: u64,
    pub features: Vec<String>,
    /// Bytes the worker gives its paged KV pool.
    pub kv_cache_bytes: u64,
    /// host:port of the worker's `/metrics` (empty: none).
    pub metrics_address: String,
    /// Registration order, so assignments are stable.
    pub seq: u64,
    pub last_seen: Instant,
}

/// Known workers and their liveness.
#[derive(Debug)]
pub struct Cluster {
    workers: Mutex<BTreeMap<String, WorkerEntry>>,
    /// Signalled whenever membership changes.
    pub changed: Notify,
    next: AtomicU64,
    pub heartbeat_interval: Duration,
    /// A worker silent for this long is considered dead.
    pub dead_after: Duration,
}

impl Cluster {
    /// An empty cluster with the given heartbeat interval (dead after three missed beats).
    pub fn new(heartbeat_interval: Duration) -> Self {
        Self {
            workers: Mutex::new(BTreeMap::new()),
            changed: Notify::new(),
            next: AtomicU64::new(0),
            heartbeat_interval,
            dead_after: heartbeat_interval * 3,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, WorkerEntry>> {
        self.workers.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Live workers in registration order.
    pub fn alive(&self) -> Vec<WorkerEntry> {
        let now = Instant::now();
        let mut v: Vec<_> = self
            .lock()
            .values()
            .filter(|w| now - w.last_seen < self.dead_after)
            .cloned()
            .collect();
        v.sort_by_key(|w| w.seq);
        v
    }

    /// Whether a worker is registered and heard from recently.
    pub fn is_alive(&self, id: &str) -> bool {
        self.lock()
            .get(id)
            .is_some_and(|w| w.last_seen.elapsed() < self.dead_after)
    }

    /// Forget a worker (e.g. after its stream broke), so it must register again.
    pub fn remove(&self, id: &str) {
        if self.lock().remove(id).is_some() {
            self.changed.notify_waiters();
        }
    }
}

/// gRPC face of the cluster.
pub struct RegistryService {
    pub cluster: std::sync::Arc<Cluster>,
}

/// Longest accepted worker id or address.
const MAX_FIELD: usize = 512;

#[tonic::async_trait]
impl Registry for RegistryService {
    async fn register(&self, req: Request<RegisterRequest>) -> Result<Response<RegisterResponse>, Status> {
        let r = req.into_inner();
        if r.address.is_empty() || r.address.len() > MAX_FIELD || r.worker_id.len() > MAX_FIELD {
            return Err(Status::invalid_argument("address must be a URL of at most 512 bytes"));
        }
        if r.metrics_address.len() > MAX_FIELD {
            return Err(Status::invalid_argument("metrics_address must be at most 512 bytes"));
        }
        if !(r.address.starts_with("http://") || r.address.starts_with("https://")) {
            return Err(Status::invalid_argument(format!(
                "address '{}' must start with http:// or https://",
                r.address
            )));
        }
        let seq = self.cluster.next.fetch_add(1, Ordering::Relaxed);
        let id = if r.worker_id.is_empty() {
            format!("worker-{seq}")
        } else {
            r.worker_id
        };
        let entry = WorkerEntry {
            id: id.clone(),
            address: r.address,
            device_kind: r.device_kind,
            cores: r.cores,
            memory_bytes: r.memory_bytes,
            features: r.features,
            kv_cache_bytes: r.kv_cache_bytes,
            metrics_address: r.metrics_address,
            seq,
            last_seen: Instant::now(),
        };
        tracing::info!(worker = %id, address = %entry.address, device = %entry.device_kind, "worker registered");
        self.cluster.lock().insert(id.clone(), entry);
        self.cluster.changed.notify_waiters();
        Ok(Response::new(RegisterResponse {
            worker_id: id,
            heartbeat_interval_ms: self.cluster.heartbeat_interval.as_millis() as u64,
        }))
    }

    async fn heartbeat(&self, req: Request<HeartbeatRequest>) -> Result<Response<HeartbeatResponse>, Status> {
        let beat = req.into_inner();
        let known = match self.cluster.lock().get_mut(&beat.worker_id) {
            // An empty address: a worker that does not say (its id alone decides).
            Some(w) if beat.address.is_empty() || w.address == beat.address => {
                w.last_seen = Instant::now();
                true
            }
            _ => false,
        };
        Ok(Response::new(HeartbeatResponse { known }))
    }

    async fn deregister(&self, req: Request<DeregisterRequest>) -> Result<Response<DeregisterResponse>, Status> {
        self.cluster.remove(&req.into_inner().worker_id);
        Ok(Response::new(DeregisterResponse {}))
    }
}

/// Serve the registry on `listener`, accepting only calls with the cluster token (and, with TLS
/// on, only workers whose certificate chains to the cluster CA), within `limits`.
pub async fn serve(
    listener: tokio::net::TcpListener,
    cluster: std::sync::Arc<Cluster>,
    peer: &baton_shared::auth::PeerAuth,
    limits: &baton_shared::grpc_limits::GrpcLimits,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    use baton_shared::proto::registry_server::RegistryServer;
    use tonic::service::interceptor::InterceptedService;
    let svc = InterceptedService::new(
        RegistryServer::new(RegistryService { cluster }).max_decoding_message_size(64 << 10),
        peer.check_token(),
    );
    limits
        .apply(peer.server()?)
        .add_service(svc)
        .serve_with_incoming_shutdown(
            tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
            shutdown,
        )
        .await?;
    Ok(())
}

/// Why the registry server could not start or stopped.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Peer(#[from] baton_shared::auth::PeerError),
    #[error("registry server: {0}")]
    Transport(#[from] tonic::transport::Error),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn register(svc: &RegistryService, address: &str) -> String {
        let req = RegisterRequest {
            address: address.into(),
            ..Default::default()
        };
        futures::executor::block_on(svc.register(Request::new(req)))
            .unwrap()
            .into_inner()
            .worker_id
    }

    fn beat(svc: &RegistryService, id: &str, address: &str) -> bool {
        let req = HeartbeatRequest {
            worker_id: id.into(),
            address: address.into(),
        };
        futures::executor::block_on(svc.heartbeat(Request::new(req)))
            .unwrap()
            .into_inner()
            .known
    }

    #[test]
    fn a_heartbeat_counts_only_for_the_worker_registered_under_its_id_and_address() {
        // A restarted coordinator hands out worker-0 again: a worker that had that id from the
        // old one must learn it is unknown here, not keep someone else's entry alive.
        let svc = RegistryService {
            cluster: std::sync::Arc::new(Cluster::new(Duration::from_secs(1))),
        };
        let id = register(&svc, "http://10.0.0.2:7000");
        assert_eq!(id, "worker-0");
        assert!(beat(&svc, &id, "http://10.0.0.2:7000"));
        assert!(!beat(&svc, &id, "http://10.0.0.1:7000"), "same id, another worker");
        assert!(!beat(&svc, "worker-9", "http://10.0.0.2:7000"));
        register(&svc, "http://10.0.0.1:7000");
        assert_eq!(svc.cluster.alive().len(), 2);
    }
}
