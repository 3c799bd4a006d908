//! The cluster token: every gRPC call between coordinator and workers carries
//! `authorization: Bearer <token>` (and the caller's trace context); servers reject calls
//! without the right token.

use tonic::metadata::MetadataValue;
use tonic::service::Interceptor;
use tonic::{Request, Status};

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
