//! The OpenAI-compatible HTTP server: `POST /v1/chat/completions`, `POST /v1/completions`,
//! `GET /v1/models`, `POST /tokenize`, `POST /detokenize`, `GET /health`, `GET /metrics`, over
//! an [`EngineHandle`] whose scheduler runs on its own thread.
//!
//! Connections are accepted and bounded in [`connections`]; layers in front of the routes
//! decide who may call ([`callers`]), log each request and count refusals ([`request_log`]).
//! A request's body is read within a deadline, parsed ([`api`]) and tokenized on a blocking
//! thread, then submitted, once per choice (`n`); the events of every choice come back through
//! one channel, either gathered into one JSON response or streamed as server-sent events ending
//! with `data: [DONE]`. A client that goes away drops that channel, which the scheduler notices
//! at its next step: every choice's sequence is cancelled and its pages freed.

pub mod api;
pub mod callers;
pub mod connections;
pub mod fields;
pub mod metrics;
pub mod request_log;
pub mod tool_output;

use api::{ApiError, ToolChoice, Usage};
use axiom::chat::ChatTemplate;
use axiom::engine::scheduler::{
    Completion, EngineHandle, Event, EventSink, Request, SubmitError, TokenEvent, TokenLogprob,
};
use axiom::engine::ConstraintSpec;
use axiom::tokenizer::Tokenizer;
use axiom::tool_calls::ToolFormat;
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use callers::{BearerKey, CallerPolicy, JsonOnly, LoopbackHosts};
use connections::ConnectionLimits;
use futures_util::stream::{self, Stream, StreamExt};
use metrics::ServerMetrics;
use request_log::RequestRecord;
use serde_json::{json, Value};
use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc::{unbounded_channel, UnboundedSender};
use tokio::sync::Semaphore;
use tool_output::ToolOutput;
use tower_http::limit::RequestBodyLimitLayer;
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::validate_request::ValidateRequestHeaderLayer;

pub struct AppState {
    pub engine: EngineHandle,
    pub tokenizer: Arc<Tokenizer>,
    pub template: Option<ChatTemplate>,
    /// How the model writes tool calls (`--tool-parser`, or read from the template).
    pub tool_format: Option<ToolFormat>,
    /// The id `/v1/models` reports and responses carry.
    pub model_id: String,
    pub metrics: Arc<ServerMetrics>,
    /// A client that has not sent its whole body by then gets 408, so a stalled upload cannot
    /// hold a connection (or a graceful shutdown) open.
    pub read_timeout: Duration,
    /// Prompts rendered and tokenized at once, off the async runtime: a long prompt takes a
    /// blocking thread, and the engine keeps the rest of the cores.
    tokenizing: Semaphore,
    started: u64,
}

impl AppState {
    pub fn new(
        engine: EngineHandle,
        tokenizer: Arc<Tokenizer>,
        template: Option<ChatTemplate>,
        tool_format: Option<ToolFormat>,
        model_id: String,
        metrics: Arc<ServerMetrics>,
        read_timeout: Duration,
    ) -> AppState {
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        AppState {
            engine,
            tokenizer,
            template,
            tool_format,
            model_id,
            metrics,
            read_timeout,
            tokenizing: Semaphore::new((cores / 2).max(1)),
            started: unix_time(),
        }
    }
}

fn unix_time() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// How the server meets its clients: bodies, connections and who may call.
#[derive(Clone, Debug)]
pub struct ServerOptions {
    pub max_body_bytes: usize,
    pub connections: ConnectionLimits,
    pub callers: CallerPolicy,
}

/// The routes and every layer in front of them. `loopback`: the server listens on a loopback
/// address only, so requests must name a loopback host.
pub fn router(state: Arc<AppState>, options: &ServerOptions, loopback: bool) -> Result<Router, String> {
    let metrics = state.metrics.clone();
    let callers = &options.callers;
    let mut app = Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/health", get(health))
        .route("/metrics", get(prometheus_metrics))
        .with_state(state)
        // The limit layer refuses a declared oversize at once and bounds a streamed one.
        .layer(DefaultBodyLimit::disable())
        .layer(RequestBodyLimitLayer::new(options.max_body_bytes))
        .layer(ValidateRequestHeaderLayer::custom(JsonOnly));
    if let Some(key) = &callers.api_key {
        app = app.layer(ValidateRequestHeaderLayer::custom(BearerKey::new(
            key,
            callers.metrics_public,
        )));
    }
    if let Some(cors) = callers::cors(&callers.cors_origins)? {
        app = app.layer(cors);
    }
    if loopback {
        app = app.layer(ValidateRequestHeaderLayer::custom(LoopbackHosts::new(
            &callers.allowed_hosts,
        )));
    }
    Ok(app
        .layer(middleware::from_fn(openai_errors))
        .layer(middleware::from_fn_with_state(metrics, request_log::log_request))
        .layer(PropagateRequestIdLayer::x_request_id())
        .layer(SetRequestIdLayer::x_request_id(MakeRequestUuid)))
}

/// Error responses made by routing or a layer (404, 405, 413, ...) carry OpenAI's error object,
/// as the handlers' own do.
async fn openai_errors(request: axum::extract::Request, next: Next) -> Response {
    let (method, path) = (request.method().clone(), request.uri().path().to_owned());
    let response = next.run(request).await;
    let status = response.status();
    let is_json = response
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
    if !(status.is_client_error() || status.is_server_error()) || is_json {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    let text = axum::body::to_bytes(body, 4096).await.unwrap_or_default();
    let text = String::from_utf8_lossy(&text).trim().to_owned();
    let message = match status {
        StatusCode::NOT_FOUND => format!("unknown request URL: {method} {path}"),
        StatusCode::METHOD_NOT_ALLOWED => format!("method {method} is not allowed for {path}"),
        StatusCode::PAYLOAD_TOO_LARGE => "the request body is over the server's limit (--max-body-bytes)".into(),
        _ if !text.is_empty() => text,
        _ => status.canonical_reason().unwrap_or("error").to_lowercase(),
    };
    let kind = if status.is_server_error() {
        "server_error"
    } else {
        "invalid_request_error"
    };
    let error = ApiError::new(status, kind, message).into_response();
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.extend(error.headers().clone());
    Response::from_parts(parts, error.into_body())
}

/// `response` with `keep` dropped only once its body (a stream, maybe) has ended or been dropped.
fn hold_until_body_ends<T: Send + 'static>(response: Response, keep: T) -> Response {
    use http_body_util::BodyExt;
    response.map(|body| {
        Body::new(body.map_frame(move |frame| {
            let _ = &keep;
            frame
        }))
    })
}

/// The whole request body, within the read timeout and the body limit.
async fn read_body(body: Body, read_timeout: Duration) -> Result<Bytes, ApiError> {
    match tokio::time::timeout(read_timeout, axum::body::to_bytes(body, usize::MAX)).await {
        Ok(Ok(bytes)) => Ok(bytes),
        Ok(Err(e)) if is_length_limit(&e) => Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            "the request body is over the server's limit (--max-body-bytes)",
        )),
        Ok(Err(e)) => Err(ApiError::invalid(format!("reading the request body: {e}"), None)),
        Err(_) => Err(ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request_error",
            format!(
                "the request body was not received within {} s",
                read_timeout.as_secs_f64()
            ),
        )),
    }
}

fn is_length_limit(e: &axum::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(s) = source {
        if s.is::<http_body_util::LengthLimitError>() {
            return true;
        }
        source = s.source();
    }
    false
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

/// `POST /tokenize`: the ids, their count and the context length (with `with_pieces`, each id
/// with its text), for llama-server's and vLLM's clients alike.
async fn tokenize(State(s): State<Arc<AppState>>, body: Body) -> Result<Json<Value>, ApiError> {
    let body = read_body(body, s.read_timeout).await?;
    let (input, with_pieces) = api::parse_tokenize(&body)?;
    let ids = match input {
        api::TokenizeInput::Text {
            text,
            add_special,
            param,
        } => s.encode_text(text, add_special, param).await?,
        api::TokenizeInput::Chat {
            messages,
            tools,
            add_generation_prompt,
        } => s.chat_prompt(messages, tools, add_generation_prompt, false).await?,
    };
    let tokens: Vec<Value> = if with_pieces {
        let piece = |id: u32| s.tokenizer.decode(&[id], false).unwrap_or_default();
        ids.iter().map(|&id| json!({"id": id, "piece": piece(id)})).collect()
    } else {
        ids.iter().map(|&id| json!(id)).collect()
    };
    Ok(Json(
        json!({"tokens": tokens, "count": ids.len(), "max_model_len": s.engine.context()}),
    ))
}

/// `POST /detokenize`: the text of `tokens`, special tokens included, under llama-server's
/// name (`content`) and vLLM's (`prompt`).
async fn detokenize(State(s): State<Arc<AppState>>, body: Body) -> Result<Json<Value>, ApiError> {
    let body = read_body(body, s.read_timeout).await?;
    let ids = api::parse_detokenize(&body)?;
    let vocab = s.tokenizer.vocab_size() as u32;
    if let Some(bad) = ids.iter().find(|&&id| id >= vocab) {
        return Err(ApiError::invalid(
            format!("token id {bad} is outside the vocabulary of {vocab}"),
            Some("tokens"),
        ));
    }
    let text = s
        .tokenizer
        .decode(&ids, false)
        .map_err(|e| ApiError::invalid(e.to_string(), Some("tokens")))?;
    Ok(Json(json!({"content": text, "prompt": text})))
}

async fn prometheus_metrics(State(s): State<Arc<AppState>>) -> Response {
    let text = s.metrics.render(s.engine.status());
    ([("content-type", "text/plain; version=0.0.4")], text).into_response()
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
    /// The format of tool calls to read out of a chat's output; none: all text is content.
    tool_format: Option<ToolFormat>,
    parallel_tool_calls: bool,
    /// The output's constraint, and the field that asked for it.
    constraint: Option<(ConstraintSpec, &'static str)>,
}

impl AppState {
    /// Refuses, before any tokenizing, text that could not fit the context however it encodes.
    fn check_fits(&self, bytes: usize, param: &'static str) -> Result<(), ApiError> {
        let context = self.engine.context();
        let least = self.tokenizer.min_tokens(bytes);
        if least > context {
            return Err(ApiError::invalid(
                format!(
                    "This model's maximum context length is {context} tokens, and a prompt of {bytes} bytes \
                     is at least {least} tokens. Please reduce the prompt."
                ),
                Some(param),
            ));
        }
        Ok(())
    }

    /// The tool-call format to read from a chat's output: none unless tools are offered with
    /// `tool_choice` other than none.
    fn tool_format_for(&self, request: &api::ChatRequest) -> Result<Option<ToolFormat>, ApiError> {
        let choice = request.tool_choice();
        if request.tools().is_empty() {
            return Ok(None);
        }
        match (choice, self.tool_format) {
            (ToolChoice::None, _) => Ok(None),
            // A forced call is one `{"name", "arguments"}` object (engine::tool_choice), which
            // the Llama 3 JSON reader takes, whatever format the model would use unforced.
            (ToolChoice::Required | ToolChoice::Function(_), _) => Ok(Some(ToolFormat::Llama3Json)),
            (ToolChoice::Auto, Some(format)) => Ok(Some(format)),
            (ToolChoice::Auto, None) => Err(ApiError::invalid(
                "the format of this model's tool calls is not known from its chat template; \
                 start the server with --tool-parser",
                Some("tools"),
            )),
        }
    }

    /// The ids of `messages` and `tools` rendered by the chat template. A template that takes
    /// no tools is refused them, unless `forced` (a grammar will force a call): then a system
    /// message describes them.
    async fn chat_prompt(
        self: &Arc<Self>,
        mut messages: Vec<axiom::chat::Message>,
        mut tools: Vec<Value>,
        add_generation_prompt: bool,
        forced: bool,
    ) -> Result<Vec<u32>, ApiError> {
        if !tools.is_empty() && !self.template.as_ref().is_some_and(ChatTemplate::takes_tools) {
            if !forced {
                return Err(ApiError::invalid(
                    "this model's chat template does not take tools (tool_choice required or a \
                     named function still works: a grammar forces the call)",
                    Some("tools"),
                ));
            }
            describe_tools(&mut messages, &std::mem::take(&mut tools));
        }
        let tools_text = serde_json::to_string(&tools).unwrap_or_default();
        self.check_fits(
            messages.iter().map(|m| m.content.len()).sum::<usize>() + tools_text.len(),
            "messages",
        )?;
        let state = self.clone();
        self.tokenize(move || {
            let template = state.template.as_ref().ok_or_else(|| {
                ApiError::invalid("the model has no chat template; use /v1/completions", Some("messages"))
            })?;
            // Tool definitions and calls are written by the template as its own text, where
            // special tokens count: they must hold none.
            let forged = |text: &str, param: &str| {
                state.tokenizer.special_token_in(text).map_or(Ok(()), |token| {
                    Err(ApiError::invalid(
                        format!("{param} holds the special token {token:?}"),
                        Some(param),
                    ))
                })
            };
            forged(&tools_text, "tools")?;
            for (i, m) in messages.iter().enumerate() {
                let calls = serde_json::to_string(&m.tool_calls).unwrap_or_default();
                forged(&calls, &format!("messages[{i}].tool_calls"))?;
                forged(m.name.as_deref().unwrap_or(""), &format!("messages[{i}].name"))?;
            }
            let rendered = template
                .render_chat_with_tools(&messages, &tools, add_generation_prompt)
                .map_err(|e| ApiError::invalid(e.to_string(), Some("messages")))?;
            state
                .tokenizer
                .encode_chat(&rendered)
                .map_err(|e| ApiError::invalid(e.to_string(), Some("messages")))
        })
        .await
    }

    /// A completion prompt's ids, BOS first where the model wants it.
    async fn encode_prompt(&self, text: String) -> Result<Vec<u32>, ApiError> {
        self.encode_text(text, true, "prompt").await
    }

    async fn encode_text(&self, text: String, add_bos: bool, param: &'static str) -> Result<Vec<u32>, ApiError> {
        self.check_fits(text.len(), param)?;
        let tokenizer = self.tokenizer.clone();
        self.tokenize(move || {
            tokenizer
                .encode(&text, true, add_bos)
                .map_err(|e| ApiError::invalid(e.to_string(), Some(param)))
        })
        .await
    }

    /// Runs `work` (tokenizing) on a blocking thread, a few at a time.
    async fn tokenize<T: Send + 'static>(
        &self,
        work: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
    ) -> Result<T, ApiError> {
        let _turn = self.tokenizing.acquire().await.map_err(|_| shutting_down())?;
        tokio::task::spawn_blocking(work).await.map_err(|e| {
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                format!("tokenizing failed: {e}"),
            )
        })?
    }
}

fn shutting_down() -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "server_error",
        "the server is shutting down",
    )
}

async fn chat_completions(
    State(s): State<Arc<AppState>>,
    Extension(record): Extension<Arc<RequestRecord>>,
    body: Body,
) -> Result<Response, ApiError> {
    let body = read_body(body, s.read_timeout).await?;
    let request = api::parse_chat(&body)?;
    if let Some(user) = &request.sampling.user {
        record.user(user);
    }
    let logprobs = request.logprobs()?;
    let constraint = request.constraint()?;
    let forced = request.tool_choice().forces_a_call();
    let prompt = s
        .chat_prompt(request.template_messages()?, request.tools().to_vec(), true, forced)
        .await?;
    let format = s.tool_format_for(&request)?;
    let job = Job {
        prompt,
        max_tokens: request.max_tokens(),
        default_max_tokens: None,
        logprobs,
        tool_format: format,
        parallel_tool_calls: request.parallel_tool_calls.unwrap_or(true),
        constraint,
        request: request.sampling,
        chat: true,
    };
    run(&s, job, record).await
}

async fn completions(
    State(s): State<Arc<AppState>>,
    Extension(record): Extension<Arc<RequestRecord>>,
    body: Body,
) -> Result<Response, ApiError> {
    let body = read_body(body, s.read_timeout).await?;
    let request = api::parse_completion(&body)?;
    if let Some(user) = &request.sampling.user {
        record.user(user);
    }
    let logprobs = request.logprobs()?;
    let only = |n: usize| {
        (n == 1)
            .then_some(())
            .ok_or_else(|| ApiError::invalid("exactly one prompt per request is supported", Some("prompt")))
    };
    let prompt = match request.prompt {
        api::Prompt::Text(text) => s.encode_prompt(text).await?,
        api::Prompt::Texts(texts) => {
            only(texts.len())?;
            s.encode_prompt(texts.concat()).await?
        }
        api::Prompt::Tokens(ids) => ids,
        api::Prompt::TokenLists(lists) => {
            only(lists.len())?;
            lists.concat()
        }
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
        logprobs,
        constraint: request.sampling.constraint()?,
        request: request.sampling,
        chat: false,
        tool_format: None,
        parallel_tool_calls: true,
    };
    run(&s, job, record).await
}

/// Tells a model whose chat template takes no tools what `tools` it may call, in a system message
/// (the first one, or a new one before the others), and how a call is written.
fn describe_tools(messages: &mut Vec<axiom::chat::Message>, tools: &[Value]) {
    let functions: Vec<&Value> = tools.iter().map(|tool| &tool["function"]).collect();
    let text = format!(
        "You can call these functions, given as JSON:\n{}\nTo call one, answer with a JSON object \
         {{\"name\": the function's name, \"arguments\": an object of its arguments}}.",
        serde_json::to_string_pretty(&functions).unwrap_or_default()
    );
    match messages.first_mut() {
        Some(first) if first.role == "system" => first.content = format!("{}\n\n{text}", first.content),
        _ => messages.insert(0, axiom::chat::Message::new("system", &text)),
    }
}

/// The answer to a request the engine did not accept; `constraint_field` names the field that
/// asked for its constraint.
fn refusal(e: SubmitError, constraint_field: Option<&'static str>) -> ApiError {
    match e {
        SubmitError::QueueFull(_) | SubmitError::ShuttingDown => {
            ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", e.to_string())
        }
        SubmitError::EmptyPrompt | SubmitError::TooLong { .. } => ApiError::invalid(e.to_string(), Some("prompt")),
        SubmitError::OutOfVocabulary { field, .. } => ApiError::invalid(e.to_string(), Some(field)),
        SubmitError::Constraint(_) => ApiError::invalid(e.to_string(), constraint_field),
    }
}

/// Delivers one choice's engine events, with the choice's index, into the request's tokio
/// channel; closed when the handler or stream has gone, which cancels every choice.
struct ChannelSink {
    tx: UnboundedSender<(usize, Event)>,
    choice: usize,
}

impl EventSink for ChannelSink {
    fn send(&mut self, event: Event) -> bool {
        self.tx.send((self.choice, event)).is_ok()
    }
    fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }
}

impl AppState {
    /// Hands one choice's request to the engine; `constraint_field` names the field of its
    /// constraint in a refusal.
    async fn submit(&self, request: Request, constraint_field: Option<&'static str>) -> Result<(), ApiError> {
        if request.constraint.is_some() {
            // Compiling a schema or grammar takes CPU time: off the async threads, as tokenizing is.
            let engine = self.engine.clone();
            self.tokenize(move || engine.submit(request).map_err(|e| refusal(e, constraint_field)))
                .await
        } else {
            self.engine.submit(request).map_err(|e| refusal(e, constraint_field))
        }
    }
}

fn engine_error(message: impl Into<String>) -> ApiError {
    ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
}

async fn run(s: &Arc<AppState>, job: Job, record: Arc<RequestRecord>) -> Result<Response, ApiError> {
    let context = s.engine.context();
    let prompt_len = job.prompt.len();
    record.prompt(prompt_len);
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
    let choices = job.request.choices();
    // The choices after the first are queued together.
    let max_queue = s.engine.max_queue();
    if choices - 1 > max_queue {
        return Err(ApiError::invalid(
            format!("n = {choices} is more choices than this server's queue (--max-queue {max_queue}) takes at once"),
            Some("n"),
        ));
    }
    // Random, so ids stay unique across restarts and seeds differ between requests.
    let id = uuid::Uuid::new_v4();
    let (tx, mut rx) = unbounded_channel();
    let include_usage = job.request.stream_options.as_ref().is_some_and(|o| o.include_usage);
    let (constraint, constraint_field) = job.constraint.unzip();
    let sampling = job.request.sampler(id.as_u64_pair().0);
    let request = |choice: usize| Request {
        prompt: job.prompt.clone(),
        sampling: axiom::engine::SamplerConfig {
            seed: api::choice_seed(sampling.seed, choice),
            ..sampling.clone()
        },
        max_tokens,
        stop: job.request.stops(),
        stop_token_ids: job.request.stop_token_ids.clone().unwrap_or_default(),
        constraint: constraint.clone(),
        logprobs: job.logprobs,
        ignore_eos: job.request.ignore_eos,
        sink: Box::new(ChannelSink { tx: tx.clone(), choice }),
    };
    s.submit(request(0), constraint_field).await?;
    let mut first = None;
    if choices > 1 {
        // The first choice's first event comes once its prompt is computed and the prompt's full
        // pages are in the prefix cache (the scheduler indexes them before it takes new
        // requests), so the others, submitted now, share those pages and compute only the rest.
        match rx.recv().await {
            Some((_, Event::Error(e))) => {
                record.failed();
                return Err(engine_error(e));
            }
            Some(event) => first = Some(event),
            None => return Err(engine_error("the engine dropped the request")),
        }
        for choice in 1..choices {
            s.submit(request(choice), constraint_field).await?;
        }
    }
    // The channel closes once every choice's sink is gone.
    drop(tx);
    let events = stream::iter(first).chain(tokio_stream::wrappers::UnboundedReceiverStream::new(rx));
    let shape = Shape {
        tool_format: job.tool_format,
        parallel_tool_calls: job.parallel_tool_calls,
        choices,
        id: format!("{}-{}", if job.chat { "chatcmpl" } else { "cmpl" }, id.simple()),
        created: unix_time(),
        model: s.model_id.clone(),
        chat: job.chat,
        logprobs: job.logprobs.is_some(),
        tokenizer: s.tokenizer.clone(),
        record,
    };
    if job.request.stream {
        Ok(Sse::new(sse_stream(shape, events, include_usage)).into_response())
    } else {
        whole(shape, events).await.map(|v| Json(v).into_response())
    }
}

/// How responses of one request look: ids, object names, chat or text, how many choices.
struct Shape {
    /// The format of tool calls to read out of each choice's text.
    tool_format: Option<ToolFormat>,
    parallel_tool_calls: bool,
    choices: usize,
    id: String,
    created: u64,
    model: String,
    chat: bool,
    logprobs: bool,
    tokenizer: Arc<Tokenizer>,
    /// What the access log says of the request.
    record: Arc<RequestRecord>,
}

impl Shape {
    fn token_text(&self, id: u32) -> String {
        self.tokenizer.decode(&[id], false).unwrap_or_default()
    }

    /// Content and tool calls out of one choice's text.
    fn tool_output(&self) -> ToolOutput {
        ToolOutput::new(self.tool_format, self.parallel_tool_calls)
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

    fn envelope(&self, chunk: bool, choices: Vec<Value>) -> Value {
        let object = match (self.chat, chunk) {
            (true, true) => "chat.completion.chunk",
            (true, false) => "chat.completion",
            (false, _) => "text_completion",
        };
        json!({"id": self.id, "object": object, "created": self.created, "model": self.model, "choices": choices})
    }

    /// A streamed chunk of one choice.
    fn chunk(&self, choice: Value) -> Value {
        self.envelope(true, vec![choice])
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

/// One choice's output gathered for a whole response.
struct Gathered {
    tools: ToolOutput,
    text: String,
    content: String,
    calls: Vec<Value>,
    chat_logprobs: Vec<Value>,
    text_logprobs: TextLogprobs,
    done: Option<Completion>,
}

impl Gathered {
    fn new(shape: &Shape) -> Gathered {
        Gathered {
            tools: shape.tool_output(),
            text: String::new(),
            content: String::new(),
            calls: Vec::new(),
            chat_logprobs: Vec::new(),
            text_logprobs: TextLogprobs::default(),
            done: None,
        }
    }

    fn token(&mut self, shape: &Shape, t: &TokenEvent) {
        if let Some(lp) = &t.logprob {
            if shape.chat {
                self.chat_logprobs.push(shape.chat_logprob(t.id, lp));
            } else {
                self.text_logprobs.push(shape, t.id, lp, self.text.len());
            }
        }
        self.text.push_str(&t.text);
        let split = self.tools.push(&t.text);
        self.take(split);
    }

    fn take(&mut self, split: tool_output::Split) {
        self.content.push_str(&split.content);
        self.calls.extend(split.calls.into_iter().map(|(_, call)| call));
    }

    fn done(&mut self, c: Completion) {
        let split = self.tools.finish();
        self.take(split);
        self.done = Some(c);
    }

    /// The response's choice `index`, once done.
    fn choice(self, shape: &Shape, index: usize, c: &Completion) -> Value {
        let finish = self.tools.finish_reason(c);
        let logprobs = match (shape.logprobs, shape.chat) {
            (false, _) => Value::Null,
            (true, true) => json!({"content": self.chat_logprobs}),
            (true, false) => self.text_logprobs.json(),
        };
        if shape.chat {
            let mut message = json!({"role": "assistant", "content": self.content});
            if !self.calls.is_empty() {
                message["tool_calls"] = json!(self.calls);
                if self.content.is_empty() {
                    message["content"] = Value::Null;
                }
            }
            json!({"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish})
        } else {
            json!({"index": index, "text": self.text, "logprobs": logprobs, "finish_reason": finish})
        }
    }
}

/// Gathers every event of a request's choices into one response.
async fn whole(shape: Shape, mut events: impl Stream<Item = (usize, Event)> + Unpin) -> Result<Value, ApiError> {
    let mut gathered: Vec<Gathered> = (0..shape.choices).map(|_| Gathered::new(&shape)).collect();
    let mut open = shape.choices;
    while open > 0 {
        let Some((i, event)) = events.next().await else { break };
        let Some(choice) = gathered.get_mut(i) else { continue };
        match event {
            Event::Token(t) => {
                shape.record.token();
                choice.token(&shape, &t);
            }
            Event::Done(c) => {
                shape.record.done(&c);
                choice.done(c);
                open -= 1;
            }
            Event::Error(e) => {
                shape.record.failed();
                return Err(engine_error(e));
            }
        }
    }
    let mut choices = Vec::new();
    let mut completions = Vec::new();
    for (index, mut choice) in gathered.into_iter().enumerate() {
        let c = choice
            .done
            .take()
            .ok_or_else(|| engine_error("the engine dropped the request"))?;
        choices.push(choice.choice(&shape, index, &c));
        completions.push(c);
    }
    let mut body = shape.envelope(false, choices);
    body["usage"] = json!(Usage::of(&completions));
    Ok(body)
}

/// One choice's state while it streams.
struct Streamed {
    tools: ToolOutput,
    /// Bytes of text sent so far (completions' logprob offsets).
    offset: usize,
}

/// The request's events as server-sent events: a role chunk per choice first (chat), a chunk
/// per piece of a choice's text, a final chunk per choice with its finish reason, the usage of
/// all choices if asked, then `[DONE]`.
fn sse_stream(
    shape: Shape,
    events: impl Stream<Item = (usize, Event)> + Send + 'static,
    include_usage: bool,
) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    let shape = Arc::new(shape);
    let data = |v: Value| Ok(SseEvent::default().data(v.to_string()));
    let openings: Vec<_> = (0..shape.choices)
        .filter(|_| shape.chat)
        .map(|index| {
            data(shape.chunk(
                json!({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}),
            ))
        })
        .collect();
    let mut streamed: Vec<Streamed> = (0..shape.choices)
        .map(|_| Streamed {
            tools: shape.tool_output(),
            offset: 0,
        })
        .collect();
    let mut completions = Vec::new();
    let events = events.flat_map(move |(index, event)| {
        let chunks: Vec<Value> = match (streamed.get_mut(index), event) {
            (None, _) => Vec::new(),
            (Some(choice), Event::Token(t)) => {
                shape.record.token();
                let split = choice.tools.push(&t.text);
                let mut chunks = Vec::new();
                if !(split.content.is_empty() && t.logprob.is_none()) {
                    let lp = t.logprob.as_ref();
                    let delta = if shape.chat {
                        let logprobs = lp.map_or(Value::Null, |lp| json!({"content": [shape.chat_logprob(t.id, lp)]}));
                        json!({"index": index, "delta": {"content": split.content}, "logprobs": logprobs, "finish_reason": null})
                    } else {
                        let logprobs = lp.map_or(Value::Null, |lp| {
                            let mut l = TextLogprobs::default();
                            l.push(&shape, t.id, lp, choice.offset);
                            l.json()
                        });
                        json!({"index": index, "text": t.text, "logprobs": logprobs, "finish_reason": null})
                    };
                    choice.offset += t.text.len();
                    chunks.push(shape.chunk(delta));
                }
                chunks.extend(call_chunks(&shape, index, split.calls));
                chunks
            }
            (Some(choice), Event::Done(c)) => {
                shape.record.done(&c);
                let split = choice.tools.finish();
                let mut chunks = Vec::new();
                if !split.content.is_empty() {
                    chunks.push(shape.chunk(
                        json!({"index": index, "delta": {"content": split.content}, "logprobs": null, "finish_reason": null}),
                    ));
                }
                chunks.extend(call_chunks(&shape, index, split.calls));
                chunks.push(finish_chunk(&shape, index, choice.tools.finish_reason(&c)));
                completions.push(c);
                if include_usage && completions.len() == shape.choices {
                    let mut usage = shape.envelope(true, Vec::new());
                    usage["usage"] = json!(Usage::of(&completions));
                    chunks.push(usage);
                }
                chunks
            }
            (Some(_), Event::Error(e)) => {
                shape.record.failed();
                vec![engine_error(e).body()]
            }
        };
        stream::iter(chunks.into_iter().map(data))
    });
    stream::iter(openings)
        .chain(events)
        .chain(stream::once(async { Ok(SseEvent::default().data("[DONE]")) }))
}

/// One chunk per tool call of choice `choice`, whole: OpenAI's delta shape, with the call's
/// index in the choice.
fn call_chunks(shape: &Shape, choice: usize, calls: Vec<(usize, Value)>) -> Vec<Value> {
    calls
        .into_iter()
        .map(|(index, mut call)| {
            call["index"] = json!(index);
            shape.chunk(
                json!({"index": choice, "delta": {"tool_calls": [call]}, "logprobs": null, "finish_reason": null}),
            )
        })
        .collect()
}

fn finish_chunk(shape: &Shape, index: usize, finish: &str) -> Value {
    shape.chunk(if shape.chat {
        json!({"index": index, "delta": {}, "logprobs": null, "finish_reason": finish})
    } else {
        json!({"index": index, "text": "", "logprobs": null, "finish_reason": finish})
    })
}

/// Serves until `shutdown` resolves, then stops accepting, lets open requests finish (within
/// the shutdown timeout), and tells the engine to finish its work and stop.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<AppState>,
    options: &ServerOptions,
    shutdown: impl std::future::Future<Output = ()>,
) -> std::io::Result<()> {
    let loopback = listener.local_addr()?.ip().is_loopback();
    let engine = state.engine.clone();
    let metrics = state.metrics.clone();
    let app = router(state, options, loopback).map_err(std::io::Error::other)?;
    connections::serve(listener, app, options.connections, metrics, async move {
        shutdown.await;
        engine.shut_down();
    })
    .await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use axiom::engine::scheduler::FinishReason;

    fn shape(tool_format: Option<ToolFormat>, choices: usize) -> Shape {
        let fixture = concat!(env!("CARGO_MANIFEST_DIR"), "/../axiom/tests/fixtures/hf/qwen2");
        Shape {
            tool_format,
            parallel_tool_calls: true,
            choices,
            id: "chatcmpl-test".into(),
            created: 0,
            model: "m".into(),
            chat: true,
            logprobs: false,
            tokenizer: Arc::new(Tokenizer::from_hf_dir(std::path::Path::new(fixture)).unwrap()),
            record: Arc::new(RequestRecord::default()),
        }
    }

    fn token(text: &str) -> Event {
        Event::Token(TokenEvent {
            id: 0,
            text: text.into(),
            logprob: None,
        })
    }

    fn done(prompt_tokens: usize, completion_tokens: usize, cached_tokens: usize) -> Event {
        Event::Done(Completion {
            finish: FinishReason::Stop,
            prompt_tokens,
            completion_tokens,
            cached_tokens,
        })
    }

    /// Choice `choice` of a Qwen-style answer that calls a tool, in the pieces the engine hands on.
    fn tool_call_events(choice: usize) -> Vec<(usize, Event)> {
        let pieces = [
            "Let me look.",
            "\n<tool_",
            "call>\n{\"name\": \"get_weather\", ",
            "\"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
        ];
        let mut events: Vec<(usize, Event)> = pieces.iter().map(|text| (choice, token(text))).collect();
        events.push((choice, done(5, 4, 0)));
        events
    }

    async fn streamed_chunks(shape: Shape, events: Vec<(usize, Event)>, include_usage: bool) -> Vec<Value> {
        let response = Sse::new(sse_stream(shape, stream::iter(events), include_usage)).into_response();
        let bytes = axum::body::to_bytes(response.into_body(), usize::MAX).await.unwrap();
        let text = String::from_utf8(bytes.to_vec()).unwrap();
        let data: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
        assert_eq!(data.iter().filter(|d| **d == "[DONE]").count(), 1);
        assert_eq!(data.last(), Some(&"[DONE]"));
        data[..data.len() - 1]
            .iter()
            .map(|d| serde_json::from_str(d).unwrap())
            .collect()
    }

    #[tokio::test]
    async fn tool_calls_come_back_whole_and_streamed() {
        let body = whole(shape(Some(ToolFormat::Hermes), 1), stream::iter(tool_call_events(0)))
            .await
            .unwrap();
        let choice = &body["choices"][0];
        assert_eq!(choice["finish_reason"], "tool_calls");
        assert_eq!(choice["message"]["content"], "Let me look.\n");
        let call = &choice["message"]["tool_calls"][0];
        assert_eq!(
            call["function"],
            json!({"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"})
        );
        assert!(call["id"].as_str().unwrap().starts_with("call_"));

        let chunks = streamed_chunks(shape(Some(ToolFormat::Hermes), 1), tool_call_events(0), false).await;
        let deltas: Vec<&Value> = chunks.iter().map(|c| &c["choices"][0]["delta"]).collect();
        let content: String = deltas.iter().filter_map(|d| d["content"].as_str()).collect();
        assert_eq!(content, "Let me look.\n");
        let calls: Vec<&Value> = deltas.iter().filter_map(|d| d.get("tool_calls")).collect();
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0][0]["index"], 0);
        assert_eq!(calls[0][0]["function"]["name"], "get_weather");
        assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "tool_calls");

        // Without a parser (tool_choice none) the same output is content.
        let body = whole(shape(None, 1), stream::iter(tool_call_events(0))).await.unwrap();
        assert_eq!(body["choices"][0]["finish_reason"], "stop");
        assert!(body["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .contains("<tool_call>"));
    }

    /// Two choices whose events interleave: choice 1 calls a tool, choice 0 answers in text.
    fn two_choices() -> Vec<(usize, Event)> {
        let mut calls = tool_call_events(1).into_iter();
        let mut events = vec![(0, token("It is "))];
        events.extend(calls.by_ref().take(2));
        events.push((0, token("sunny.")));
        events.push((0, done(5, 2, 0)));
        events.extend(calls);
        events
    }

    #[tokio::test]
    async fn choices_come_back_each_with_its_index_and_usage_counts_the_prompt_once() {
        let body = whole(shape(Some(ToolFormat::Hermes), 2), stream::iter(two_choices()))
            .await
            .unwrap();
        let choices = body["choices"].as_array().unwrap();
        assert_eq!(choices.len(), 2);
        assert_eq!((&choices[0]["index"], &choices[1]["index"]), (&json!(0), &json!(1)));
        assert_eq!(choices[0]["message"]["content"], "It is sunny.");
        assert_eq!(choices[0]["finish_reason"], "stop");
        assert_eq!(choices[1]["finish_reason"], "tool_calls");
        assert_eq!(
            choices[1]["message"]["tool_calls"][0]["function"]["name"],
            "get_weather"
        );
        assert_eq!(
            body["usage"],
            json!({"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11,
                   "prompt_tokens_details": {"cached_tokens": 0}})
        );

        let chunks = streamed_chunks(shape(Some(ToolFormat::Hermes), 2), two_choices(), true).await;
        let of = |index: usize| -> Vec<&Value> {
            chunks
                .iter()
                .filter_map(|c| c["choices"].get(0))
                .filter(|c| c["index"] == index)
                .collect()
        };
        let content: String = of(0).iter().filter_map(|c| c["delta"]["content"].as_str()).collect();
        assert_eq!(content, "It is sunny.");
        let roles = |index| of(index).iter().filter(|c| c["delta"]["role"] == "assistant").count();
        assert_eq!((roles(0), roles(1)), (1, 1));
        let finishes = |index| -> Vec<Value> {
            of(index)
                .iter()
                .map(|c| c["finish_reason"].clone())
                .filter(|f| !f.is_null())
                .collect()
        };
        assert_eq!(finishes(0), vec![json!("stop")]);
        assert_eq!(finishes(1), vec![json!("tool_calls")]);
        // The usage comes once, last, after both choices finished.
        let usage: Vec<&Value> = chunks.iter().filter(|c| !c["usage"].is_null()).collect();
        assert_eq!(usage.len(), 1);
        assert_eq!(usage[0]["usage"]["completion_tokens"], 6);
        assert_eq!(chunks.last().unwrap()["choices"], json!([]));
    }

    #[tokio::test]
    async fn a_choice_that_never_finishes_is_an_error() {
        let events = vec![(0, token("a")), (0, done(5, 1, 0))];
        let e = whole(shape(None, 2), stream::iter(events)).await.unwrap_err();
        assert_eq!(e.status, StatusCode::INTERNAL_SERVER_ERROR);
    }
}
