//! Worker-plane credentials: every gRPC call between coordinator and workers carries
//! `authorization: Bearer <token>` (and the caller's trace context), and servers reject calls
//! without the right token; with TLS on, connections are also mutually authenticated by
//! certificates from the cluster CA ([`PeerAuth`]).

use std::sync::Arc;

use tonic::metadata::MetadataValue;
use tonic::service::Interceptor;
use tonic::transport::{Endpoint, Server};
use tonic::{Request, Status};

use crate::tls::{ClusterTls, TlsError};

/// What a process presents on the worker plane: the cluster token on every call and, unless the
/// plane is plain text, its TLS identity for every connection it makes or accepts.
#[derive(Clone)]
pub struct PeerAuth {
    pub token: String,
    pub tls: Option<Arc<ClusterTls>>,
}

impl std::fmt::Debug for PeerAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerAuth")
            .field("token", &"<redacted>")
            .field("tls", &self.tls.is_some())
            .finish()
    }
}

/// A worker-plane connection that could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error("bad peer URL '{url}': {reason}")]
    Url { url: String, reason: String },
    #[error("TLS configuration rejected: {0}")]
    Config(String),
}

impl From<PeerError> for Status {
    fn from(e: PeerError) -> Self {
        Status::invalid_argument(e.to_string())
    }
}

impl PeerAuth {
    /// Token only, plain-text connections (loopback, or an explicitly trusted network).
    pub fn plaintext(token: impl Into<String>) -> Self {
        Self {
            token: token.into(),
            tls: None,
        }
    }

    /// Token and mutual TLS.
    pub fn with_tls(token: impl Into<String>, tls: ClusterTls) -> Self {
        Self {
            token: token.into(),
            tls: Some(Arc::new(tls)),
        }
    }

    /// `https` with TLS, else `http`: how this node's peers are addressed.
    pub fn scheme(&self) -> &'static str {
        crate::tls::scheme(self.tls.is_some())
    }

    /// An endpoint for `url`, with this node's client certificate when TLS is on.
    pub fn endpoint(&self, url: &str) -> Result<Endpoint, PeerError> {
        crate::tls::check_scheme(url, self.tls.is_some())?;
        let endpoint = Endpoint::from_shared(url.to_string()).map_err(|e| PeerError::Url {
            url: url.into(),
            reason: e.to_string(),
        })?;
        match &self.tls {
            Some(tls) => endpoint
                .tls_config(tls.client_config())
                .map_err(|e| PeerError::Config(e.to_string())),
            None => Ok(endpoint),
        }
    }

    /// A gRPC server that, with TLS on, accepts only clients with a cluster certificate.
    pub fn server(&self) -> Result<Server, PeerError> {
        let server = Server::builder();
        match &self.tls {
            Some(tls) => server
                .tls_config(tls.server_config())
                .map_err(|e| PeerError::Config(e.to_string())),
            None => Ok(server),
        }
    }

    /// The interceptor that adds the token to outgoing calls.
    pub fn add_token(&self) -> Result<AddToken, Status> {
        AddToken::new(&self.token)
    }

    /// The interceptor that checks incoming calls for the token.
    pub fn check_token(&self) -> CheckToken {
        CheckToken::new(&self.token)
    }
}

/// Adds the cluster token to outgoing calls.
#[derive(Clone)]
pub struct AddToken {
    header: MetadataValue<tonic::metadata::Ascii>,
}

impl AddToken {
    /// An interceptor for `token` (must be printable ASCII).
    pub fn new(token: &str) -> Result<Self, Status> {
        let header = format!("Bearer {token}")
            .parse()
            .map_err(|_| Status::invalid_argument("cluster token must be printable ASCII"))?;
        Ok(Self { header })
    }
}

impl Interceptor for AddToken {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        req.metadata_mut().insert("authorization", self.header.clone());
        // Every call to a worker joins the caller's trace (nothing is added when not tracing).
        crate::trace_context::inject_metadata(req.metadata_mut());
        Ok(req)
    }
}

/// Rejects incoming calls that lack the cluster token.
#[derive(Clone)]
pub struct CheckToken {
    expected: String,
}

impl CheckToken {
    /// A checker for `token`.
    pub fn new(token: &str) -> Self {
        Self {
            expected: format!("Bearer {token}"),
        }
    }
}

impl Interceptor for CheckToken {
    fn call(&mut self, req: Request<()>) -> Result<Request<()>, Status> {
        match req.metadata().get("authorization").and_then(|v| v.to_str().ok()) {
            Some(v) if constant_time_eq(v.as_bytes(), self.expected.as_bytes()) => Ok(req),
            Some(_) => Err(Status::unauthenticated("wrong cluster token")),
            None => Err(Status::unauthenticated(
                "missing cluster token (authorization: Bearer ...)",
            )),
        }
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// A random token for a cluster that lives inside one `baton serve`.
pub fn random_token() -> String {
    use std::hash::{BuildHasher, Hasher};
    // RandomState is seeded from the OS; two of them give 128 unpredictable bits.
    let part = || {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos()),
        );
        h.finish()
    };
    format!("{:016x}{:016x}", part(), part())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_accepts_only_the_token() {
        let mut check = CheckToken::new("s3cret");
        let mut add = AddToken::new("s3cret").unwrap();
        assert!(check.call(add.call(Request::new(())).unwrap()).is_ok());
        let mut wrong = AddToken::new("nope").unwrap();
        assert_eq!(
            check.call(wrong.call(Request::new(())).unwrap()).unwrap_err().code(),
            tonic::Code::Unauthenticated
        );
        assert_eq!(
            check.call(Request::new(())).unwrap_err().code(),
            tonic::Code::Unauthenticated
        );
        assert_ne!(random_token(), random_token());
    }
}
