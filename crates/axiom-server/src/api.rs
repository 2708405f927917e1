//! The OpenAI request and response shapes, and the checks that turn a request body into work
//! for the engine. Everything here is a pure function of its input (the fuzz target calls
//! [`parse_chat`] and [`parse_completion`] directly).

use crate::fields::{self, Endpoints};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// An error as OpenAI's API reports it: a status and `{"error": {...}}`.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    /// The request field at fault, as OpenAI names it (`messages[2].content`).
    pub param: Option<String>,
}

impl ApiError {
    pub fn invalid(message: impl Into<String>, param: Option<&str>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.map(str::to_owned),
        }
    }

    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
        }
    }

    pub fn body(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": null}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            response
                .headers_mut()
                .insert("retry-after", axum::http::HeaderValue::from_static("1"));
        }
        response
    }
}

/// `stop`: one string or a list.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

/// Sampling fields shared by both endpoints.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Sampling {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    #[serde(alias = "repeat_penalty")]
    pub repetition_penalty: Option<f32>,
    pub seed: Option<i64>,
    pub stop: Option<Stop>,
    pub n: Option<u32>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    /// Generate through end-of-generation tokens (for benchmarks), as vLLM's extension does.
    #[serde(default)]
    pub ignore_eos: bool,
    /// The caller's end user, written to the access log.
    pub user: Option<String>,
    /// Only the one tier there is (`auto` or `default`).
    pub service_tier: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// Message content: a string, or a list of parts of which only text is understood.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Clone, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: Option<Content>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    pub model: Option<String>,
    pub messages: Vec<ChatMessage>,
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    #[serde(default)]
    pub logprobs: bool,
    pub top_logprobs: Option<i64>,
    /// Completions are never stored; only `false` is accepted.
    #[serde(default)]
    pub store: bool,
    /// Output kinds: only `["text"]`.
    pub modalities: Option<Vec<String>>,
    #[serde(flatten)]
    pub sampling: Sampling,
}

/// `prompt`: text, or token ids, or a list of one of either.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
    Texts(Vec<String>),
    TokenLists(Vec<Vec<u32>>),
}

#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    pub model: Option<String>,
    pub prompt: Prompt,
    pub max_tokens: Option<i64>,
    pub logprobs: Option<i64>,
    #[serde(default)]
    pub echo: bool,
    pub suffix: Option<String>,
    pub best_of: Option<u32>,
    #[serde(flatten)]
    pub sampling: Sampling,
}

/// Most alternatives `top_logprobs` (chat) may ask for, as OpenAI allows.
pub const MAX_TOP_LOGPROBS: usize = 20;
/// Most alternatives `logprobs` (completions) may ask for.
pub const MAX_COMPLETION_LOGPROBS: usize = 5;
/// Most stop strings, as OpenAI allows.
pub const MAX_STOPS: usize = 4;

/// The body as `T`, once every field in it is known to [`fields`].
fn parse<T: serde::de::DeserializeOwned>(body: &[u8], endpoint: Endpoints) -> Result<T, ApiError> {
    let mut value: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid(format!("the body is not valid JSON: {e}"), None))?;
    fields::check(&mut value, endpoint)?;
    serde_json::from_value(value)
        .map_err(|e| ApiError::invalid(format!("the request does not match the schema: {e}"), None))
}

pub fn parse_chat(body: &[u8]) -> Result<ChatRequest, ApiError> {
    let request: ChatRequest = parse(body, Endpoints::Chat)?;
    if request.messages.is_empty() {
        return Err(ApiError::invalid("messages must not be empty", Some("messages")));
    }
    for m in &request.messages {
        if !matches!(m.role.as_str(), "system" | "user" | "assistant" | "developer" | "tool") {
            return Err(ApiError::invalid(
                format!("unknown role {:?}", m.role),
                Some("messages"),
            ));
        }
        if let Some(Content::Parts(parts)) = &m.content {
            if let Some(p) = parts.iter().find(|p| p.kind != "text" || p.text.is_none()) {
                return Err(ApiError::invalid(
                    format!("content parts of type {:?} are not supported (only text)", p.kind),
                    Some("messages"),
                ));
            }
        }
    }
    if request.store {
        return Err(ApiError::invalid(
            "store: this server does not keep completions",
            Some("store"),
        ));
    }
    if request
        .modalities
        .as_ref()
        .is_some_and(|m| m.iter().any(|m| m != "text"))
    {
        return Err(ApiError::invalid(
            "only the text modality is supported",
            Some("modalities"),
        ));
    }
    if request.top_logprobs.is_some() && !request.logprobs {
        return Err(ApiError::invalid(
            "top_logprobs needs logprobs to be true",
            Some("top_logprobs"),
        ));
    }
    request.sampling.check()?;
    Ok(request)
}

pub fn parse_completion(body: &[u8]) -> Result<CompletionRequest, ApiError> {
    let request: CompletionRequest = parse(body, Endpoints::Completions)?;
    if request.echo {
        return Err(ApiError::invalid("echo is not supported", Some("echo")));
    }
    if request.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid("suffix is not supported", Some("suffix")));
    }
    if request.best_of.is_some_and(|n| n != 1) {
        return Err(ApiError::invalid(
            "only best_of = 1 is supported (the engine does not fork sequences)",
            Some("best_of"),
        ));
    }
    request.sampling.check()?;
    Ok(request)
}

impl ChatMessage {
    pub fn text(&self) -> String {
        match &self.content {
            None => String::new(),
            Some(Content::Text(t)) => t.clone(),
            Some(Content::Parts(parts)) => parts.iter().filter_map(|p| p.text.as_deref()).collect(),
        }
    }
}

impl ChatRequest {
    /// The requested alternatives per token, if log-probabilities are wanted.
    pub fn logprobs(&self) -> Result<Option<usize>, ApiError> {
        if !self.logprobs {
            return Ok(None);
        }
        let top = self.top_logprobs.unwrap_or(0);
        in_range(top, 0, MAX_TOP_LOGPROBS as i64, "top_logprobs").map(|t| Some(t as usize))
    }

    pub fn max_tokens(&self) -> Option<i64> {
        self.max_completion_tokens.or(self.max_tokens)
    }
}

impl CompletionRequest {
    pub fn logprobs(&self) -> Result<Option<usize>, ApiError> {
        self.logprobs
            .map(|n| in_range(n, 0, MAX_COMPLETION_LOGPROBS as i64, "logprobs").map(|n| n as usize))
            .transpose()
    }
}

fn in_range(v: i64, lo: i64, hi: i64, param: &'static str) -> Result<i64, ApiError> {
    if v < lo || v > hi {
        return Err(ApiError::invalid(
            format!("{param} must be between {lo} and {hi}, got {v}"),
            Some(param),
        ));
    }
    Ok(v)
}

impl Sampling {
    fn check(&self) -> Result<(), ApiError> {
        use axiom::engine::SamplingField;
        // The engine's ranges, so that the CLI and the server accept the same values.
        self.sampler(0).validate().map_err(|e| {
            let param = match e.field {
                SamplingField::Temperature => "temperature",
                SamplingField::TopP => "top_p",
                SamplingField::MinP => "min_p",
                SamplingField::RepeatPenalty => "repetition_penalty",
                SamplingField::PresencePenalty => "presence_penalty",
                SamplingField::FrequencyPenalty => "frequency_penalty",
            };
            ApiError::invalid(e.describe(param), Some(param))
        })?;
        if let Some(k) = self.top_k {
            in_range(k, -1, i32::MAX as i64, "top_k")?;
        }
        if self.n.is_some_and(|n| n != 1) {
            return Err(ApiError::invalid(
                "only n = 1 is supported (the engine does not fork sequences)",
                Some("n"),
            ));
        }
        if self
            .service_tier
            .as_deref()
            .is_some_and(|t| t != "auto" && t != "default")
        {
            return Err(ApiError::invalid(
                "this server has one service tier: auto or default",
                Some("service_tier"),
            ));
        }
        let stops = self.stops();
        if stops.len() > MAX_STOPS {
            return Err(ApiError::invalid(
                format!("at most {MAX_STOPS} stop strings"),
                Some("stop"),
            ));
        }
        if stops.iter().any(|s| s.len() > 1024) {
            return Err(ApiError::invalid(
                "stop strings are limited to 1024 bytes",
                Some("stop"),
            ));
        }
        Ok(())
    }

    pub fn stops(&self) -> Vec<String> {
        match &self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        }
        .into_iter()
        .filter(|s| !s.is_empty())
        .collect()
    }

    /// The engine's sampler settings: OpenAI's defaults (temperature 1, no top-k, top-p 1),
    /// with a seed from `entropy` when none is given.
    pub fn sampler(&self, entropy: u64) -> axiom::engine::SamplerConfig {
        axiom::engine::SamplerConfig {
            temperature: self.temperature.unwrap_or(1.0),
            top_k: self.top_k.filter(|&k| k > 0).map_or(0, |k| k as usize),
            top_p: self.top_p.unwrap_or(1.0),
            min_p: self.min_p.unwrap_or(0.0),
            repeat_penalty: self.repetition_penalty.unwrap_or(1.0),
            penalty_last_n: 64,
            presence_penalty: self.presence_penalty.unwrap_or(0.0),
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0),
            seed: self.seed.map_or(entropy, |s| s as u64),
        }
    }
}

/// A request body from anyone: both endpoints' parsing and every check derived from it. The
/// fuzz target and its corpus replay call this; it must return whatever the bytes.
pub fn untrusted_request(body: &[u8]) {
    if let Ok(chat) = parse_chat(body) {
        let _ = (
            chat.logprobs(),
            chat.max_tokens(),
            chat.sampling.sampler(0),
            chat.sampling.stops(),
        );
        let _: Vec<String> = chat.messages.iter().map(ChatMessage::text).collect();
    }
    if let Ok(completion) = parse_completion(body) {
        let _ = (completion.logprobs(), completion.sampling.sampler(0));
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    pub prompt_tokens_details: PromptTokensDetails,
}

#[derive(Debug, Clone, Serialize)]
pub struct PromptTokensDetails {
    pub cached_tokens: usize,
}

impl Usage {
    pub fn from(c: &axiom::engine::scheduler::Completion) -> Usage {
        Usage {
            prompt_tokens: c.prompt_tokens,
            completion_tokens: c.completion_tokens,
            total_tokens: c.prompt_tokens + c.completion_tokens,
            prompt_tokens_details: PromptTokensDetails {
                cached_tokens: c.cached_tokens,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_parse_and_bad_fields_are_named() {
        let chat =
            parse_chat(br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stop":"x","seed":3}"#).unwrap();
        assert_eq!(chat.sampling.stops(), vec!["x"]);
        assert_eq!(chat.sampling.sampler(0).seed, 3);
        let parts = parse_chat(
            br#"{"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}]}"#,
        )
        .unwrap();
        assert_eq!(parts.messages[0].text(), "ab");
        let cases: [(&[u8], Option<&str>); 9] = [
            (b"{", None),
            (br#"{"messages":[]}"#, Some("messages")),
            (br#"{"messages":[{"role":"wizard","content":"x"}]}"#, Some("messages")),
            (
                br#"{"messages":[{"role":"user","content":"x"}],"temperature":3}"#,
                Some("temperature"),
            ),
            (
                br#"{"messages":[{"role":"user","content":"x"}],"top_p":2}"#,
                Some("top_p"),
            ),
            (
                br#"{"messages":[{"role":"user","content":"x"}],"repetition_penalty":0}"#,
                Some("repetition_penalty"),
            ),
            (br#"{"messages":[{"role":"user","content":"x"}],"n":2}"#, Some("n")),
            (
                br#"{"messages":[{"role":"user","content":"x"}],"stop":["a","b","c","d","e"]}"#,
                Some("stop"),
            ),
            (
                br#"{"messages":[{"role":"user","content":"x"}],"top_logprobs":2}"#,
                Some("top_logprobs"),
            ),
        ];
        for (body, param) in cases {
            let e = parse_chat(body).unwrap_err();
            assert_eq!(
                (e.status, e.param.as_deref()),
                (StatusCode::BAD_REQUEST, param),
                "{}",
                e.message
            );
        }
        assert!(parse_completion(br#"{"prompt":"x","logprobs":9}"#)
            .unwrap()
            .logprobs()
            .is_err());
        assert!(parse_completion(br#"{"prompt":[1,2,3]}"#).is_ok());
        assert!(parse_completion(br#"{"prompt":"x","echo":true}"#).is_err());
    }
}
