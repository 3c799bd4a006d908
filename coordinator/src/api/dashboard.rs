//! `GET /dashboard`: one self-contained HTML page (inline CSS and JS, nothing fetched from
//! elsewhere) that polls `/admin/cluster` and draws the pipeline, per-stage load and throughput.

use axum::http::header;
use axum::response::IntoResponse;

/// The page, compiled into the binary so a coordinator needs no files beside it.
pub const PAGE: &str = include_str!("dashboard.html");

/// Serve the dashboard page.
pub async fn page() -> impl IntoResponse {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-cache"),
            // The browser enforces what the page promises: it may talk only to this server.
            (
                header::CONTENT_SECURITY_POLICY,
                "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; \
                 connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'",
            ),
        ],
        PAGE,
    )
}

#[cfg(test)]
mod tests {
    use super::PAGE;

    #[test]
    fn page_is_self_contained() {
        for external in ["http://", "https://", "//cdn", "src=\"//", "@import", "url("] {
            assert!(!PAGE.contains(external), "the dashboard references {external}");
        }
        assert!(
            PAGE.contains("fetch(\"/admin/cluster\""),
            "the dashboard polls /admin/cluster"
        );
    }
}
