//! One access-log line per request, written when its response (a stream, maybe) has ended,
//! and refusals counted in `/metrics` by status whichever layer refused.

use crate::metrics::ServerMetrics;
use axiom::engine::scheduler::Completion;
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::Response;
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tower_http::request_id::RequestId;

/// What a handler learns of its request, for the log line.
#[derive(Default)]
pub struct RequestRecord(Mutex<Outcome>);

#[derive(Default)]
struct Outcome {
    prompt_tokens: Option<usize>,
    completion_tokens: Option<usize>,
    first_token: Option<Instant>,
    finish: Option<&'static str>,
    /// The request's `user` field.
    user: Option<String>,
}

impl RequestRecord {
    fn with<T>(&self, f: impl FnOnce(&mut Outcome) -> T) -> T {
        f(&mut self.0.lock().unwrap_or_else(|e| e.into_inner()))
    }

    pub fn prompt(&self, tokens: usize) {
        self.with(|o| o.prompt_tokens = Some(tokens));
    }

    pub fn user(&self, user: &str) {
        self.with(|o| o.user = Some(user.to_owned()));
    }

    pub fn token(&self) {
        self.with(|o| {
            o.first_token.get_or_insert_with(Instant::now);
        });
    }

    /// One choice has ended: its tokens add to the request's, its reason is the request's last.
    pub fn done(&self, completion: &Completion) {
        self.with(|o| {
            *o.completion_tokens.get_or_insert(0) += completion.completion_tokens;
            o.finish = Some(completion.finish.as_str());
        });
    }

    pub fn failed(&self) {
        self.with(|o| o.finish = Some("error"));
    }
}

/// Logs the request once its response body is finished or dropped.
struct LogLine {
    id: String,
    method: String,
    route: String,
    status: u16,
    start: Instant,
    record: Arc<RequestRecord>,
}

impl Drop for LogLine {
    fn drop(&mut self) {
        let o = self.record.with(std::mem::take);
        // A request that reached the engine and has no finish was dropped by its client.
        let finish = o.finish.or(o.prompt_tokens.map(|_| "cancelled"));
        let ms = |t: Option<Instant>| t.map(|t| format!("{:.1}", (t - self.start).as_secs_f64() * 1e3));
        let none = || "-".to_string();
        tracing::info!(
            target: "axiom::access",
            "{} {} {} {} prompt_tokens={} completion_tokens={} ttft_ms={} total_ms={} finish={} user={}",
            self.id,
            self.method,
            self.route,
            self.status,
            o.prompt_tokens.map_or_else(none, |n| n.to_string()),
            o.completion_tokens.map_or_else(none, |n| n.to_string()),
            ms(o.first_token).unwrap_or_else(none),
            ms(Some(Instant::now())).unwrap_or_else(none),
            finish.unwrap_or("-"),
            // Quoted, so that a client's text cannot forge a log line.
            o.user.as_ref().map_or_else(none, |u| format!("{u:?}")),
        );
    }
}

/// The outermost layer: hands each request a [`RequestRecord`], counts refusals, and logs the
/// request when its response ends.
pub async fn log_request(State(metrics): State<Arc<ServerMetrics>>, mut request: Request, next: Next) -> Response {
    let start = Instant::now();
    let record = Arc::new(RequestRecord::default());
    request.extensions_mut().insert(record.clone());
    let id = request
        .extensions()
        .get::<RequestId>()
        .and_then(|id| id.header_value().to_str().ok())
        .unwrap_or("-")
        .to_owned();
    let method = request.method().to_string();
    let route = request.uri().path().to_owned();
    let response = next.run(request).await;
    let status = response.status();
    if status.is_client_error() || status.is_server_error() {
        metrics.count_request(&format!("rejected_{}", status.as_u16()));
    }
    let line = LogLine {
        id,
        method,
        route,
        status: status.as_u16(),
        start,
        record,
    };
    crate::hold_until_body_ends(response, line)
}
