//! Chat templates: the model's Jinja template rendered with minijinja, configured like
//! Hugging Face transformers' renderer (trim_blocks, lstrip_blocks, Python string methods,
//! `raise_exception`, a `tojson` that writes what Python's `json.dumps` does). Tools and tool
//! calls reach the template as transformers' `apply_chat_template` passes them.

use crate::{Error, Result};
use minijinja::value::Kwargs;
use minijinja::{context, Environment, ErrorKind};
use serde::{Deserialize, Serialize};
use serde_json::Value as Json;
use std::ops::Range;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
    /// The participant's name, for templates that show it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// An assistant turn's calls: `{"id", "type": "function", "function": {"name", "arguments"}}`
    /// with `arguments` an object, as templates expect.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<Json>>,
    /// A `tool` turn's answer to this call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl Message {
    pub fn new(role: &str, content: &str) -> Message {
        Message {
            role: role.into(),
            content: content.into(),
            name: None,
            tool_calls: None,
            tool_call_id: None,
        }
    }
}

/// A rendered chat prompt that knows where the messages' content lies in it, so that the
/// tokenizer can read the template's control tokens as such and the content as plain text
/// (`Tokenizer::encode_chat`).
#[derive(Debug, Clone)]
pub struct RenderedChat {
    text: String,
    pub(crate) content: ContentSpans,
}

#[derive(Debug, Clone)]
pub(crate) enum ContentSpans {
    /// Byte ranges of the text that are message content, in order.
    Placed(Vec<Range<usize>>),
    /// The template changes content in a way not recognised: the contents, to check instead.
    Unplaced(Vec<String>),
}

impl RenderedChat {
    /// The prompt text, as `ChatTemplate::render` gives it.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// The part from byte `start` on (a character boundary), for a conversation that has
    /// already run the text before it.
    pub fn tail(&self, start: usize) -> RenderedChat {
        let content = match &self.content {
            ContentSpans::Placed(spans) => ContentSpans::Placed(
                spans
                    .iter()
                    .filter(|s| s.end > start)
                    .map(|s| s.start.max(start) - start..s.end - start)
                    .collect(),
            ),
            unplaced => unplaced.clone(),
        };
        RenderedChat {
            text: self.text[start..].to_owned(),
            content,
        }
    }
}

/// Stands in for message `i`'s content to find where the template puts it: private-use
/// characters that no template writes, around a number.
const MARK: char = '\u{10FFFD}';

pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: String,
    eos_token: String,
}

/// Templates are small; this bounds a hostile one's work instead of letting it spin.
const TEMPLATE_FUEL: u64 = 5_000_000;

impl ChatTemplate {
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_fuel(Some(TEMPLATE_FUEL));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
            },
        );
        env.add_function("strftime_now", |format: String| -> String { strftime_now(&format) });
        env.add_filter("tojson", python_tojson);
        env.add_template_owned("chat", source.to_owned())
            .map_err(template_error)?;
        Ok(ChatTemplate {
            env,
            source: source.to_owned(),
            bos_token: bos_token.into(),
            eos_token: eos_token.into(),
        })
    }

    /// The template's Jinja text.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Whether the template reads a `tools` variable (transformers' name for the offered tools).
    pub fn takes_tools(&self) -> bool {
        self.env
            .get_template("chat")
            .is_ok_and(|t| t.undeclared_variables(false).contains("tools"))
    }

    /// The prompt text for `messages`, ending with the assistant's turn opening when
    /// `add_generation_prompt`.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        self.render_with_tools(messages, &[], add_generation_prompt)
    }

    /// `render`, offering `tools` (`{"type": "function", "function": {...}}` each; none: the
    /// template's `tools` is undefined, as transformers leaves it).
    pub fn render_with_tools(
        &self,
        messages: &[Message],
        tools: &[Json],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let template = self.env.get_template("chat").map_err(template_error)?;
        template
            .render(context! {
                messages => messages,
                tools => (!tools.is_empty()).then_some(tools),
                add_generation_prompt => add_generation_prompt,
                bos_token => self.bos_token,
                eos_token => self.eos_token,
            })
            .map_err(template_error)
    }

    /// `render`, and where each message's content lies in the text.
    ///
    /// The template is rendered a second time with a marker for each content, which gives its
    /// own text around them; the real text must be that with each content (or the content
    /// trimmed, as Llama 3's template does) in place of its marker. When it is not, the content
    /// is left unplaced and `Tokenizer::encode_chat` refuses special-token text in it.
    pub fn render_chat(&self, messages: &[Message], add_generation_prompt: bool) -> Result<RenderedChat> {
        self.render_chat_with_tools(messages, &[], add_generation_prompt)
    }

    /// `render_chat`, offering `tools`. Their text, and that of tool calls, is the template's:
    /// the caller checks it holds no special-token text.
    pub fn render_chat_with_tools(
        &self,
        messages: &[Message],
        tools: &[Json],
        add_generation_prompt: bool,
    ) -> Result<RenderedChat> {
        let text = self.render_with_tools(messages, tools, add_generation_prompt)?;
        // An empty content keeps its emptiness: templates test it (`if message.content`).
        let marked: Vec<Message> = messages
            .iter()
            .enumerate()
            .map(|(i, m)| Message {
                content: if m.content.is_empty() {
                    String::new()
                } else {
                    format!("{MARK}{i}{MARK}")
                },
                ..m.clone()
            })
            .collect();
        let spans = self
            .render_with_tools(&marked, tools, add_generation_prompt)
            .ok()
            .and_then(|outline| place_content(&text, &outline, messages));
        let content = match spans {
            Some(spans) => ContentSpans::Placed(spans),
            None => ContentSpans::Unplaced(messages.iter().map(|m| m.content.clone()).collect()),
        };
        Ok(RenderedChat { text, content })
    }
}

/// Where the contents lie in `text`, given `outline`, the same render with markers for them.
fn place_content(text: &str, outline: &str, messages: &[Message]) -> Option<Vec<Range<usize>>> {
    // Template text and message numbers alternate between the markers.
    let parts: Vec<&str> = outline.split(MARK).collect();
    let mut spans = Vec::new();
    let mut pos = 0;
    for (k, part) in parts.iter().enumerate() {
        if k % 2 == 0 {
            pos += text.get(pos..)?.starts_with(part).then_some(part.len())?;
            continue;
        }
        let content = &messages.get(part.parse::<usize>().ok()?)?.content;
        let after = parts.get(k + 1).copied().unwrap_or("");
        let placed = [content.as_str(), content.trim()].into_iter().find(|c| {
            let rest = &text[pos..];
            rest.starts_with(c) && rest[c.len()..].starts_with(after)
        })?;
        if !placed.is_empty() {
            spans.push(pos..pos + placed.len());
        }
        pos += placed.len();
    }
    (pos == text.len()).then_some(spans)
}

/// transformers' `tojson`: Python's `json.dumps(value, ensure_ascii=False, indent=indent)`, keys
/// in their given order, `", "` and `": "` between items (`","` and a new line when indented).
fn python_tojson(value: minijinja::Value, kwargs: Kwargs) -> std::result::Result<String, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&value)
        .map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let mut out = String::new();
    write_python_json(&json, indent, 0, &mut out);
    Ok(out)
}

fn write_python_json(value: &Json, indent: Option<usize>, depth: usize, out: &mut String) {
    let line = |out: &mut String, depth: usize| {
        if let Some(width) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(width * depth));
        }
    };
    let separator = if indent.is_some() { "," } else { ", " };
    match value {
        Json::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(separator);
                }
                line(out, depth + 1);
                write_python_json(item, indent, depth + 1, out);
            }
            line(out, depth);
            out.push(']');
        }
        Json::Object(map) if !map.is_empty() => {
            out.push('{');
            for (i, (key, item)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(separator);
                }
                line(out, depth + 1);
                out.push_str(&Json::String(key.clone()).to_string());
                out.push_str(": ");
                write_python_json(item, indent, depth + 1, out);
            }
            line(out, depth);
            out.push('}');
        }
        scalar => out.push_str(&scalar.to_string()),
    }
}

fn template_error(e: minijinja::Error) -> Error {
    let mut msg = e.to_string();
    let mut source = std::error::Error::source(&e);
    while let Some(s) = source {
        msg.push_str(&format!(": {s}"));
        source = s.source();
    }
    Error::Template(msg)
}

/// The handful of `strftime` codes chat templates use for "today's date" (Llama 3.1+).
fn strftime_now(format: &str) -> String {
    let days = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() / 86_400)
        .unwrap_or(0) as i64;
    let (year, month, day) = civil_from_days(days);
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    format
        .replace("%d", &format!("{day:02}"))
        .replace("%m", &format!("{month:02}"))
        .replace("%B", MONTHS[(month - 1) as usize])
        .replace("%b", &MONTHS[(month - 1) as usize][..3])
        .replace("%Y", &year.to_string())
}

/// Gregorian date of a day count since 1970-01-01 (Howard Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(month <= 2), month, day)
}

/// The chat template for a GGUF file of `architecture` that carries none, where the family's turn
/// format is fixed: Gemma's (llama.cpp's Gemma files often lack `tokenizer.chat_template`).
pub fn builtin_template(architecture: &str) -> Option<&'static str> {
    match architecture {
        "gemma2" | "gemma3" => Some(include_str!("chat_templates/gemma.jinja")),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tojson_writes_what_python_json_dumps_does() {
        let value: Json = serde_json::from_str(r#"{"b": [1, 2.5, "é\n"], "a": {}, "c": [], "d": null}"#).unwrap();
        let mut flat = String::new();
        write_python_json(&value, None, 0, &mut flat);
        assert_eq!(flat, r#"{"b": [1, 2.5, "é\n"], "a": {}, "c": [], "d": null}"#);
        let mut indented = String::new();
        write_python_json(&value, Some(2), 0, &mut indented);
        assert_eq!(
            indented,
            "{\n  \"b\": [\n    1,\n    2.5,\n    \"é\\n\"\n  ],\n  \"a\": {},\n  \"c\": [],\n  \"d\": null\n}"
        );
    }

    #[test]
    fn dates() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(20_787), (2026, 11, 30));
    }
}
