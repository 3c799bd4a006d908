//! API keys for the HTTP API: with keys configured, `/v1/*` answers only requests carrying one
//! of them as `Authorization: Bearer KEY` (what the OpenAI SDKs send), with OpenAI's 401
//! otherwise. `/health` and `/ready` stay open for probes; `/metrics`, `/admin/*` and
//! `/dashboard` are protected too only when asked (`protect_admin`), since Prometheus scrapers
//! and a browser opening the dashboard often cannot send a key. As with vLLM's `--api-key`.

use std::path::Path;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{HeaderValue, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::error::ApiError;

/// The keys a server accepts, and which routes they guard.
#[derive(Clone)]
pub struct ApiKeys {
    keys: Vec<String>,
    protect_admin: bool,
}

impl std::fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the keys themselves.
        f.debug_struct("ApiKeys")
            .field("keys", &self.keys.len())
            .field("protect_admin", &self.protect_admin)
            .finish()
    }
}

/// A key that cannot be one, or a key file that cannot be read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ApiKeyError {
    #[error("an API key must not be empty")]
    Empty,
    #[error("API key {index} contains whitespace or a control character")]
    BadCharacter { index: usize },
    #[error("API key file {path}: {reason}")]
    File { path: String, reason: String },
    #[error("API key file {0} holds no key (one key per line; blank lines and # comments are skipped)")]
    NoKeys(String),
}

impl ApiKeys {
    /// Keys that guard `/v1/*` (and the admin routes when `protect_admin`); `None` for an empty
    /// list, which leaves the API open.
    pub fn new(keys: Vec<String>, protect_admin: bool) -> Result<Option<Self>, ApiKeyError> {
        for (index, key) in keys.iter().enumerate() {
            if key.is_empty() {
                return Err(ApiKeyError::Empty);
            }
            // A key travels in a header: it must be one printable token.
            if key.chars().any(|c| c.is_whitespace() || c.is_control()) {
                return Err(ApiKeyError::BadCharacter { index });
            }
        }
        Ok((!keys.is_empty()).then_some(Self { keys, protect_admin }))
    }

    /// The keys in `path`: one per line, blank lines and lines starting with `#` skipped.
    pub fn read_file(path: &Path) -> Result<Vec<String>, ApiKeyError> {
        let name = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| ApiKeyError::File {
            path: name.clone(),
            reason: e.to_string(),
        })?;
        let keys: Vec<String> = text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .map(String::from)
            .collect();
        if keys.is_empty() {
            return Err(ApiKeyError::NoKeys(name));
        }
        Ok(keys)
    }

    /// Whether a request for `path` needs a key.
    pub fn guards(&self, path: &str) -> bool {
        let admin = path == "/metrics" || path == "/dashboard" || path.starts_with("/admin/");
        match path {
            "/health" | "/ready" => false,
            _ if admin => self.protect_admin,
            // Everything else (the API and unknown routes, so they do not reveal what exists).
            _ => true,
        }
    }

    /// Whether `authorization` carries one of the keys. The comparison takes the same time
    /// wherever a wrong key differs.
    fn check(&self, authorization: Option<&HeaderValue>) -> Result<(), Rejection> {
        let Some(value) = authorization else {
            return Err(Rejection::Missing);
        };
        let Some(given) = value.to_str().ok().and_then(|v| v.strip_prefix("Bearer ")) else {
            return Err(Rejection::Missing);
        };
        let given = given.trim().as_bytes();
        let mut ok = false;
        for key in &self.keys {
            ok |= constant_time_eq(key.as_bytes(), given);
        }
        if ok { Ok(()) } else { Err(Rejection::Wrong) }
    }
}

/// Equal byte strings, in time that depends only on their lengths.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Why a request was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rejection {
    Missing,
    Wrong,
}

impl Rejection {
    fn reason(self) -> &'static str {
        match self {
            Rejection::Missing => "missing",
            Rejection::Wrong => "wrong",
        }
    }

    fn error(self) -> ApiError {
        let message = match self {
            Rejection::Missing => {
                "You didn't provide an API key. You need to provide your API key in an Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
            }
            Rejection::Wrong => "Incorrect API key provided.",
        };
        ApiError::unauthorized(message)
    }
}

/// The middleware: pass guarded requests that carry a key, answer the rest with 401.
pub async fn require_key(State(keys): State<Arc<ApiKeys>>, req: Request, next: Next) -> Response {
    let path = req.uri().path();
    if !keys.guards(path) {
        return next.run(req).await;
    }
    match keys.check(req.headers().get(header::AUTHORIZATION)) {
        Ok(()) => next.run(req).await,
        Err(rejection) => {
            metrics::counter!("baton_http_unauthorized_total", "reason" => rejection.reason()).increment(1);
            tracing::info!(path, reason = rejection.reason(), "request without a valid API key");
            let mut res = rejection.error().into_response();
            res.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            res
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(protect_admin: bool) -> ApiKeys {
        ApiKeys::new(vec!["k1".into(), "sk-second".into()], protect_admin)
            .unwrap()
            .unwrap()
    }

    #[test]
    fn keys_are_checked_whole_and_any_configured_key_passes() {
        let k = keys(false);
        let h = |v: &str| HeaderValue::from_str(v).unwrap();
        assert_eq!(k.check(Some(&h("Bearer k1"))), Ok(()));
        assert_eq!(k.check(Some(&h("Bearer sk-second"))), Ok(()));
        assert_eq!(k.check(Some(&h("Bearer k"))), Err(Rejection::Wrong));
        assert_eq!(k.check(Some(&h("Bearer k12"))), Err(Rejection::Wrong));
        assert_eq!(k.check(Some(&h("Basic k1"))), Err(Rejection::Missing));
        assert_eq!(k.check(None), Err(Rejection::Missing));
        assert!(!constant_time_eq(b"ab", b"ac") && constant_time_eq(b"ab", b"ab"));
    }

    #[test]
    fn probes_stay_open_and_admin_routes_follow_the_setting() {
        for (protect_admin, admin_guarded) in [(false, false), (true, true)] {
            let k = keys(protect_admin);
            assert!(!k.guards("/health") && !k.guards("/ready"));
            for p in ["/v1/completions", "/v1/chat/completions", "/v1/models", "/nope"] {
                assert!(k.guards(p), "{p}");
            }
            for p in ["/metrics", "/admin/cluster", "/dashboard"] {
                assert_eq!(k.guards(p), admin_guarded, "{p}");
            }
        }
    }

    #[test]
    fn bad_keys_and_key_files_are_refused_with_a_reason() {
        assert_eq!(ApiKeys::new(vec![], true).unwrap().map(|k| k.keys.len()), None);
        assert_eq!(
            ApiKeys::new(vec![String::new()], false).unwrap_err(),
            ApiKeyError::Empty
        );
        assert_eq!(
            ApiKeys::new(vec!["ok".into(), "has space".into()], false).unwrap_err(),
            ApiKeyError::BadCharacter { index: 1 }
        );
        let dir = std::env::temp_dir().join(format!("baton-keys-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("keys");
        std::fs::write(&file, "# team keys\n\n  alpha  \nbeta\n").unwrap();
        assert_eq!(ApiKeys::read_file(&file).unwrap(), vec!["alpha", "beta"]);
        std::fs::write(&file, "# nothing\n\n").unwrap();
        assert!(matches!(ApiKeys::read_file(&file), Err(ApiKeyError::NoKeys(_))));
        let missing = ApiKeys::read_file(&dir.join("absent")).unwrap_err();
        assert!(missing.to_string().contains("absent"), "{missing}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
