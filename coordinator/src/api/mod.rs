//! The OpenAI-compatible HTTP API: `/v1/completions`, `/v1/chat/completions`, `/v1/models`,
//! plus `/health`, `/ready`, `/metrics`, `/admin/cluster` and the `/dashboard` page. Text lives
//! here (templating, tokenizing, detokenizing, stop strings); token production is behind
//! [`Generator`]. [`auth`] guards it with API keys when configured.

pub mod auth;
pub mod chat;
pub mod completions;
pub mod dashboard;
pub mod error;
pub mod output;
pub mod params;
pub mod respond;
pub mod server;
pub mod stream;
pub mod types;

use baton_shared::sampling::SamplingDefaults;
use std::future::Future;
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{Method, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use baton_shared::chat_template::ChatTemplate;
use baton_shared::tokenizer::Tokenizer;

use self::error::ApiError;
use self::types::{ModelCard, ModelList};
use crate::generation::Generator;

/// Default request body limit: plenty for any prompt that fits a context window.
pub const DEFAULT_MAX_BODY_BYTES: usize = 4 << 20;

/// Everything the handlers share.
pub struct AppState {
    /// The name clients use in `model` (and see in `/v1/models`).
    pub model_name: String,
    pub tokenizer: Arc<Tokenizer>,
    /// The model's compiled chat template; chat requests are refused without one.
    pub chat_template: Option<Arc<ChatTemplate>>,
    /// Most tokens (prompt + completion) one sequence may hold.
    pub max_context: usize,
    /// Larger request bodies are answered with 413.
    pub max_body_bytes: usize,
    /// Time a client has to send a request's body; slower ones are answered with 408.
    pub body_timeout: std::time::Duration,
    /// Sampling values for fields a request leaves out (the model's recommendation).
    pub sampling_defaults: SamplingDefaults,
    pub generator: Arc<dyn Generator>,
    /// When the server started (`created` in `/v1/models`).
    pub started: u64,
    /// Keys `/v1/*` (and, if configured, the admin routes) require; `None`: open.
    pub api_keys: Option<auth::ApiKeys>,
}

impl AppState {
    /// State for a model, compiling its chat template (a template that does not compile is
    /// logged and chat is refused, so completions still work).
    pub fn new(
        model_name: impl Into<String>,
        tokenizer: Arc<Tokenizer>,
        max_context: usize,
        generator: Arc<dyn Generator>,
    ) -> Self {
        let chat_template = match chat::compile_chat_template(&tokenizer) {
            Ok(t) => t.map(Arc::new),
            Err(e) => {
                tracing::warn!(error = %e, "the model's chat template does not compile; chat is disabled");
                None
            }
        };
        Self {
            model_name: model_name.into(),
            tokenizer,
            chat_template,
            max_context,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            body_timeout: std::time::Duration::from_secs(baton_shared::settings::DEFAULT_BODY_TIMEOUT_SECS),
            sampling_defaults: SamplingDefaults::default(),
            generator,
            started: unix_now(),
            api_keys: None,
        }
    }
}

/// The API's routes over `state`.
pub fn router(state: AppState) -> Router {
    let body_limits = BodyLimits {
        max_bytes: state.max_body_bytes,
        deadline: state.body_timeout,
    };
    let keys = state.api_keys.clone().map(Arc::new);
    let router = Router::new()
        .route("/v1/completions", post(completions::completions))
        .route("/v1/chat/completions", post(chat::chat_completions))
        .route("/v1/models", get(list_models))
        .route("/v1/models/{*id}", get(get_model))
        .route("/health", get(health))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
        .route("/admin/cluster", get(admin_cluster))
        .route("/dashboard", get(dashboard::page))
        .fallback(unknown_route)
        .method_not_allowed_fallback(wrong_method)
        // read_body_in_time has already held the body to max_body_bytes (413) and its deadline
        // (408) before any extractor runs, so axum's own 2 MB default must not apply again.
        .layer(DefaultBodyLimit::disable())
        .layer(axum::middleware::from_fn_with_state(body_limits, read_body_in_time))
        .with_state(Arc::new(state));
    match keys {
        // Outermost, so an unauthenticated request is refused before its body is read.
        Some(keys) => router.layer(axum::middleware::from_fn_with_state(keys, auth::require_key)),
        None => router,
    }
}

/// Serve `router` on `listener` within `limits` until `shutdown` completes, then finish
/// in-flight requests.
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    limits: server::HttpLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    server::serve(listener, router, limits, shutdown).await
}

/// What a request body may be: its size and the time to receive it.
#[derive(Debug, Clone, Copy)]
struct BodyLimits {
    max_bytes: usize,
    deadline: std::time::Duration,
}

/// Receive the whole body within the deadline (408 otherwise) and the size limit (413), before
/// any handler runs: a client trickling its body cannot hold a request open for long.
async fn read_body_in_time(
    State(limits): State<BodyLimits>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    use futures::StreamExt;
    let (parts, body) = req.into_parts();
    let receive = async {
        let mut stream = body.into_data_stream();
        let mut bytes = Vec::new();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| ApiError::bad_request(format!("could not read the request body: {e}")))?;
            if bytes.len() + chunk.len() > limits.max_bytes {
                return Err(ApiError::too_large(limits.max_bytes));
            }
            bytes.extend_from_slice(&chunk);
        }
        Ok(bytes)
    };
    match tokio::time::timeout(limits.deadline, receive).await {
        Ok(Ok(bytes)) => {
            next.run(axum::extract::Request::from_parts(parts, axum::body::Body::from(bytes)))
                .await
        }
        Ok(Err(e)) => e.into_response(),
        Err(_) => ApiError::body_timeout(limits.deadline).into_response(),
    }
}

fn model_card(state: &AppState) -> ModelCard {
    ModelCard {
        id: state.model_name.clone(),
        object: "model",
        created: state.started,
        owned_by: "baton",
        max_model_len: state.max_context,
    }
}

async fn list_models(State(state): State<Arc<AppState>>) -> Json<ModelList> {
    Json(ModelList {
        object: "list",
        data: vec![model_card(&state)],
    })
}

async fn get_model(State(state): State<Arc<AppState>>, Path(id): Path<String>) -> Result<Json<ModelCard>, ApiError> {
    if id == state.model_name {
        Ok(Json(model_card(&state)))
    } else {
        Err(ApiError::model_not_found(&id))
    }
}

/// The serving topology (workers, layer ranges, load) as JSON.
async fn admin_cluster(State(state): State<Arc<AppState>>) -> Json<serde_json::Value> {
    let mut view = state.generator.describe();
    view["model"] = serde_json::json!(state.model_name);
    // The dashboard's clock for rates, so they do not depend on the viewer's timers.
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    view["server_time_ms"] = serde_json::json!(now.map_or(0, |d| d.as_millis() as u64));
    Json(view)
}

/// Prometheus metrics of this process.
async fn metrics() -> impl IntoResponse {
    (
        [(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        baton_shared::telemetry::render(),
    )
}

/// Liveness: the process answers.
async fn health() -> Json<serde_json::Value> {
    Json(serde_json::json!({ "status": "ok" }))
}

/// Readiness: requests can be served now.
async fn ready(State(state): State<Arc<AppState>>) -> Response {
    if state.generator.ready() {
        Json(serde_json::json!({ "status": "ready" })).into_response()
    } else {
        ApiError::unavailable("the model is not ready to serve requests").into_response()
    }
}

async fn unknown_route(method: Method, uri: Uri) -> ApiError {
    ApiError::unknown_url(method.as_str(), uri.path())
}

async fn wrong_method(method: Method, uri: Uri) -> ApiError {
    ApiError::method_not_allowed(method.as_str(), uri.path())
}

/// Seconds since the Unix epoch (OpenAI's `created`).
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A unique, unguessable-enough id like `chatcmpl-3f9a…`.
pub fn request_id(prefix: &str) -> String {
    static KEY: OnceLock<u64> = OnceLock::new();
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let key = *KEY.get_or_init(|| RandomState::new().hash_one(std::process::id()));
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    // SplitMix64's finalizer is a bijection, so distinct counters give distinct ids.
    let mut z = key.wrapping_add(n.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    format!("{prefix}-{:016x}", z ^ (z >> 31))
}
