//! A chat request's generated text split into content and tool calls, as OpenAI's responses
//! carry them: calls get ids (`call_` and random hex; 9 characters for Mistral, whose template
//! refuses other ids when the call comes back) and their arguments as JSON text.

use axiom::engine::scheduler::{Completion, FinishReason};
use axiom::tool_calls::{Piece, ToolCallParser, ToolFormat};
use serde_json::{json, Value};

pub struct ToolOutput {
    /// None: no tools were offered, or `tool_choice` is `none`; all text is content.
    parser: Option<ToolCallParser>,
    format: Option<ToolFormat>,
    /// `parallel_tool_calls`: when false, calls after the first are dropped.
    parallel: bool,
    calls: usize,
}

/// What became certain with one piece of generated text.
#[derive(Debug, Default)]
pub struct Split {
    pub content: String,
    /// Each call's index in the response and its OpenAI object.
    pub calls: Vec<(usize, Value)>,
}

impl ToolOutput {
    pub fn new(format: Option<ToolFormat>, parallel: bool) -> ToolOutput {
        ToolOutput {
            parser: format.map(ToolCallParser::new),
            format,
            parallel,
            calls: 0,
        }
    }

    pub fn push(&mut self, text: &str) -> Split {
        match &mut self.parser {
            Some(parser) => {
                let pieces = parser.push(text);
                self.split(pieces)
            }
            None => Split {
                content: text.to_owned(),
                calls: Vec::new(),
            },
        }
    }

    /// What the parser still held at the end of generation.
    pub fn finish(&mut self) -> Split {
        let pieces = self.parser.take().map(ToolCallParser::finish).unwrap_or_default();
        self.split(pieces)
    }

    /// `tool_calls` when the model stopped after making calls, else the engine's reason.
    pub fn finish_reason(&self, completion: &Completion) -> &'static str {
        if self.calls > 0 && completion.finish == FinishReason::Stop {
            "tool_calls"
        } else {
            completion.finish.as_str()
        }
    }

    fn split(&mut self, pieces: Vec<Piece>) -> Split {
        let mut split = Split::default();
        for piece in pieces {
            match piece {
                Piece::Text(text) => split.content.push_str(&text),
                Piece::Call(_) if !self.parallel && self.calls > 0 => {}
                Piece::Call(call) => {
                    let hex = uuid::Uuid::new_v4().simple().to_string();
                    let id = match self.format {
                        Some(ToolFormat::Mistral) => hex[..9].to_owned(),
                        _ => format!("call_{}", &hex[..24]),
                    };
                    let object = json!({"id": id, "type": "function",
                                        "function": {"name": call.name, "arguments": call.arguments}});
                    split.calls.push((self.calls, object));
                    self.calls += 1;
                }
            }
        }
        split
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_get_ids_and_indices_and_parallel_false_keeps_the_first() {
        let output = "Checking.<tool_call>\n{\"name\": \"a\", \"arguments\": {\"x\": 1}}\n</tool_call>\n<tool_call>\n{\"name\": \"b\", \"arguments\": {}}\n</tool_call>";
        for (parallel, names) in [(true, vec!["a", "b"]), (false, vec!["a"])] {
            let mut out = ToolOutput::new(Some(ToolFormat::Hermes), parallel);
            let mut split = out.push(output);
            let rest = out.finish();
            split.content.push_str(&rest.content);
            split.calls.extend(rest.calls);
            assert_eq!(split.content, "Checking.");
            let got: Vec<&str> = split
                .calls
                .iter()
                .map(|(_, c)| c["function"]["name"].as_str().unwrap())
                .collect();
            assert_eq!(got, names);
            assert_eq!(split.calls[0].1["function"]["arguments"], r#"{"x":1}"#);
            let id = split.calls[0].1["id"].as_str().unwrap();
            assert!(id.starts_with("call_") && id.len() == 29, "{id}");
            assert_eq!(
                split.calls.iter().map(|(i, _)| *i).collect::<Vec<_>>(),
                (0..names.len()).collect::<Vec<_>>()
            );
        }
        let mut mistral = ToolOutput::new(Some(ToolFormat::Mistral), true);
        let split = mistral.push("[TOOL_CALLS] [{\"name\": \"f\", \"arguments\": {}}]");
        let calls = [split.calls, mistral.finish().calls].concat();
        assert_eq!(calls[0].1["id"].as_str().unwrap().len(), 9);
        let mut plain = ToolOutput::new(None, true);
        assert_eq!(plain.push("<tool_call>").content, "<tool_call>");
        assert!(plain.finish().calls.is_empty());
    }
}
