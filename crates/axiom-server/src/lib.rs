//! The OpenAI-compatible HTTP server: `POST /v1/chat/completions`, `POST /v1/completions`,
//! `GET /v1/models`, `GET /health`, `GET /metrics`, over an [`EngineHandle`] whose scheduler
//! runs on its own thread.
//!
//! A request is checked and tokenized in its handler, then submitted; the engine's events come
//! back through a channel, either gathered into one JSON response or streamed as server-sent
//! events ending with `data: [DONE]`. A client that goes away drops that channel, which the
//! scheduler notices at its next step: the sequence is cancelled and its pages freed.

// Input-dependent code returns typed errors: a panic would take a server, or a user's session, down.
// Internal invariants that cannot fail say so where they are allowed (`#[allow(..., reason = ...)]`).
#![cfg_attr(
    not(test),
    deny(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::panic,
        clippy::unreachable,
        clippy::todo,
        clippy::unimplemented
    )
)]

pub mod api;
pub mod metrics;

use api::{ApiError, Usage};
use axiom::chat::{ChatTemplate, Message};
use axiom::engine::scheduler::{Completion, EngineHandle, Event, EventSink, Request, SubmitError, TokenLogprob};
use axiom::tokenizer::Tokenizer;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::stream::{self, Stream, StreamExt};
use metrics::ServerMetrics;
use serde_json::{json, Value};
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

pub struct AppState {
    pub engine: EngineHandle,
    pub tokenizer: Arc<Tokenizer>,
    pub template: Option<ChatTemplate>,
    /// The id `/v1/models` reports and responses carry.
    pub model_id: String,
    pub metrics: Arc<ServerMetrics>,
    next_id: AtomicU64,
    started: u64,
}

impl AppState {
    pub fn new(
        engine: EngineHandle,
        tokenizer: Arc<Tokenizer>,
        template: Option<ChatTemplate>,
        model_id: String,
        metrics: Arc<ServerMetrics>,
    ) -> AppState {
        AppState {
            engine,
            tokenizer,
            template,
            model_id,
            metrics,
            next_id: AtomicU64::new(1),
            started: unix_time(),
        }
    }
}

fn unix_time() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// How much of a request body the server reads, and for how long.
#[derive(Clone, Copy, Debug)]
pub struct BodyLimits {
    pub max_bytes: usize,
    /// A client that has not sent its whole body by then gets 408, so a stalled upload cannot
    /// hold a connection (or a graceful shutdown) open.
    pub read_timeout: Duration,
}

/// The routes, with request bodies read under `limits`.
pub fn router(state: Arc<AppState>, limits: BodyLimits) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(prometheus_metrics))
        // `read_body` has already enforced the limit.
        .layer(DefaultBodyLimit::disable())
        .layer(middleware::from_fn_with_state(limits, read_body))
        .with_state(state)
}

/// Reads the whole body before a handler runs, within the size limit and the read timeout. An
/// oversized declared length gets 413 before any of the body is read.
async fn read_body(State(limits): State<BodyLimits>, request: axum::extract::Request, next: Next) -> Response {
    let too_large = |len: String| {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!(
                "the request body of {len} bytes is over the limit of {}",
                limits.max_bytes
            ),
        )
        .into_response()
    };
    let (parts, body) = request.into_parts();
    let declared = parts
        .headers
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if let Some(len) = declared.filter(|&len| len > limits.max_bytes as u64) {
        return too_large(len.to_string());
    }
    let read = async {
        let mut chunks = body.into_data_stream();
        let mut bytes = Vec::new();
        while let Some(chunk) = chunks.next().await {
            let chunk = chunk.map_err(|e| ApiError::invalid(format!("reading the request body: {e}"), None))?;
            if bytes.len() + chunk.len() > limits.max_bytes {
                return Ok(None);
            }
            bytes.extend_from_slice(&chunk);
        }
        Ok::<_, ApiError>(Some(bytes))
    };
    match tokio::time::timeout(limits.read_timeout, read).await {
        Ok(Ok(Some(bytes))) => next.run(axum::extract::Request::from_parts(parts, bytes.into())).await,
        Ok(Ok(None)) => too_large("more than that".into()),
        Ok(Err(e)) => e.into_response(),
        Err(_) => ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request_error",
            format!(
                "the request body was not received within {} s",
                limits.read_timeout.as_secs_f64()
            ),
        )
        .into_response(),
    }
}

async fn health(State(s): State<Arc<AppState>>) -> Response {
    let status = s.engine.status();
    Json(json!({"status": "ok", "running": status.running, "queued": status.queued})).into_response()
}

async fn models(State(s): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({
        "object": "list",
        "data": [{"id": s.model_id, "object": "model", "created": s.started, "owned_by": "axiom",
                  "max_model_len": s.engine.context()}],
    }))
}

async fn prometheus_metrics(State(s): State<Arc<AppState>>) -> Response {
    let text = s.metrics.render(s.engine.status());
    ([("content-type", "text/plain; version=0.0.4")], text).into_response()
}

fn body_error(rejection: BytesRejection) -> ApiError {
    ApiError::new(rejection.status(), "invalid_request_error", rejection.body_text())
}

/// What both endpoints hand to [`run`].
struct Job {
    prompt: Vec<u32>,
    request: api::Sampling,
    max_tokens: Option<i64>,
    /// Chat completions ask for "the rest of the context" by default, completions for 16.
    default_max_tokens: Option<usize>,
    logprobs: Option<usize>,
    chat: bool,
}

async fn chat_completions(State(s): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    let result = async {
        let body = body.map_err(body_error)?;
        let request = api::parse_chat(&body)?;
        let template = s.template.as_ref().ok_or_else(|| {
            ApiError::invalid("the model has no chat template; use /v1/completions", Some("messages"))
        })?;
        let messages: Vec<Message> = request
            .messages
            .iter()
            .map(|m| Message::new(&m.role, &m.text()))
            .collect();
        let text = template
            .render(&messages, true)
            .map_err(|e| ApiError::invalid(e.to_string(), Some("messages")))?;
        let prompt = s
            .tokenizer
            .encode(&text, true, false)
            .map_err(|e| ApiError::invalid(e.to_string(), Some("messages")))?;
        let job = Job {
            prompt,
            max_tokens: request.max_tokens(),
            default_max_tokens: None,
            logprobs: request.logprobs()?,
            request: request.sampling,
            chat: true,
        };
        run(&s, job).await
    };
    result.await.unwrap_or_else(|e| s.reject(e))
}

async fn completions(State(s): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    let result = async {
        let body = body.map_err(body_error)?;
        let request = api::parse_completion(&body)?;
        let one = |n: usize| {
            (n == 1)
                .then_some(())
                .ok_or_else(|| ApiError::invalid("exactly one prompt per request is supported", Some("prompt")))
        };
        let encode = |text: &str| {
            s.tokenizer
                .encode(text, true, true)
                .map_err(|e| ApiError::invalid(e.to_string(), Some("prompt")))
        };
        let prompt = match &request.prompt {
            api::Prompt::Text(t) => encode(t)?,
            api::Prompt::Texts(v) => one(v.len()).and_then(|_| encode(&v[0]))?,
            api::Prompt::Tokens(ids) => ids.clone(),
            api::Prompt::TokenLists(v) => one(v.len()).map(|_| v[0].clone())?,
        };
        let vocab = s.tokenizer.vocab_size() as u32;
        if let Some(bad) = prompt.iter().find(|&&id| id >= vocab) {
            return Err(ApiError::invalid(
                format!("token id {bad} is outside the vocabulary of {vocab}"),
                Some("prompt"),
            ));
        }
        let job = Job {
            prompt,
            max_tokens: request.max_tokens,
            default_max_tokens: Some(16),
            logprobs: request.logprobs()?,
            request: request.sampling,
            chat: false,
        };
        run(&s, job).await
    };
    result.await.unwrap_or_else(|e| s.reject(e))
}

impl AppState {
    fn reject(&self, e: ApiError) -> Response {
        self.metrics.count_request(&format!("rejected_{}", e.status.as_u16()));
        e.into_response()
    }
}

/// Delivers engine events into a tokio channel; closed when the handler or stream has gone.
struct ChannelSink(UnboundedSender<Event>);

impl EventSink for ChannelSink {
    fn send(&mut self, event: Event) -> bool {
        self.0.send(event).is_ok()
    }
    fn is_closed(&self) -> bool {
        self.0.is_closed()
    }
}

async fn run(s: &Arc<AppState>, job: Job) -> Result<Response, ApiError> {
    let context = s.engine.context();
    let prompt_len = job.prompt.len();
    if prompt_len == 0 {
        return Err(ApiError::invalid("the prompt is empty", Some("prompt")));
    }
    let room = context.saturating_sub(prompt_len);
    let max_tokens = match job.max_tokens {
        Some(n) if n < 1 => return Err(ApiError::invalid("max_tokens must be at least 1", Some("max_tokens"))),
        Some(n) => usize::try_from(n).unwrap_or(usize::MAX),
        None => job.default_max_tokens.unwrap_or(room).min(room).max(1),
    };
    if prompt_len + max_tokens > context {
        return Err(ApiError::invalid(
            format!(
                "This model's maximum context length is {context} tokens. However, you requested {} tokens \
                 ({prompt_len} in the prompt, {max_tokens} in the completion). Please reduce the prompt or max_tokens.",
                prompt_len.saturating_add(max_tokens)
            ),
            Some("max_tokens"),
        ));
    }
    let id = s.next_id.fetch_add(1, Ordering::Relaxed);
    let entropy = unix_time() ^ id.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let (tx, rx) = unbounded_channel();
    let stream = job.request.stream;
    let include_usage = job.request.stream_options.as_ref().is_some_and(|o| o.include_usage);
    s.engine
        .submit(Request {
            prompt: job.prompt,
            sampling: job.request.sampler(entropy),
            max_tokens,
            stop: job.request.stops(),
            logprobs: job.logprobs,
            ignore_eos: job.request.ignore_eos,
            sink: Box::new(ChannelSink(tx)),
        })
        .map_err(|e| match e {
            SubmitError::QueueFull(_) | SubmitError::ShuttingDown => {
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", e.to_string())
            }
            SubmitError::EmptyPrompt | SubmitError::TooLong { .. } => ApiError::invalid(e.to_string(), Some("prompt")),
        })?;
    let shape = Shape {
        id: format!("{}-{id}", if job.chat { "chatcmpl" } else { "cmpl" }),
        created: unix_time(),
        model: s.model_id.clone(),
        chat: job.chat,
        logprobs: job.logprobs.is_some(),
        tokenizer: s.tokenizer.clone(),
    };
    if stream {
        Ok(Sse::new(sse_stream(shape, rx, include_usage)).into_response())
    } else {
        whole(shape, rx).await.map(|v| Json(v).into_response())
    }
}

/// How responses of one request look: ids, object names, chat or text.
struct Shape {
    id: String,
    created: u64,
    model: String,
    chat: bool,
    logprobs: bool,
    tokenizer: Arc<Tokenizer>,
}

impl Shape {
    fn token_text(&self, id: u32) -> String {
        self.tokenizer.decode(&[id], false).unwrap_or_default()
    }

    /// One chat `logprobs.content` entry.
    fn chat_logprob(&self, id: u32, lp: &TokenLogprob) -> Value {
        let entry = |id: u32, logprob: f32| {
            let token = self.token_text(id);
            json!({"token": token, "logprob": logprob, "bytes": token.as_bytes()})
        };
        let mut e = entry(id, lp.logprob);
        e["top_logprobs"] = lp.top.iter().map(|&(t, l)| entry(t, l)).collect();
        e
    }

    fn envelope(&self, chunk: bool, choice: Value) -> Value {
        let object = match (self.chat, chunk) {
            (true, true) => "chat.completion.chunk",
            (true, false) => "chat.completion",
            (false, _) => "text_completion",
        };
        json!({"id": self.id, "object": object, "created": self.created, "model": self.model, "choices": [choice]})
    }
}

/// Token logprobs gathered in the completions endpoint's column layout.
#[derive(Default)]
struct TextLogprobs {
    tokens: Vec<String>,
    token_logprobs: Vec<f32>,
    top_logprobs: Vec<Value>,
    text_offset: Vec<usize>,
}

impl TextLogprobs {
    fn push(&mut self, shape: &Shape, id: u32, lp: &TokenLogprob, offset: usize) {
        self.tokens.push(shape.token_text(id));
        self.token_logprobs.push(lp.logprob);
        let top: serde_json::Map<String, Value> =
            lp.top.iter().map(|&(t, l)| (shape.token_text(t), json!(l))).collect();
        self.top_logprobs.push(Value::Object(top));
        self.text_offset.push(offset);
    }
    fn json(self) -> Value {
        json!({"tokens": self.tokens, "token_logprobs": self.token_logprobs,
               "top_logprobs": self.top_logprobs, "text_offset": self.text_offset})
    }
}

/// Gathers every event of a request into one response.
async fn whole(shape: Shape, mut rx: UnboundedReceiver<Event>) -> Result<Value, ApiError> {
    let mut text = String::new();
    let mut chat_lps = Vec::new();
    let mut text_lps = TextLogprobs::default();
    while let Some(event) = rx.recv().await {
        match event {
            Event::Token(t) => {
                if let Some(lp) = &t.logprob {
                    if shape.chat {
                        chat_lps.push(shape.chat_logprob(t.id, lp));
                    } else {
                        text_lps.push(&shape, t.id, lp, text.len());
                    }
                }
                text.push_str(&t.text);
            }
            Event::Done(c) => {
                let logprobs = match (shape.logprobs, shape.chat) {
                    (false, _) => Value::Null,
                    (true, true) => json!({"content": chat_lps}),
                    (true, false) => std::mem::take(&mut text_lps).json(),
                };
                let choice = if shape.chat {
                    json!({"index": 0, "message": {"role": "assistant", "content": text},
                           "logprobs": logprobs, "finish_reason": c.finish})
                } else {
                    json!({"index": 0, "text": text, "logprobs": logprobs, "finish_reason": c.finish})
                };
                let mut body = shape.envelope(false, choice);
                body["usage"] = json!(Usage::from(&c));
                return Ok(body);
            }
            Event::Error(e) => return Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", e)),
        }
    }
    Err(ApiError::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "server_error",
        "the engine dropped the request",
    ))
}

/// The request's events as server-sent events: a role chunk first (chat), a chunk per piece of
/// text, a final chunk with the finish reason, the usage if asked, then `[DONE]`.
fn sse_stream(
    shape: Shape,
    rx: UnboundedReceiver<Event>,
    include_usage: bool,
) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    let shape = Arc::new(shape);
    let data = |v: Value| Ok(SseEvent::default().data(v.to_string()));
    let opening = shape.chat.then(|| {
        data(shape.envelope(
            true,
            json!({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}),
        ))
    });
    let mut offset = 0usize;
    let events = tokio_stream::wrappers::UnboundedReceiverStream::new(rx).flat_map(move |event| {
        let chunks: Vec<Value> = match event {
            Event::Token(t) => {
                if t.text.is_empty() && t.logprob.is_none() {
                    Vec::new()
                } else {
                    let lp = t.logprob.as_ref();
                    let choice = if shape.chat {
                        let logprobs = lp.map_or(Value::Null, |lp| json!({"content": [shape.chat_logprob(t.id, lp)]}));
                        json!({"index": 0, "delta": {"content": t.text}, "logprobs": logprobs, "finish_reason": null})
                    } else {
                        let logprobs = lp.map_or(Value::Null, |lp| {
                            let mut l = TextLogprobs::default();
                            l.push(&shape, t.id, lp, offset);
                            l.json()
                        });
                        json!({"index": 0, "text": t.text, "logprobs": logprobs, "finish_reason": null})
                    };
                    offset += t.text.len();
                    vec![shape.envelope(true, choice)]
                }
            }
            Event::Done(c) => final_chunks(&shape, &c, include_usage),
            Event::Error(e) => vec![ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", e).body()],
        };
        stream::iter(chunks.into_iter().map(data))
    });
    stream::iter(opening)
        .chain(events)
        .chain(stream::once(async { Ok(SseEvent::default().data("[DONE]")) }))
}

fn final_chunks(shape: &Shape, c: &Completion, include_usage: bool) -> Vec<Value> {
    let choice = if shape.chat {
        json!({"index": 0, "delta": {}, "logprobs": null, "finish_reason": c.finish})
    } else {
        json!({"index": 0, "text": "", "logprobs": null, "finish_reason": c.finish})
    };
    let mut chunks = vec![shape.envelope(true, choice)];
    if include_usage {
        let mut usage = shape.envelope(true, Value::Null);
        usage["choices"] = json!([]);
        usage["usage"] = json!(Usage::from(c));
        chunks.push(usage);
    }
    chunks
}

/// Serves until `shutdown` resolves, then stops accepting, lets open requests finish, and
/// tells the engine to finish its work and stop.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<AppState>,
    limits: BodyLimits,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let engine = state.engine.clone();
    let app = router(state, limits);
    axum::serve(listener, app)
        .with_graceful_shutdown(async move {
            shutdown.await;
            engine.shut_down();
        })
        .await
}
