//! Every request field the server knows, and whether it acts on it: one list, which
//! docs/serving.md repeats. A field not in it is refused by name, as OpenAI's API does; a
//! field that is in it but refused says why. A `null` value counts as the field left out.

use crate::api::ApiError;
use serde_json::{Map, Value};

/// Which endpoints take a field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoints {
    Chat,
    Completions,
    Both,
}

/// What the server does with a field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rule {
    /// Acted on (some values may still be refused by the field's own checks in `api`).
    Accepted,
    /// Known, not acted on: refused with this reason.
    Refused(&'static str),
}

use Endpoints::{Both, Chat, Completions};
use Rule::{Accepted, Refused};

/// The request fields of `/v1/chat/completions` and `/v1/completions`, one line each.
pub const REQUEST_FIELDS: &[(&str, Endpoints, Rule)] = &[
    ("model", Both, Accepted),
    ("messages", Chat, Accepted),
    ("prompt", Completions, Accepted),
    ("max_tokens", Both, Accepted),
    ("max_completion_tokens", Chat, Accepted),
    ("temperature", Both, Accepted),
    ("top_p", Both, Accepted),
    ("top_k", Both, Accepted),
    ("min_p", Both, Accepted),
    ("presence_penalty", Both, Accepted),
    ("frequency_penalty", Both, Accepted),
    ("repetition_penalty", Both, Accepted),
    ("repeat_penalty", Both, Accepted),
    ("seed", Both, Accepted),
    ("stop", Both, Accepted),
    ("stream", Both, Accepted),
    ("stream_options", Both, Accepted),
    ("logprobs", Both, Accepted),
    ("top_logprobs", Chat, Accepted),
    ("ignore_eos", Both, Accepted),
    ("n", Both, Accepted),
    ("best_of", Completions, Accepted),
    ("echo", Completions, Accepted),
    ("suffix", Completions, Accepted),
    ("user", Both, Accepted),
    ("store", Chat, Accepted),
    ("service_tier", Both, Accepted),
    ("modalities", Chat, Accepted),
    ("tools", Chat, Accepted),
    ("tool_choice", Chat, Accepted),
    ("parallel_tool_calls", Chat, Accepted),
    ("logit_bias", Both, Accepted),
    ("stop_token_ids", Both, Accepted),
    ("response_format", Both, Accepted),
    ("json_schema", Both, Accepted),
    ("grammar", Both, Accepted),
    ("guided_json", Both, Accepted),
    ("guided_regex", Both, Accepted),
    ("guided_choice", Both, Accepted),
    ("guided_grammar", Both, Accepted),
    (
        "functions",
        Chat,
        Refused("the deprecated functions API is not supported; use tools"),
    ),
    (
        "function_call",
        Chat,
        Refused("the deprecated functions API is not supported; use tool_choice"),
    ),
    ("audio", Chat, Refused("audio output is not supported")),
    ("prediction", Chat, Refused("predicted outputs are not supported")),
    (
        "metadata",
        Chat,
        Refused("metadata is for stored completions, which this server does not keep"),
    ),
    ("reasoning_effort", Chat, Refused("reasoning_effort is not supported")),
    ("web_search_options", Chat, Refused("web search is not supported")),
];

/// The fields of one chat message.
pub const MESSAGE_FIELDS: &[(&str, Rule)] = &[
    ("role", Accepted),
    ("content", Accepted),
    ("name", Accepted),
    ("tool_calls", Accepted),
    ("tool_call_id", Accepted),
    (
        "function_call",
        Refused("the deprecated functions API is not supported; use tool_calls"),
    ),
    ("audio", Refused("audio is not supported")),
    ("refusal", Refused("refusal messages are not supported")),
];

/// `/tokenize`'s fields: llama-server's (`content`, `add_special`, `with_pieces`) and vLLM's
/// (`prompt` or `messages`, `add_special_tokens`, `add_generation_prompt`, `tools`).
pub const TOKENIZE_FIELDS: &[&str] = &[
    "model",
    "content",
    "prompt",
    "messages",
    "tools",
    "add_special",
    "add_special_tokens",
    "add_generation_prompt",
    "with_pieces",
];

/// `/detokenize`'s fields.
pub const DETOKENIZE_FIELDS: &[&str] = &["model", "tokens"];

/// `body`'s fields checked against `known` (and its messages', as for chat); `null` fields are
/// removed.
pub fn check_known(body: &mut Value, known: &[&str]) -> Result<(), ApiError> {
    let object = body
        .as_object_mut()
        .ok_or_else(|| ApiError::invalid("the request body must be a JSON object", None))?;
    object.retain(|_, v| !v.is_null());
    for name in object.keys() {
        refuse(name, known.contains(&name.as_str()).then_some(Accepted), name)?;
    }
    check_messages(object)
}

/// The request `body`'s fields checked against [`REQUEST_FIELDS`] for `endpoint`, and its
/// messages' fields against [`MESSAGE_FIELDS`]; `null` fields are removed.
pub fn check(body: &mut Value, endpoint: Endpoints) -> Result<(), ApiError> {
    let object = body
        .as_object_mut()
        .ok_or_else(|| ApiError::invalid("the request body must be a JSON object", None))?;
    object.retain(|_, v| !v.is_null());
    for name in object.keys() {
        let rule = REQUEST_FIELDS
            .iter()
            .find(|(field, endpoints, _)| field == name && (*endpoints == Both || *endpoints == endpoint))
            .map(|&(_, _, rule)| rule);
        refuse(name, rule, name)?;
    }
    check_messages(object)
}

fn check_messages(object: &mut Map<String, Value>) -> Result<(), ApiError> {
    if let Some(Value::Array(messages)) = object.get_mut("messages") {
        for (i, message) in messages.iter_mut().enumerate() {
            if let Value::Object(message) = message {
                check_message(i, message)?;
            }
        }
    }
    Ok(())
}

fn check_message(i: usize, message: &mut Map<String, Value>) -> Result<(), ApiError> {
    message.retain(|_, v| !v.is_null());
    for name in message.keys() {
        let rule = MESSAGE_FIELDS
            .iter()
            .find(|(field, _)| field == name)
            .map(|&(_, rule)| rule);
        refuse(name, rule, &format!("messages[{i}].{name}"))?;
    }
    Ok(())
}

fn refuse(name: &str, rule: Option<Rule>, param: &str) -> Result<(), ApiError> {
    match rule {
        Some(Accepted) => Ok(()),
        Some(Refused(reason)) => Err(ApiError::invalid(format!("{name}: {reason}"), Some(param))),
        None => Err(ApiError::invalid(
            format!("Unrecognized request argument supplied: {name}"),
            Some(param),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn param(mut body: Value, endpoint: Endpoints) -> Option<String> {
        check(&mut body, endpoint).err().and_then(|e| e.param)
    }

    #[test]
    fn unknown_and_refused_fields_are_named_and_nulls_are_absent() {
        let chat = |extra: Value| {
            let mut body = json!({"messages": [{"role": "user", "content": "hi"}]});
            body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            param(body, Chat)
        };
        assert_eq!(chat(json!({"temperature": 0.5, "seed": 1})), None);
        assert_eq!(chat(json!({"logit_bias": null, "user": null})), None);
        assert_eq!(chat(json!({"frobnicate": 1})).as_deref(), Some("frobnicate"));
        assert_eq!(chat(json!({"logit_bias": {"1": 5}})), None);
        assert_eq!(chat(json!({"functions": []})).as_deref(), Some("functions"));
        assert_eq!(chat(json!({"echo": true})).as_deref(), Some("echo"));
        assert_eq!(
            param(json!({"prompt": "x", "tools": []}), Completions).as_deref(),
            Some("tools")
        );
        assert_eq!(param(json!({"prompt": "x", "echo": false}), Completions), None);
        let message =
            json!({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b", "audio": {}}]});
        assert_eq!(param(message, Chat).as_deref(), Some("messages[1].audio"));
        let message = json!({"messages": [{"role": "user", "content": "a", "weight": 1}]});
        assert_eq!(param(message, Chat).as_deref(), Some("messages[0].weight"));
        assert!(check(&mut json!([1]), Chat).is_err());
    }

    #[test]
    fn each_field_is_listed_once() {
        for (i, (name, ..)) in REQUEST_FIELDS.iter().enumerate() {
            assert!(
                !REQUEST_FIELDS[i + 1..].iter().any(|(other, ..)| other == name),
                "{name}"
            );
        }
    }
}
