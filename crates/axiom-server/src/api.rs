//! The OpenAI request and response shapes, and the checks that turn a request body into work
//! for the engine. Everything here is a pure function of its input (the fuzz target calls
//! [`parse_chat`] and [`parse_completion`] directly).

use crate::fields::{self, Endpoints};
use axiom::engine::tool_choice::{any_tool_call, named_tool_call, ToolSchema};
use axiom::engine::ConstraintSpec;
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
    /// Token id (a string) to a bias added to its logit, -100 to 100; -100 bans the token.
    pub logit_bias: Option<serde_json::Map<String, Value>>,
    /// vLLM's: generation stops at any of these tokens, left out of the text.
    pub stop_token_ids: Option<Vec<u32>>,
    /// OpenAI's: `{"type": "text" | "json_object" | "json_schema", "json_schema": {...}}`.
    pub response_format: Option<Value>,
    /// llama-server's: a JSON schema the output must follow.
    pub json_schema: Option<Value>,
    /// llama-server's: a GBNF grammar the output must follow.
    pub grammar: Option<String>,
    /// vLLM's: a JSON schema (an object, or a string holding one).
    pub guided_json: Option<Value>,
    /// vLLM's: a regular expression the whole output must match.
    pub guided_regex: Option<String>,
    /// vLLM's: the output is exactly one of these.
    pub guided_choice: Option<Vec<String>>,
    /// vLLM's: a grammar, GBNF when it holds `::=`, llguidance's Lark otherwise.
    pub guided_grammar: Option<String>,
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
    pub name: Option<String>,
    pub tool_calls: Option<Vec<ToolCallIn>>,
    pub tool_call_id: Option<String>,
}

/// A call in an earlier assistant turn, as clients send it back.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolCallIn {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub function: FunctionCallIn,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FunctionCallIn {
    pub name: String,
    /// JSON text, as OpenAI sends it (an object is taken too).
    pub arguments: Value,
}

/// An offered tool: `{"type": "function", "function": {...}}`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct Tool {
    #[serde(rename = "type")]
    kind: String,
    function: FunctionDef,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(dead_code, reason = "read by serde to check the shape; the template reads the JSON")]
struct FunctionDef {
    name: String,
    description: Option<String>,
    parameters: Option<Value>,
    strict: Option<bool>,
}

/// `tool_choice`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum ToolChoice {
    /// Tools are offered to the template, but the output is not read for calls (as vLLM does).
    #[default]
    None,
    /// The model may call tools; calls in its output are returned as such.
    Auto,
    /// The output is one call of any of the tools, forced by a grammar over their schemas.
    Required,
    /// The output is one call of this function, forced likewise.
    Function(String),
}

impl ToolChoice {
    /// Whether the output is a call whatever the model would say (a grammar forces it).
    pub fn forces_a_call(&self) -> bool {
        matches!(self, ToolChoice::Required | ToolChoice::Function(_))
    }
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
    /// Offered tools, kept as sent: the template renders them in their given order.
    pub tools: Option<Vec<Value>>,
    #[serde(rename = "tool_choice")]
    tool_choice_sent: Option<Value>,
    /// `tool_choice` as read by `check_chat`, once.
    #[serde(skip)]
    tool_choice: ToolChoice,
    pub parallel_tool_calls: Option<bool>,
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
/// Most choices (`n`) one request may ask for.
pub const MAX_CHOICES: usize = 16;
/// Most stop strings, as OpenAI allows.
pub const MAX_STOPS: usize = 4;

/// The body as `T`, once `check` (a [`fields`] check) has passed its fields.
fn parse_checked<T: serde::de::DeserializeOwned>(
    body: &[u8],
    check: impl FnOnce(&mut Value) -> Result<(), ApiError>,
) -> Result<T, ApiError> {
    let mut value: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid(format!("the body is not valid JSON: {e}"), None))?;
    check(&mut value)?;
    serde_json::from_value(value)
        .map_err(|e| ApiError::invalid(format!("the request does not match the schema: {e}"), None))
}

fn parse<T: serde::de::DeserializeOwned>(body: &[u8], endpoint: Endpoints) -> Result<T, ApiError> {
    parse_checked(body, |v| fields::check(v, endpoint))
}

/// `POST /tokenize`: llama-server's `{"content"}` or vLLM's `{"prompt"}` / `{"messages"}`.
#[derive(Debug, Clone, Deserialize)]
pub struct TokenizeRequest {
    pub content: Option<String>,
    pub prompt: Option<String>,
    pub messages: Option<Vec<ChatMessage>>,
    pub tools: Option<Vec<Value>>,
    pub add_special: Option<bool>,
    pub add_special_tokens: Option<bool>,
    pub add_generation_prompt: Option<bool>,
    #[serde(default)]
    pub with_pieces: bool,
}

/// What `/tokenize` is asked to encode.
pub enum TokenizeInput {
    /// Text, with the BOS token first if `add_special`; `param` names the field it came in.
    Text {
        text: String,
        add_special: bool,
        param: &'static str,
    },
    Chat {
        messages: Vec<axiom::chat::Message>,
        tools: Vec<Value>,
        add_generation_prompt: bool,
    },
}

pub fn parse_tokenize(body: &[u8]) -> Result<(TokenizeInput, bool), ApiError> {
    let r: TokenizeRequest = parse_checked(body, |v| fields::check_known(v, fields::TOKENIZE_FIELDS))?;
    let add_special = r.add_special.or(r.add_special_tokens);
    let input = match (r.content, r.prompt, r.messages) {
        // llama-server adds no BOS by default, vLLM does.
        (Some(text), None, None) => TokenizeInput::Text {
            text,
            add_special: add_special.unwrap_or(false),
            param: "content",
        },
        (None, Some(text), None) => TokenizeInput::Text {
            text,
            add_special: add_special.unwrap_or(true),
            param: "prompt",
        },
        (None, None, Some(messages)) => {
            if add_special == Some(true) {
                return Err(ApiError::invalid(
                    "a chat prompt's special tokens are the template's: add_special_tokens must be false",
                    Some(if r.add_special.is_some() {
                        "add_special"
                    } else {
                        "add_special_tokens"
                    }),
                ));
            }
            let chat = ChatRequest::for_template(messages, r.tools.clone())?;
            TokenizeInput::Chat {
                messages: chat.template_messages()?,
                tools: chat.tools().to_vec(),
                add_generation_prompt: r.add_generation_prompt.unwrap_or(true),
            }
        }
        _ => {
            return Err(ApiError::invalid(
                "give exactly one of content, prompt and messages",
                Some("content"),
            ))
        }
    };
    for (given, name) in [
        (r.tools.is_some(), "tools"),
        (r.add_generation_prompt.is_some(), "add_generation_prompt"),
    ] {
        if given && matches!(input, TokenizeInput::Text { .. }) {
            return Err(ApiError::invalid(
                format!("{name} applies to messages only"),
                Some(name),
            ));
        }
    }
    Ok((input, r.with_pieces))
}

/// `POST /detokenize`: `{"tokens": [...]}`.
pub fn parse_detokenize(body: &[u8]) -> Result<Vec<u32>, ApiError> {
    #[derive(Deserialize)]
    struct Detokenize {
        tokens: Vec<u32>,
    }
    let r: Detokenize = parse_checked(body, |v| fields::check_known(v, fields::DETOKENIZE_FIELDS))?;
    Ok(r.tokens)
}

pub fn parse_chat(body: &[u8]) -> Result<ChatRequest, ApiError> {
    check_chat(parse(body, Endpoints::Chat)?)
}

fn check_chat(mut request: ChatRequest) -> Result<ChatRequest, ApiError> {
    if request.messages.is_empty() {
        return Err(ApiError::invalid("messages must not be empty", Some("messages")));
    }
    for (i, m) in request.messages.iter().enumerate() {
        check_message(i, m)?;
    }
    request.tool_choice = request.read_tool_choice()?;
    let forced = request.tool_choice.forces_a_call();
    for (i, tool) in request.tools.iter().flatten().enumerate() {
        check_tool(i, tool, forced)?;
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

fn check_message(i: usize, m: &ChatMessage) -> Result<(), ApiError> {
    let param = |field: &str| format!("messages[{i}].{field}");
    if !matches!(m.role.as_str(), "system" | "user" | "assistant" | "developer" | "tool") {
        return Err(ApiError::invalid(
            format!("unknown role {:?}", m.role),
            Some(&param("role")),
        ));
    }
    if let Some(Content::Parts(parts)) = &m.content {
        for (j, p) in parts.iter().enumerate() {
            if p.kind != "text" || p.text.is_none() {
                return Err(ApiError::invalid(
                    format!("content parts of type {:?} are not supported (only text)", p.kind),
                    Some(&param(&format!("content[{j}].type"))),
                ));
            }
        }
    }
    if m.tool_calls.is_some() && m.role != "assistant" {
        return Err(ApiError::invalid(
            "only assistant messages carry tool_calls",
            Some(&param("tool_calls")),
        ));
    }
    match (m.role == "tool", m.tool_call_id.is_some()) {
        (true, false) => Err(ApiError::invalid(
            "a tool message needs the tool_call_id it answers",
            Some(&param("tool_call_id")),
        )),
        (false, true) => Err(ApiError::invalid(
            "only tool messages carry tool_call_id",
            Some(&param("tool_call_id")),
        )),
        _ => m.template_tool_calls(i).map(drop),
    }
}

/// `forced`: whether `tool_choice` forces a call, by a grammar that enforces each tool's schema
/// (so `strict` holds).
fn check_tool(i: usize, tool: &Value, forced: bool) -> Result<(), ApiError> {
    let param = format!("tools[{i}]");
    let tool: Tool =
        serde_json::from_value(tool.clone()).map_err(|e| ApiError::invalid(format!("{param}: {e}"), Some(&param)))?;
    if tool.kind != "function" {
        return Err(ApiError::invalid(
            format!("tools of type {:?} are not supported (only function)", tool.kind),
            Some(&format!("{param}.type")),
        ));
    }
    if tool.function.strict == Some(true) && !forced {
        return Err(ApiError::invalid(
            "strict function schemas are enforced only when tool_choice forces a call \
             (required or a named function)",
            Some(&format!("{param}.function.strict")),
        ));
    }
    Ok(())
}

pub fn parse_completion(body: &[u8]) -> Result<CompletionRequest, ApiError> {
    let request: CompletionRequest = parse(body, Endpoints::Completions)?;
    if request.echo {
        return Err(ApiError::invalid("echo is not supported", Some("echo")));
    }
    if request.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid("suffix is not supported", Some("suffix")));
    }
    request.sampling.check()?;
    if request
        .best_of
        .is_some_and(|b| b as usize != request.sampling.choices())
    {
        return Err(ApiError::invalid(
            "best_of must equal n: returning the best of more candidates (ranked by log-probability) is not supported",
            Some("best_of"),
        ));
    }
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

    /// This message (number `i`) as the chat template takes it.
    pub fn to_template(&self, i: usize) -> Result<axiom::chat::Message, ApiError> {
        Ok(axiom::chat::Message {
            name: self.name.clone(),
            tool_calls: self.template_tool_calls(i)?,
            tool_call_id: self.tool_call_id.clone(),
            ..axiom::chat::Message::new(&self.role, &self.text())
        })
    }

    /// The calls as transformers passes them to templates: arguments as an object (Qwen 2.5's
    /// template writes them with `tojson`), not the JSON text clients send.
    fn template_tool_calls(&self, i: usize) -> Result<Option<Vec<Value>>, ApiError> {
        let Some(calls) = &self.tool_calls else {
            return Ok(None);
        };
        let calls = calls.iter().enumerate().map(|(j, call)| {
            let param = format!("messages[{i}].tool_calls[{j}]");
            if call.kind != "function" {
                return Err(ApiError::invalid(
                    format!("tool calls of type {:?} are not supported (only function)", call.kind),
                    Some(&format!("{param}.type")),
                ));
            }
            let arguments = match &call.function.arguments {
                Value::String(text) => serde_json::from_str(text).ok(),
                object @ Value::Object(_) => Some(object.clone()),
                _ => None,
            }
            .filter(Value::is_object)
            .ok_or_else(|| {
                ApiError::invalid(
                    "arguments must be a JSON object (or its text)",
                    Some(&format!("{param}.function.arguments")),
                )
            })?;
            Ok(json!({"id": call.id, "type": "function",
                      "function": {"name": call.function.name, "arguments": arguments}}))
        });
        calls.collect::<Result<Vec<_>, _>>().map(Some)
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

    /// A request that only renders `messages` and `tools`, checked as a chat request is.
    fn for_template(messages: Vec<ChatMessage>, tools: Option<Vec<Value>>) -> Result<ChatRequest, ApiError> {
        check_chat(ChatRequest {
            model: None,
            messages,
            max_tokens: None,
            max_completion_tokens: None,
            logprobs: false,
            top_logprobs: None,
            tools,
            tool_choice_sent: None,
            tool_choice: ToolChoice::None,
            parallel_tool_calls: None,
            store: false,
            modalities: None,
            sampling: Sampling::default(),
        })
    }

    /// The messages as the chat template takes them.
    pub fn template_messages(&self) -> Result<Vec<axiom::chat::Message>, ApiError> {
        self.messages
            .iter()
            .enumerate()
            .map(|(i, m)| m.to_template(i))
            .collect()
    }

    /// The offered tools (none if not given).
    pub fn tools(&self) -> &[Value] {
        self.tools.as_deref().unwrap_or_default()
    }

    /// `tool_choice`: `auto` by default when tools are offered, as OpenAI's API does.
    pub fn tool_choice(&self) -> &ToolChoice {
        &self.tool_choice
    }

    fn read_tool_choice(&self) -> Result<ToolChoice, ApiError> {
        let invalid = |message: String| ApiError::invalid(message, Some("tool_choice"));
        let choice = match &self.tool_choice_sent {
            None if self.tools().is_empty() => ToolChoice::None,
            None => ToolChoice::Auto,
            Some(Value::String(s)) if s == "none" => ToolChoice::None,
            Some(Value::String(s)) if s == "auto" => ToolChoice::Auto,
            Some(Value::String(s)) if s == "required" => ToolChoice::Required,
            Some(Value::Object(o)) if o.get("type").and_then(Value::as_str) == Some("function") => {
                let name = o.get("function").and_then(|f| f.get("name")).and_then(Value::as_str);
                let name = name.ok_or_else(|| invalid("tool_choice.function.name must be a string".into()))?;
                ToolChoice::Function(name.to_string())
            }
            Some(other) => {
                return Err(invalid(format!(
                    "tool_choice must be none, auto, required or a function, got {other}"
                )))
            }
        };
        if choice.forces_a_call() && self.tools().is_empty() {
            return Err(invalid("tool_choice forces a tool call, and no tools are given".into()));
        }
        Ok(choice)
    }

    /// The one constraint on the output, and the field that asked for it: a forced tool call's
    /// grammar, or a structured-output field (not both).
    pub fn constraint(&self) -> Result<Option<(ConstraintSpec, &'static str)>, ApiError> {
        let asked = self.sampling.constraint()?;
        let choice = self.tool_choice();
        if !choice.forces_a_call() {
            return Ok(asked);
        }
        if let Some((_, field)) = asked {
            return Err(ApiError::invalid(
                format!("tool_choice forces a tool call, and {field} constrains the output: give one"),
                Some("tool_choice"),
            ));
        }
        let schemas: Vec<ToolSchema> = self
            .tools()
            .iter()
            .map(|tool| {
                let function = &tool["function"];
                ToolSchema {
                    name: function["name"].as_str().unwrap_or_default(),
                    parameters: function.get("parameters").filter(|p| !p.is_null()),
                }
            })
            .collect();
        let spec = match choice {
            ToolChoice::Function(name) => named_tool_call(&schemas, name),
            _ => any_tool_call(&schemas),
        };
        let spec = spec.map_err(|e| ApiError::invalid(e.0, Some("tool_choice")))?;
        Ok(Some((spec, "tool_choice")))
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
                SamplingField::LogitBias => "logit_bias",
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
        self.logit_bias()?;
        self.constraint()?;
        if let Some(n) = self.n {
            in_range(n.into(), 1, MAX_CHOICES as i64, "n")?;
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

    /// `logit_bias` as (token id, bias) pairs; the range of each bias is the engine's to check.
    fn logit_bias(&self) -> Result<Vec<(u32, f32)>, ApiError> {
        let Some(map) = &self.logit_bias else {
            return Ok(Vec::new());
        };
        map.iter()
            .map(|(key, value)| {
                let id = key.parse::<u32>().map_err(|_| {
                    ApiError::invalid(
                        format!("logit_bias keys are token ids, got {key:?}"),
                        Some("logit_bias"),
                    )
                })?;
                let bias = value.as_f64().ok_or_else(|| {
                    ApiError::invalid(format!("logit_bias[{key:?}] is not a number"), Some("logit_bias"))
                })?;
                Ok((id, bias as f32))
            })
            .collect()
    }

    /// The output constraint the request asks for, and the field that asks; a second field
    /// asking for one is refused by name.
    pub fn constraint(&self) -> Result<Option<(ConstraintSpec, &'static str)>, ApiError> {
        let asked = [
            (
                "response_format",
                self.response_format
                    .as_ref()
                    .map(response_format)
                    .transpose()?
                    .flatten(),
            ),
            (
                "json_schema",
                self.json_schema
                    .as_ref()
                    .map(|schema| schema_spec(schema, true, "json_schema"))
                    .transpose()?,
            ),
            ("grammar", self.grammar.clone().map(ConstraintSpec::Gbnf)),
            ("guided_json", self.guided_json.as_ref().map(guided_json).transpose()?),
            ("guided_regex", self.guided_regex.clone().map(ConstraintSpec::Regex)),
            ("guided_choice", self.guided_choice.clone().map(ConstraintSpec::Choice)),
            (
                "guided_grammar",
                self.guided_grammar.as_ref().map(|g| {
                    if g.contains("::=") {
                        ConstraintSpec::Gbnf(g.clone())
                    } else {
                        ConstraintSpec::Lark(g.clone())
                    }
                }),
            ),
        ];
        let mut found = None;
        for (field, spec) in asked {
            let Some(spec) = spec else { continue };
            if let Some((_, first)) = found {
                return Err(ApiError::invalid(
                    format!("{field} constrains the output, and so does {first}: give at most one"),
                    Some(field),
                ));
            }
            found = Some((spec, field));
        }
        Ok(found)
    }

    /// How many choices to generate (`n`, checked to be 1 to [`MAX_CHOICES`]).
    pub fn choices(&self) -> usize {
        self.n.map_or(1, |n| n as usize)
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
            // `check` refused a malformed map before this is called.
            logit_bias: self.logit_bias().unwrap_or_default(),
            seed: self.seed.map_or(entropy, |s| s as u64),
        }
    }
}

/// OpenAI's `response_format`; `text` asks for no constraint.
fn response_format(format: &Value) -> Result<Option<ConstraintSpec>, ApiError> {
    let bad = |message: String| ApiError::invalid(message, Some("response_format"));
    match format.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(ConstraintSpec::JsonObject)),
        Some("json_schema") => {
            let spec = format
                .get("json_schema")
                .and_then(Value::as_object)
                .ok_or_else(|| bad("response_format json_schema needs a json_schema object".into()))?;
            let name = spec.get("name").and_then(Value::as_str).unwrap_or("");
            if name.is_empty()
                || name.len() > 64
                || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
            {
                return Err(bad(format!(
                    "response_format.json_schema.name must be 1 to 64 letters, digits, '_' or '-', got {name:?}"
                )));
            }
            let strict = match spec.get("strict") {
                None | Some(Value::Null) => false,
                Some(Value::Bool(strict)) => *strict,
                Some(other) => {
                    return Err(bad(format!(
                        "response_format.json_schema.strict must be a boolean, got {other}"
                    )))
                }
            };
            // OpenAI makes the schema optional: without one, any JSON.
            let schema = spec.get("schema").cloned().unwrap_or_else(|| json!({}));
            schema_spec(&schema, strict, "response_format").map(Some)
        }
        _ => Err(bad(format!(
            "response_format.type must be \"text\", \"json_object\" or \"json_schema\", got {}",
            format.get("type").unwrap_or(&Value::Null)
        ))),
    }
}

fn schema_spec(schema: &Value, strict: bool, field: &'static str) -> Result<ConstraintSpec, ApiError> {
    if !schema.is_object() {
        return Err(ApiError::invalid(
            format!("the JSON schema in {field} must be an object"),
            Some(field),
        ));
    }
    Ok(ConstraintSpec::JsonSchema {
        schema: schema.clone(),
        strict,
    })
}

/// vLLM's `guided_json`: a schema, or a string holding one.
fn guided_json(value: &Value) -> Result<ConstraintSpec, ApiError> {
    match value {
        Value::String(text) => {
            let schema: Value = serde_json::from_str(text)
                .map_err(|e| ApiError::invalid(format!("guided_json is not JSON: {e}"), Some("guided_json")))?;
            schema_spec(&schema, true, "guided_json")
        }
        schema => schema_spec(schema, true, "guided_json"),
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
    let _ = (parse_tokenize(body).is_ok(), parse_detokenize(body));
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
    /// The usage of a request's choices, as OpenAI and vLLM count it: the prompt once, the
    /// completions summed; cached are the most prompt tokens any choice took from the prefix
    /// cache (choices after the first reuse the first one's prompt pages).
    pub fn of(choices: &[axiom::engine::scheduler::Completion]) -> Usage {
        let prompt_tokens = choices.first().map_or(0, |c| c.prompt_tokens);
        let completion_tokens = choices.iter().map(|c| c.completion_tokens).sum();
        Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            prompt_tokens_details: PromptTokensDetails {
                cached_tokens: choices.iter().map(|c| c.cached_tokens).max().unwrap_or(0),
            },
        }
    }
}

/// The seed of choice `choice` of a request sampled with `seed`: the seed itself for the first
/// (so `n` = 1 and choice 0 agree), a mix of both for the others, so that choices differ and a
/// request repeated with its seed gives the same choices.
pub fn choice_seed(seed: u64, choice: usize) -> u64 {
    if choice == 0 {
        return seed;
    }
    // SplitMix64's finalizer: nearby inputs give unrelated outputs.
    let mut z = seed.wrapping_add((choice as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
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
        let llama = parse_chat(br#"{"messages":[{"role":"user","content":"hi"}],"repeat_penalty":1.25}"#).unwrap();
        assert_eq!(llama.sampling.sampler(0).repeat_penalty, 1.25);
        let parts = parse_chat(
            br#"{"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}]}"#,
        )
        .unwrap();
        assert_eq!(parts.messages[0].text(), "ab");
        let cases: [(&[u8], Option<&str>); 9] = [
            (b"{", None),
            (br#"{"messages":[]}"#, Some("messages")),
            (
                br#"{"messages":[{"role":"wizard","content":"x"}]}"#,
                Some("messages[0].role"),
            ),
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
            (br#"{"messages":[{"role":"user","content":"x"}],"n":17}"#, Some("n")),
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
        let tool = r#"{"type":"function","function":{"name":"f","parameters":{"type":"object"}}}"#;
        let call = r#"{"id":"call_1","type":"function","function":{"name":"f","arguments":"{\"a\": 1}"}}"#;
        let tool_cases = [
            (r#""tool_choice":"required""#.into(), "tool_choice"),
            (
                format!(r#""tools":[{tool}],"tool_choice":{{"type":"function","function":{{}}}}"#),
                "tool_choice",
            ),
            (r#""tool_choice":"sometimes""#.into(), "tool_choice"),
            (r#""tools":[{"type":"retrieval"}]"#.into(), "tools[0]"),
            (
                r#""tools":[{"type":"function","function":{"name":"f","strict":true}}]"#.into(),
                "tools[0].function.strict",
            ),
        ];
        for (extra, param) in tool_cases {
            let body = format!(r#"{{"messages":[{{"role":"user","content":"x"}}],{extra}}}"#);
            assert_eq!(
                parse_chat(body.as_bytes()).unwrap_err().param.as_deref(),
                Some(param),
                "{extra}"
            );
        }
        // A forced call: its grammar is the one constraint, `strict` holds under it.
        let forced = |extra: &str| {
            let body = format!(r#"{{"messages":[{{"role":"user","content":"x"}}],"tools":[{tool}],{extra}}}"#);
            parse_chat(body.as_bytes()).and_then(|r| r.constraint())
        };
        let named = r#""tool_choice":{"type":"function","function":{"name":"f"}}"#;
        for extra in [r#""tool_choice":"required""#, named] {
            let (spec, field) = forced(extra).unwrap().unwrap();
            assert!(
                matches!(spec, ConstraintSpec::Lark(g) if g.contains(r#"\"f\""#)),
                "{extra}"
            );
            assert_eq!(field, "tool_choice");
        }
        assert!(forced(r#""tool_choice":"auto""#).unwrap().is_none());
        let strict_tool = r#"{"type":"function","function":{"name":"f","strict":true}}"#;
        let body = format!(r#"{{"messages":[{{"role":"user","content":"x"}}],"tools":[{strict_tool}],{named}}}"#);
        assert!(parse_chat(body.as_bytes()).is_ok());
        for extra in [
            r#""tool_choice":{"type":"function","function":{"name":"g"}}"#.to_owned(),
            format!(r#"{named},"response_format":{{"type":"json_object"}}"#),
        ] {
            assert_eq!(
                forced(&extra).unwrap_err().param.as_deref(),
                Some("tool_choice"),
                "{extra}"
            );
        }
        let message_cases = [
            (r#"{"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url","image_url":{"url":"x"}}]}"#.to_owned(), "messages[0].content[1].type"),
            (r#"{"role":"tool","content":"18"}"#.into(), "messages[0].tool_call_id"),
            (r#"{"role":"user","content":"x","tool_call_id":"c"}"#.into(), "messages[0].tool_call_id"),
            (format!(r#"{{"role":"user","content":"x","tool_calls":[{call}]}}"#), "messages[0].tool_calls"),
            (r#"{"role":"assistant","tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":"{oops"}}]}"#.into(), "messages[0].tool_calls[0].function.arguments"),
        ];
        for (message, param) in message_cases {
            let body = format!(r#"{{"messages":[{message}]}}"#);
            assert_eq!(
                parse_chat(body.as_bytes()).unwrap_err().param.as_deref(),
                Some(param),
                "{message}"
            );
        }
        let body = format!(
            r#"{{"messages":[{{"role":"assistant","content":null,"tool_calls":[{call}]}},{{"role":"tool","tool_call_id":"call_1","content":"2"}}],"tools":[{tool}]}}"#
        );
        let chat = parse_chat(body.as_bytes()).unwrap();
        assert_eq!(chat.tool_choice(), &ToolChoice::Auto);
        let messages = chat.template_messages().unwrap();
        assert_eq!(
            messages[0].tool_calls.as_ref().unwrap()[0]["function"]["arguments"],
            json!({"a": 1})
        );
        assert_eq!(messages[1].tool_call_id.as_deref(), Some("call_1"));
        assert_eq!(
            parse_completion(br#"{"prompt":"x","best_of":2}"#)
                .unwrap_err()
                .param
                .as_deref(),
            Some("best_of")
        );
        assert_eq!(
            parse_completion(br#"{"prompt":"x","n":0}"#)
                .unwrap_err()
                .param
                .as_deref(),
            Some("n")
        );
        assert_eq!(
            parse_completion(br#"{"prompt":"x","n":3,"best_of":3}"#)
                .unwrap()
                .sampling
                .choices(),
            3
        );
        let seeds: Vec<u64> = (0..3).map(|i| choice_seed(7, i)).collect();
        assert_eq!(seeds[0], 7);
        assert!(seeds[1] != seeds[0] && seeds[2] != seeds[1] && seeds[2] != seeds[0]);
        let text = |body: &[u8]| match parse_tokenize(body).unwrap().0 {
            TokenizeInput::Text { text, add_special, .. } => (text, add_special),
            TokenizeInput::Chat { .. } => panic!("not text"),
        };
        assert_eq!(text(br#"{"content":"a"}"#), ("a".into(), false));
        assert_eq!(text(br#"{"prompt":"a"}"#), ("a".into(), true));
        assert_eq!(text(br#"{"content":"a","add_special":true}"#), ("a".into(), true));
        let chat = parse_tokenize(br#"{"messages":[{"role":"user","content":"a"}],"with_pieces":true}"#).unwrap();
        assert!(matches!(
            chat,
            (
                TokenizeInput::Chat {
                    add_generation_prompt: true,
                    ..
                },
                true
            )
        ));
        for (body, param) in [
            (&br#"{"content":"a","prompt":"b"}"#[..], "content"),
            (br#"{"text":"a"}"#, "text"),
            (
                br#"{"content":"a","add_generation_prompt":true}"#,
                "add_generation_prompt",
            ),
            (
                br#"{"messages":[{"role":"user","content":"a"}],"add_special_tokens":true}"#,
                "add_special_tokens",
            ),
            (
                br#"{"messages":[{"role":"user","content":"a","x":1}]}"#,
                "messages[0].x",
            ),
        ] {
            assert_eq!(parse_tokenize(body).err().and_then(|e| e.param).as_deref(), Some(param));
        }
        assert_eq!(parse_detokenize(br#"{"tokens":[1,2]}"#).unwrap(), vec![1, 2]);
        assert_eq!(
            parse_detokenize(br#"{"tokens":[1],"x":0}"#)
                .unwrap_err()
                .param
                .as_deref(),
            Some("x")
        );
        assert!(parse_completion(br#"{"prompt":"x","logprobs":9}"#)
            .unwrap()
            .logprobs()
            .is_err());
        assert!(parse_completion(br#"{"prompt":[1,2,3]}"#).is_ok());
        assert!(parse_completion(br#"{"prompt":"x","echo":true}"#).is_err());
    }

    #[test]
    fn constraint_fields_map_to_the_engine_and_a_second_one_is_named() {
        let constraint = |body: &[u8]| parse_completion(body).unwrap().sampling.constraint().unwrap();
        let schema = json!({"type": "object"});
        assert_eq!(
            constraint(
                br#"{"prompt":"x","response_format":{"type":"json_schema","json_schema":{"name":"p","schema":{"type":"object"},"strict":true}}}"#
            ),
            Some((
                ConstraintSpec::JsonSchema {
                    schema: schema.clone(),
                    strict: true
                },
                "response_format"
            ))
        );
        assert_eq!(constraint(br#"{"prompt":"x","response_format":{"type":"text"}}"#), None);
        assert_eq!(
            constraint(br#"{"prompt":"x","response_format":{"type":"json_object"}}"#),
            Some((ConstraintSpec::JsonObject, "response_format"))
        );
        assert_eq!(
            constraint(br#"{"prompt":"x","guided_json":"{\"type\":\"object\"}"}"#),
            Some((ConstraintSpec::JsonSchema { schema, strict: true }, "guided_json"))
        );
        assert_eq!(
            constraint(br#"{"prompt":"x","grammar":"root ::= \"a\""}"#),
            Some((ConstraintSpec::Gbnf("root ::= \"a\"".into()), "grammar"))
        );
        assert_eq!(
            constraint(br#"{"prompt":"x","guided_grammar":"start: \"a\""}"#),
            Some((ConstraintSpec::Lark("start: \"a\"".into()), "guided_grammar"))
        );
        assert_eq!(
            constraint(br#"{"prompt":"x","guided_choice":["a","b"]}"#),
            Some((ConstraintSpec::Choice(vec!["a".into(), "b".into()]), "guided_choice"))
        );
        let bias = parse_completion(br#"{"prompt":"x","logit_bias":{"7":-100,"9":2.5}}"#).unwrap();
        assert_eq!(bias.sampling.sampler(0).logit_bias, vec![(7, -100.0), (9, 2.5)]);

        let cases: [(&[u8], &str); 7] = [
            (
                br#"{"prompt":"x","response_format":{"type":"json_object"},"guided_regex":"a"}"#,
                "guided_regex",
            ),
            (
                br#"{"prompt":"x","json_schema":{"type":"object"},"grammar":"root ::= \"a\""}"#,
                "grammar",
            ),
            (
                br#"{"prompt":"x","response_format":{"type":"yaml"}}"#,
                "response_format",
            ),
            (
                br#"{"prompt":"x","response_format":{"type":"json_schema","json_schema":{"schema":{}}}}"#,
                "response_format",
            ),
            (br#"{"prompt":"x","guided_json":"{not json"}"#, "guided_json"),
            (br#"{"prompt":"x","logit_bias":{"abc":1}}"#, "logit_bias"),
            (br#"{"prompt":"x","logit_bias":{"1":-101}}"#, "logit_bias"),
        ];
        for (body, param) in cases {
            let e = parse_completion(body).unwrap_err();
            assert_eq!(
                (e.status, e.param.as_deref()),
                (StatusCode::BAD_REQUEST, Some(param)),
                "{}",
                e.message
            );
        }
    }
}
