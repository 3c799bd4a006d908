//! Starting the cluster side of a coordinator: the worker registry (gRPC) and the pipeline
//! generator that uses the registered workers.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use baton_shared::grpc_limits::GrpcLimits;
use tokio::net::TcpListener;

use crate::pipeline::{PipelineConfig, PipelineGenerator};
use crate::registry::{self, Cluster};

/// How often workers heartbeat; a worker silent for three intervals is dead.
pub const HEARTBEAT_INTERVAL: Duration = Duration::from_millis(500);

/// A running registry + pipeline.
pub struct ClusterServer {
    pub generator: Arc<PipelineGenerator>,
    pub cluster: Arc<Cluster>,
    /// Where workers register.
    pub registry_addr: SocketAddr,
}

/// Serve the registry on `listener` within `limits` and start the pipeline generator (must run
/// inside tokio).
pub fn start(listener: TcpListener, config: PipelineConfig, limits: GrpcLimits) -> std::io::Result<ClusterServer> {
    let registry_addr = listener.local_addr()?;
    let cluster = Arc::new(Cluster::new(HEARTBEAT_INTERVAL));
    let peer = config.peer.clone();
    let c = cluster.clone();
    tokio::spawn(async move {
        if let Err(e) = registry::serve(listener, c, &peer, &limits, std::future::pending()).await {
            tracing::error!(error = %e, "registry server stopped");
        }
    });
    let generator = Arc::new(PipelineGenerator::start(config, cluster.clone()));
    Ok(ClusterServer {
        generator,
        cluster,
        registry_addr,
    })
}
