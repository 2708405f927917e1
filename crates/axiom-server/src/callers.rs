//! Who may call: an API key, JSON-only POSTs (a browser sends `text/plain` cross-site without
//! asking first), the `Host` header on a loopback server (DNS rebinding), and CORS.

use crate::api::ApiError;
use axum::body::Body;
use axum::http::{header, HeaderName, HeaderValue, Method, Request, Response, StatusCode};
use axum::response::IntoResponse;
use subtle::ConstantTimeEq;
use tower_http::cors::{AllowOrigin, CorsLayer};
use tower_http::validate_request::ValidateRequest;

/// Who may call, as the operator configured it.
#[derive(Clone, Debug, Default)]
pub struct CallerPolicy {
    /// When set, every route but `/health` needs `Authorization: Bearer <key>`.
    pub api_key: Option<String>,
    /// `/metrics` without the key.
    pub metrics_public: bool,
    /// Origins whose browser pages may call (`*` for any); none by default.
    pub cors_origins: Vec<String>,
    /// Host names accepted besides the loopback ones while the server listens on loopback.
    pub allowed_hosts: Vec<String>,
}

/// The API key check: constant-time, so the comparison's time says nothing about the key.
#[derive(Clone)]
pub struct BearerKey {
    key: std::sync::Arc<[u8]>,
    metrics_public: bool,
}

impl BearerKey {
    pub fn new(key: &str, metrics_public: bool) -> BearerKey {
        BearerKey {
            key: key.as_bytes().into(),
            metrics_public,
        }
    }

    fn open(&self, path: &str) -> bool {
        path == "/health" || (self.metrics_public && path == "/metrics")
    }
}

impl<B> ValidateRequest<B> for BearerKey {
    type ResponseBody = Body;

    fn validate(&mut self, request: &mut Request<B>) -> Result<(), Response<Body>> {
        // Preflights carry no credentials; the CORS layer answers them.
        if self.open(request.uri().path()) || request.method() == Method::OPTIONS {
            return Ok(());
        }
        let given = request
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "));
        match given {
            Some(given) if bool::from(given.ct_eq(&self.key)) => Ok(()),
            _ => {
                let message = if given.is_some() {
                    "the API key is not valid"
                } else {
                    "an API key is required: send it as `Authorization: Bearer <key>`"
                };
                let mut response =
                    ApiError::new(StatusCode::UNAUTHORIZED, "authentication_error", message).into_response();
                response
                    .headers_mut()
                    .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
                Err(response)
            }
        }
    }
}

/// POST bodies must be declared JSON.
#[derive(Clone, Copy)]
pub struct JsonOnly;

impl<B> ValidateRequest<B> for JsonOnly {
    type ResponseBody = Body;

    fn validate(&mut self, request: &mut Request<B>) -> Result<(), Response<Body>> {
        if request.method() != Method::POST {
            return Ok(());
        }
        let declared = request.headers().get(header::CONTENT_TYPE).map(HeaderValue::as_bytes);
        let essence = declared.map(|v| v.split(|&b| b == b';').next().unwrap_or(v).trim_ascii());
        if essence.is_some_and(|e| e.eq_ignore_ascii_case(b"application/json")) {
            return Ok(());
        }
        let what = declared.map_or("none".into(), |v| format!("{:?}", String::from_utf8_lossy(v)));
        Err(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "invalid_request_error",
            format!("the request body must be JSON with `Content-Type: application/json` (got {what})"),
        )
        .into_response())
    }
}

/// On a loopback server, only requests addressed to a loopback name (or an allowed host), so
/// that a web page whose name was rebound to 127.0.0.1 cannot reach it.
#[derive(Clone)]
pub struct LoopbackHosts {
    allowed: std::sync::Arc<[String]>,
}

impl LoopbackHosts {
    pub fn new(allowed: &[String]) -> LoopbackHosts {
        let loopback = ["localhost", "127.0.0.1", "[::1]"].map(String::from);
        let allowed = loopback
            .into_iter()
            .chain(allowed.iter().map(|h| h.to_ascii_lowercase()))
            .collect();
        LoopbackHosts { allowed }
    }

    fn accepts(&self, host: &str) -> bool {
        let name = strip_port(host).to_ascii_lowercase();
        self.allowed.contains(&name)
    }
}

/// `example.com:8080` -> `example.com`; `[::1]:8080` -> `[::1]`.
fn strip_port(host: &str) -> &str {
    match host.rfind(':') {
        Some(i) if !host[i..].contains(']') && (host.starts_with('[') || !host[..i].contains(':')) => &host[..i],
        _ => host,
    }
}

impl<B> ValidateRequest<B> for LoopbackHosts {
    type ResponseBody = Body;

    fn validate(&mut self, request: &mut Request<B>) -> Result<(), Response<Body>> {
        // HTTP/1.0 clients may send no Host; browsers always do.
        let Some(host) = request.headers().get(header::HOST) else {
            return Ok(());
        };
        match host.to_str() {
            Ok(h) if self.accepts(h) => Ok(()),
            _ => Err(ApiError::new(
                StatusCode::FORBIDDEN,
                "invalid_request_error",
                format!(
                    "the Host {:?} is not served here: this server listens on loopback (allow a name with --allowed-host)",
                    String::from_utf8_lossy(host.as_bytes())
                ),
            )
            .into_response()),
        }
    }
}

/// CORS for the configured origins; `None` when there are none (no CORS headers at all).
pub fn cors(origins: &[String]) -> Result<Option<CorsLayer>, String> {
    if origins.is_empty() {
        return Ok(None);
    }
    let allow = if origins.iter().any(|o| o == "*") {
        AllowOrigin::any()
    } else {
        let list = origins
            .iter()
            .map(|o| HeaderValue::from_str(o).map_err(|_| format!("--cors-origin {o:?} is not a valid origin")))
            .collect::<Result<Vec<_>, _>>()?;
        AllowOrigin::list(list)
    };
    Ok(Some(
        CorsLayer::new()
            .allow_origin(allow)
            .allow_methods([Method::GET, Method::POST])
            .allow_headers([header::AUTHORIZATION, header::CONTENT_TYPE])
            .max_age(std::time::Duration::from_secs(600))
            .expose_headers([HeaderName::from_static("x-request-id")]),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_stripped_from_hosts() {
        assert_eq!(strip_port("localhost:8080"), "localhost");
        assert_eq!(strip_port("localhost"), "localhost");
        assert_eq!(strip_port("[::1]:80"), "[::1]");
        assert_eq!(strip_port("[::1]"), "[::1]");
        let hosts = LoopbackHosts::new(&["Box.Lan".into()]);
        assert!(hosts.accepts("127.0.0.1:9"));
        assert!(hosts.accepts("box.lan:8080"));
        assert!(!hosts.accepts("evil.example"));
        assert!(!hosts.accepts("127.0.0.1.evil.example"));
    }
}
