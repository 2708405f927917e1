//! Tool calls in a model's output, in the formats models are trained to write them: Hermes'
//! `<tool_call>{json}</tool_call>` (Qwen 2.5, Qwen 3), Llama 3.1/3.2's bare JSON object
//! (`{"name": ..., "parameters": ...}`, maybe after `<|python_tag|>`), and Mistral's
//! `[TOOL_CALLS] [{...}]`. The parser takes text as it is generated: text that cannot start a
//! call passes through at once, a call is held until it parses, and what never parses is text.

use serde_json::Value as Json;

/// A format of tool calls in generated text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolFormat {
    Hermes,
    Llama3Json,
    Mistral,
}

/// One call the model made: a function name and its arguments as JSON text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: String,
}

/// What the parser hands on, in output order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    Text(String),
    Call(ToolCall),
}

impl ToolFormat {
    pub const ALL: [ToolFormat; 3] = [ToolFormat::Hermes, ToolFormat::Llama3Json, ToolFormat::Mistral];

    /// The name `--tool-parser` takes (vLLM's names).
    pub fn name(self) -> &'static str {
        match self {
            ToolFormat::Hermes => "hermes",
            ToolFormat::Llama3Json => "llama3_json",
            ToolFormat::Mistral => "mistral",
        }
    }

    pub fn from_name(name: &str) -> Option<ToolFormat> {
        ToolFormat::ALL.into_iter().find(|f| f.name() == name)
    }

    /// The format a chat template's text teaches its model, if it names one.
    pub fn detect(template: &str) -> Option<ToolFormat> {
        if template.contains("<tool_call>") {
            Some(ToolFormat::Hermes)
        } else if template.contains("[TOOL_CALLS]") {
            Some(ToolFormat::Mistral)
        } else if template.contains("<|python_tag|>") || template.contains("\"parameters\": dictionary") {
            Some(ToolFormat::Llama3Json)
        } else {
            None
        }
    }

    fn start_marker(self) -> &'static str {
        match self {
            ToolFormat::Hermes => "<tool_call>",
            ToolFormat::Llama3Json => "<|python_tag|>",
            ToolFormat::Mistral => "[TOOL_CALLS]",
        }
    }

    /// A call that runs to the next of these; without one, it runs to the end of the output.
    fn end_marker(self) -> Option<&'static str> {
        match self {
            ToolFormat::Hermes => Some("</tool_call>"),
            ToolFormat::Llama3Json | ToolFormat::Mistral => None,
        }
    }

    /// Output that starts (after white space) with this character is a call: the models'
    /// marker tokens are special, so decoded text may lack them.
    fn bare_opening(self) -> Option<char> {
        match self {
            ToolFormat::Hermes => None,
            ToolFormat::Llama3Json => Some('{'),
            ToolFormat::Mistral => Some('['),
        }
    }

    /// The calls in the text between a call's markers, if it is one.
    fn parse_calls(self, body: &str) -> Option<Vec<ToolCall>> {
        let values = json_values(body)?;
        let objects: Vec<&Json> = match (self, values.as_slice()) {
            (ToolFormat::Hermes, [one]) => vec![one],
            (ToolFormat::Mistral, [Json::Array(items)]) => items.iter().collect(),
            (ToolFormat::Mistral, [one]) => vec![one],
            (ToolFormat::Llama3Json, values) if !values.is_empty() => values.iter().collect(),
            _ => return None,
        };
        objects.into_iter().map(tool_call).collect()
    }
}

/// The JSON values in `text`, separated by white space or `;` (Llama 3's parallel calls).
fn json_values(text: &str) -> Option<Vec<Json>> {
    let mut values = Vec::new();
    let mut rest = text.trim_start();
    while !rest.is_empty() {
        let mut stream = serde_json::Deserializer::from_str(rest).into_iter::<Json>();
        values.push(stream.next()?.ok()?);
        rest = rest[stream.byte_offset()..].trim_start();
        rest = rest.strip_prefix(';').unwrap_or(rest).trim_start();
    }
    Some(values)
}

fn tool_call(value: &Json) -> Option<ToolCall> {
    let name = value.get("name")?.as_str()?.to_owned();
    let arguments = match value.get("arguments").or_else(|| value.get("parameters")) {
        None => "{}".to_owned(),
        // Some models write the arguments as a string of JSON, as the API carries them.
        Some(Json::String(text)) => serde_json::from_str::<Json>(text).ok()?.to_string(),
        Some(object @ Json::Object(_)) => object.to_string(),
        Some(_) => return None,
    };
    Some(ToolCall { name, arguments })
}

/// Splits generated text into content and tool calls as it arrives.
#[derive(Debug)]
pub struct ToolCallParser {
    format: ToolFormat,
    /// Text not yet handed on.
    held: String,
    /// Inside a call: the text that opened it (its marker, or white space before a bare one),
    /// given back as text if the call does not parse.
    opening: Option<String>,
    /// Nothing but white space has been generated yet.
    at_start: bool,
    /// A call has been handed on: white space after it is the model's layout, not content.
    after_call: bool,
}

impl ToolCallParser {
    pub fn new(format: ToolFormat) -> ToolCallParser {
        ToolCallParser {
            format,
            held: String::new(),
            opening: None,
            at_start: true,
            after_call: false,
        }
    }

    /// Adds generated text; returns what is now certain.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.held.push_str(text);
        let mut pieces = Vec::new();
        loop {
            if self.opening.is_some() {
                let Some(end) = self.format.end_marker() else {
                    return pieces;
                };
                let Some(at) = self.held.find(end) else {
                    return pieces;
                };
                let rest = self.held.split_off(at + end.len());
                let call = std::mem::replace(&mut self.held, rest);
                self.close_call(&call[..at], &call[at..], &mut pieces);
                continue;
            }
            if self.at_start {
                let trimmed = self.held.trim_start();
                let marker = self.format.start_marker();
                if trimmed.len() < marker.len() && marker.starts_with(trimmed) {
                    return pieces;
                }
                self.at_start = false;
                let bare = self.format.bare_opening().is_some_and(|c| trimmed.starts_with(c));
                if bare && !trimmed.starts_with(marker) {
                    let space = self.held.len() - trimmed.len();
                    self.opening = Some(self.held.drain(..space).collect());
                    continue;
                }
            }
            let marker = self.format.start_marker();
            if let Some(at) = self.held.find(marker) {
                let rest = self.held.split_off(at + marker.len());
                let mut before = std::mem::replace(&mut self.held, rest);
                before.truncate(at);
                self.text(before, &mut pieces);
                self.opening = Some(marker.to_owned());
                continue;
            }
            // Hold what may be the start of a marker; hand on the rest.
            let keep = (1..marker.len())
                .rev()
                .find(|&n| self.held.ends_with(&marker[..n]))
                .unwrap_or(0);
            let rest = self.held.split_off(self.held.len() - keep);
            let ready = std::mem::replace(&mut self.held, rest);
            self.text(ready, &mut pieces);
            return pieces;
        }
    }

    /// The end of generation: a call still open is a call if it parses, else text.
    pub fn finish(mut self) -> Vec<Piece> {
        let mut pieces = Vec::new();
        let held = std::mem::take(&mut self.held);
        if self.opening.is_some() {
            self.close_call(&held, "", &mut pieces);
        } else {
            self.text(held, &mut pieces);
        }
        pieces
    }

    /// Ends the open call whose text is `body` and closing marker `end`.
    fn close_call(&mut self, body: &str, end: &str, pieces: &mut Vec<Piece>) {
        let opening = self.opening.take().unwrap_or_default();
        match self.format.parse_calls(body) {
            Some(calls) => {
                pieces.extend(calls.into_iter().map(Piece::Call));
                self.after_call = true;
            }
            None => self.text(format!("{opening}{body}{end}"), pieces),
        }
    }

    fn text(&mut self, text: String, pieces: &mut Vec<Piece>) {
        if text.is_empty() || (self.after_call && text.trim().is_empty()) {
            return;
        }
        self.after_call = false;
        match pieces.last_mut() {
            Some(Piece::Text(last)) => last.push_str(&text),
            _ => pieces.push(Piece::Text(text)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pieces for `output` fed in chunks of `step` bytes (at character boundaries), with
    /// neighbouring texts joined.
    fn parse(format: ToolFormat, output: &str, step: usize) -> Vec<Piece> {
        let mut parser = ToolCallParser::new(format);
        let mut pieces = Vec::new();
        let chars: Vec<char> = output.chars().collect();
        for chunk in chars.chunks(step) {
            pieces.extend(parser.push(&chunk.iter().collect::<String>()));
        }
        pieces.extend(parser.finish());
        let mut joined: Vec<Piece> = Vec::new();
        for piece in pieces {
            match (joined.last_mut(), piece) {
                (Some(Piece::Text(last)), Piece::Text(t)) => last.push_str(&t),
                (_, piece) => joined.push(piece),
            }
        }
        joined
    }

    fn call(name: &str, arguments: &str) -> Piece {
        Piece::Call(ToolCall {
            name: name.into(),
            arguments: arguments.into(),
        })
    }

    fn text(t: &str) -> Piece {
        Piece::Text(t.into())
    }

    fn each_step(format: ToolFormat, output: &str, expected: &[Piece]) {
        for step in [1, 2, 3, 7, output.len()] {
            assert_eq!(parse(format, output, step), expected, "step {step}: {output:?}");
        }
    }

    #[test]
    fn hermes_calls_as_qwen_writes_them() {
        // Qwen2.5-7B-Instruct's answer to "weather in Paris and Tokyo" with a get_weather tool.
        let output = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Tokyo\", \"unit\": \"celsius\"}}\n</tool_call>";
        each_step(
            ToolFormat::Hermes,
            output,
            &[
                call("get_weather", r#"{"city":"Paris","unit":"celsius"}"#),
                call("get_weather", r#"{"city":"Tokyo","unit":"celsius"}"#),
            ],
        );
        // Text before the call is content; Qwen3 thinks first.
        let output = "<think>\nThe user wants the time.\n</think>\n\nLet me check.\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>";
        each_step(
            ToolFormat::Hermes,
            output,
            &[
                text("<think>\nThe user wants the time.\n</think>\n\nLet me check.\n"),
                call("now", "{}"),
            ],
        );
    }

    #[test]
    fn what_does_not_parse_is_text() {
        each_step(
            ToolFormat::Hermes,
            "Use <tool_call> tags.",
            &[text("Use <tool_call> tags.")],
        );
        each_step(
            ToolFormat::Hermes,
            "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1\n</tool_call> ok",
            &[text(
                "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1\n</tool_call> ok",
            )],
        );
        each_step(ToolFormat::Hermes, "a < b <tool", &[text("a < b <tool")]);
        each_step(
            ToolFormat::Llama3Json,
            "{not json} at all",
            &[text("{not json} at all")],
        );
        each_step(ToolFormat::Mistral, "[1] is a footnote.", &[text("[1] is a footnote.")]);
        each_step(
            ToolFormat::Llama3Json,
            "Plain answer {x}.",
            &[text("Plain answer {x}.")],
        );
    }

    #[test]
    fn an_unclosed_hermes_call_at_the_end_still_counts() {
        each_step(
            ToolFormat::Hermes,
            "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"q\": \"a;b\"}}\n",
            &[call("f", r#"{"q":"a;b"}"#)],
        );
    }

    #[test]
    fn llama3_json_calls() {
        // Llama-3.2-3B-Instruct's call; its <|python_tag|> is a special token, absent from decoded text.
        each_step(
            ToolFormat::Llama3Json,
            "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"San Francisco, CA\"}}",
            &[call("get_weather", r#"{"city":"San Francisco, CA"}"#)],
        );
        each_step(
            ToolFormat::Llama3Json,
            "<|python_tag|>{\"name\": \"search\", \"parameters\": {\"query\": \"rust; serde\"}}; {\"name\": \"now\", \"parameters\": {}}",
            &[call("search", r#"{"query":"rust; serde"}"#), call("now", "{}")],
        );
    }

    #[test]
    fn mistral_calls() {
        // Mistral-7B-Instruct-v0.3's call, with [TOOL_CALLS] decoded and without.
        let calls = [
            call(
                "get_current_weather",
                r#"{"location":"Paris, France","format":"celsius"}"#,
            ),
            call("get_time", r#"{"tz":"Europe/Paris"}"#),
        ];
        let body = "[{\"name\": \"get_current_weather\", \"arguments\": {\"location\": \"Paris, France\", \"format\": \"celsius\"}}, {\"name\": \"get_time\", \"arguments\": {\"tz\": \"Europe/Paris\"}}]";
        each_step(ToolFormat::Mistral, &format!("[TOOL_CALLS] {body}"), &calls);
        each_step(ToolFormat::Mistral, &format!(" {body}"), &calls);
    }

    #[test]
    fn formats_come_from_templates_and_names() {
        let qwen = include_str!("../tests/fixtures/chat_templates/qwen2.5.jinja");
        assert_eq!(ToolFormat::detect(qwen), Some(ToolFormat::Hermes));
        assert_eq!(
            ToolFormat::detect("{% for m in messages %}{{ m.content }}{% endfor %}"),
            None
        );
        assert_eq!(
            ToolFormat::detect("{{- '[TOOL_CALLS] ' + tool_calls | tojson }}"),
            Some(ToolFormat::Mistral)
        );
        for format in ToolFormat::ALL {
            assert_eq!(ToolFormat::from_name(format.name()), Some(format));
        }
        assert_eq!(ToolFormat::from_name("pythonic"), None);
    }
}
