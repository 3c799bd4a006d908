//! OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the matching
//! HTTP status, and the JSON body extractor whose every rejection is one of them.

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::generation::SubmitError;

/// An error answered to the client in OpenAI's JSON shape.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{status}: {message}")]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `type`, e.g. `invalid_request_error`.
    pub kind: &'static str,
    /// The request field at fault, when there is one.
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds for a `Retry-After` header (429 and 503).
    pub retry_after: Option<u32>,
    /// The configured or built-in limit the request ran into, counted in
    /// `baton_http_limit_hits_total{limit}`.
    pub limit: Option<&'static str>,
}

/// The JSON body of an error.
#[derive(Debug, Serialize)]
pub struct ErrorBody<'a> {
    pub error: ErrorDetail<'a>,
}

/// The `error` object itself.
#[derive(Debug, Serialize)]
pub struct ErrorDetail<'a> {
    pub message: &'a str,
    #[serde(rename = "type")]
    pub kind: &'a str,
    pub param: Option<&'a str>,
    pub code: Option<&'a str>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            retry_after: None,
            limit: None,
        }
    }

    /// The same error, counted as a hit of `limit` (a setting's name, or a built-in bound).
    pub fn at_limit(mut self, limit: &'static str) -> Self {
        self.limit = Some(limit);
        self
    }

    /// 401: no API key, or not one the server accepts.
    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self {
            code: Some("invalid_api_key"),
            ..Self::new(StatusCode::UNAUTHORIZED, "invalid_request_error", message)
        }
    }

    /// 400 about the request as a whole.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    /// 400 about one field.
    pub fn invalid_param(param: &str, message: impl Into<String>) -> Self {
        Self::bad_request(message).with_param(param)
    }

    /// 404 for a model this server does not serve.
    pub fn model_not_found(model: &str) -> Self {
        let mut e = Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!("The model `{model}` does not exist."),
        )
        .with_param("model");
        e.code = Some("model_not_found");
        e
    }

    /// 404 for a path that has no route.
    pub fn unknown_url(method: &str, path: &str) -> Self {
        let mut e = Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!("Unknown request URL: {method} {path}."),
        );
        e.code = Some("unknown_url");
        e
    }

    /// 405 for a known path with the wrong method.
    pub fn method_not_allowed(method: &str, path: &str) -> Self {
        let mut e = Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "invalid_request_error",
            format!("Method {method} is not allowed for {path}."),
        );
        e.code = Some("method_not_allowed");
        e
    }

    /// 413 for a body over the configured limit.
    pub fn too_large(limit: usize) -> Self {
        let mut e = Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!("request body is larger than the limit of {limit} bytes"),
        );
        e.code = Some("request_too_large");
        e.at_limit("max_body_bytes")
    }

    /// 408 for a body not received within the deadline.
    pub fn body_timeout(deadline: std::time::Duration) -> Self {
        let mut e = Self::new(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request_error",
            format!("the request body did not arrive within {} s", deadline.as_secs()),
        );
        e.code = Some("request_timeout");
        e.at_limit("body_timeout_secs")
    }

    /// 503: nothing can serve the request right now; clients may retry.
    pub fn unavailable(message: impl Into<String>) -> Self {
        let mut e = Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message);
        e.code = Some("service_unavailable");
        e.retry_after = Some(1);
        e
    }

    /// 429: the queue is full; clients should back off and retry.
    pub fn overloaded(message: impl Into<String>) -> Self {
        let mut e = Self::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", message);
        e.code = Some("rate_limit_exceeded");
        e.retry_after = Some(1);
        e.at_limit("max_queue")
    }

    /// 500: a bug or an unexpected failure on our side.
    pub fn internal(message: impl Into<String>) -> Self {
        let mut e = Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message);
        e.code = Some("internal_error");
        e
    }

    /// The same error naming the field at fault.
    pub fn with_param(mut self, param: &str) -> Self {
        self.param = Some(param.to_string());
        self
    }

    /// The `{"error": ...}` body.
    pub fn body(&self) -> ErrorBody<'_> {
        ErrorBody {
            error: ErrorDetail {
                message: &self.message,
                kind: self.kind,
                param: self.param.as_deref(),
                code: self.code,
            },
        }
    }
}

impl From<SubmitError> for ApiError {
    fn from(e: SubmitError) -> Self {
        match e {
            SubmitError::Unavailable(m) => Self::unavailable(m),
            SubmitError::Overloaded(m) => Self::overloaded(m),
            SubmitError::Invalid(m) => Self::bad_request(m),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if let Some(limit) = self.limit {
            metrics::counter!("baton_http_limit_hits_total", "limit" => limit).increment(1);
        }
        if self.status.is_server_error() {
            tracing::warn!(status = self.status.as_u16(), message = %self.message, "request failed");
        } else {
            tracing::debug!(status = self.status.as_u16(), message = %self.message, "request rejected");
        }
        let mut res = (self.status, axum::Json(self.body())).into_response();
        if let Some(secs) = self.retry_after {
            res.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        res
    }
}

/// A JSON request body. Unlike `axum::Json` it ignores the content type (curl's `-d` sends a
/// form type) and turns every failure into an OpenAI-shaped error naming the field at fault.
#[derive(Debug)]
pub struct JsonBody<T>(pub T);

impl<S, T> FromRequest<S> for JsonBody<T>
where
    S: Send + Sync,
    T: DeserializeOwned,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        // The body's size and deadline were enforced before (api::read_body_in_time).
        let bytes = Bytes::from_request(req, state).await.map_err(|rejection| {
            ApiError::bad_request(format!("could not read the request body: {}", rejection.body_text()))
        })?;
        parse_json(&bytes).map(JsonBody)
    }
}

/// Deserialize a request body, naming the offending field on a type error.
pub fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::bad_request(
            "the request body is empty; expected a JSON object",
        ));
    }
    // Structs also deserialize from arrays; an OpenAI body is always an object.
    if bytes.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(match serde_json::from_slice::<serde_json::Value>(bytes) {
            Err(e) => syntax_error(&e),
            Ok(_) => ApiError::bad_request("the request body must be a JSON object"),
        });
    }
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        use serde_json::error::Category;
        match inner.classify() {
            Category::Syntax | Category::Eof | Category::Io => syntax_error(&inner),
            Category::Data => data_error(&path, &inner.to_string()),
        }
    })?;
    // Trailing garbage after the object is malformed JSON too.
    de.end().map_err(|e| syntax_error(&e))?;
    Ok(value)
}

fn syntax_error(e: &serde_json::Error) -> ApiError {
    ApiError::bad_request(format!("invalid JSON in the request body: {e}"))
}

/// A type or missing-field error, attributed to its field.
fn data_error(path: &str, message: &str) -> ApiError {
    // serde reports a missing field at its parent, naming the field only in the message.
    if let Some(field) = message
        .strip_prefix("missing field `")
        .and_then(|rest| rest.split('`').next())
    {
        let param = if path == "." {
            field.to_string()
        } else {
            format!("{path}.{field}")
        };
        return ApiError::invalid_param(&param, format!("'{param}' is a required property"));
    }
    if path == "." {
        return ApiError::bad_request(format!("invalid request body: {message}"));
    }
    ApiError::invalid_param(path, format!("invalid value for '{path}': {message}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize)]
    #[allow(dead_code)]
    struct Req {
        model: String,
        temperature: Option<f32>,
        messages: Vec<Msg>,
    }

    #[derive(Debug, serde::Deserialize)]
    #[allow(dead_code)]
    struct Msg {
        role: String,
    }

    #[test]
    fn errors_name_the_field() {
        let e = parse_json::<Req>(br#"{"model": "m", "temperature": "hot", "messages": []}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("temperature"));
        assert!(e.message.contains("invalid type"), "{}", e.message);
        let e = parse_json::<Req>(br#"{"model": "m", "messages": [{"role": 3}]}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].role"));
        let e = parse_json::<Req>(br#"{"model": "m"}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages"));
        let e = parse_json::<Req>(br#"{"model": "m", "messages": [{}]}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].role"));
    }

    #[test]
    fn malformed_json_is_a_plain_400() {
        for body in [
            &b"{"[..],
            b"{\"model\": }",
            b"",
            br#"{"model": "m", "messages": []} x"#,
            b"[1",
        ] {
            let e = parse_json::<Req>(body).unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST);
            assert_eq!(e.param, None, "{}", e.message);
        }
        let e = parse_json::<Req>(b"[]").unwrap_err();
        assert!(e.message.contains("must be a JSON object"), "{}", e.message);
    }
}
