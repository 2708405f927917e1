//! Constraints that enforce OpenAI's `tool_choice`: `required` (a call of any one of the tools)
//! or a named function. The output is one call, `{"name": NAME, "arguments": ARGS}`, with ARGS
//! valid under that tool's parameters schema.
//!
//! Written as a Lark grammar with one `%json` rule per tool rather than one JSON schema, so that
//! each parameters schema stays a document of its own and its `#/$defs/...` references resolve.

use super::constraint::{with_json_options, ConstraintError, ConstraintSpec};
use serde_json::{json, Value};

/// A function the model may call.
#[derive(Debug, Clone, Copy)]
pub struct ToolSchema<'a> {
    pub name: &'a str,
    /// The JSON schema of its arguments; `None` for a function without parameters.
    pub parameters: Option<&'a Value>,
}

/// `tool_choice: "required"`: a call of any one of `tools`.
pub fn any_tool_call(tools: &[ToolSchema]) -> Result<ConstraintSpec, ConstraintError> {
    if tools.is_empty() {
        return Err(ConstraintError(
            "tool_choice requires a tool call, and there are no tools".into(),
        ));
    }
    if let Some((i, tool)) = tools
        .iter()
        .enumerate()
        .find(|(i, tool)| tools[..*i].iter().any(|t| t.name == tool.name))
    {
        return Err(ConstraintError(format!("tool {i} repeats the name {:?}", tool.name)));
    }
    calls_grammar(tools)
}

/// `tool_choice: {"type": "function", "function": {"name": ...}}`: a call of that function.
pub fn named_tool_call(tools: &[ToolSchema], name: &str) -> Result<ConstraintSpec, ConstraintError> {
    let tool = tools.iter().find(|t| t.name == name).ok_or_else(|| {
        ConstraintError(format!(
            "tool_choice names the function {name:?}, which is not among the tools"
        ))
    })?;
    calls_grammar(std::slice::from_ref(tool))
}

fn calls_grammar(tools: &[ToolSchema]) -> Result<ConstraintSpec, ConstraintError> {
    let alternatives: Vec<String> = (0..tools.len()).map(|i| format!("call_{i}")).collect();
    let mut lark = format!("start: {}\n", alternatives.join(" | "));
    for (i, tool) in tools.iter().enumerate() {
        if tool.name.is_empty() {
            return Err(ConstraintError(format!("tool {i} has no name")));
        }
        let mut parameters = tool
            .parameters
            .cloned()
            .unwrap_or_else(|| json!({"type": "object", "properties": {}}));
        // A call's arguments are the function's parameters: one it does not name would fail the
        // call, so the grammar offers none unless the schema asks for them.
        if let Some(object) = parameters.as_object_mut() {
            object.entry("additionalProperties").or_insert(Value::Bool(false));
        }
        let parameters = with_json_options(parameters, true)
            .map_err(|e| ConstraintError(format!("the parameters of tool {:?}: {e}", tool.name)))?;
        // Lark string literals are JSON strings; the name inside one is a JSON string too.
        let head = format!("{{\"name\": {}, \"arguments\": ", Value::from(tool.name));
        lark.push_str(&format!("call_{i}: {} args_{i} \"}}\"\n", Value::from(head)));
        lark.push_str(&format!("args_{i}: %json {parameters}\n"));
    }
    Ok(ConstraintSpec::Lark(lark))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weather() -> Value {
        json!({
            "type": "object",
            "properties": {"city": {"$ref": "#/$defs/city"}, "days": {"type": "integer"}},
            "required": ["city"],
            "$defs": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
        })
    }

    #[test]
    fn required_and_named_calls_are_grammars_over_the_tools() {
        let parameters = weather();
        let tools = [
            ToolSchema {
                name: "get_weather",
                parameters: Some(&parameters),
            },
            ToolSchema {
                name: "now",
                parameters: None,
            },
        ];
        let ConstraintSpec::Lark(any) = any_tool_call(&tools).unwrap() else {
            panic!("not a Lark grammar")
        };
        assert!(any.starts_with("start: call_0 | call_1\n"), "{any}");
        assert!(
            any.contains(r#"call_0: "{\"name\": \"get_weather\", \"arguments\": " args_0 "}""#),
            "{any}"
        );
        assert!(any.contains("args_1: %json {"), "{any}");
        // Arguments the function does not name are not offered, unless its schema allows them.
        assert_eq!(any.matches(r#""additionalProperties":false"#).count(), 2, "{any}");
        let open = json!({"type": "object", "additionalProperties": true});
        let open_tool = ToolSchema {
            name: "open",
            parameters: Some(&open),
        };
        let ConstraintSpec::Lark(kept) = any_tool_call(&[open_tool]).unwrap() else {
            panic!("not a Lark grammar")
        };
        assert!(kept.contains(r#""additionalProperties":true"#), "{kept}");
        let ConstraintSpec::Lark(named) = named_tool_call(&tools, "now").unwrap() else {
            panic!("not a Lark grammar")
        };
        assert!(
            named.starts_with("start: call_0\n") && named.contains(r#"\"now\""#),
            "{named}"
        );

        assert!(any_tool_call(&[]).unwrap_err().0.contains("no tools"));
        assert!(named_tool_call(&tools, "other").unwrap_err().0.contains("\"other\""));
        assert!(any_tool_call(&[tools[1], tools[1]]).unwrap_err().0.contains("repeats"));
        let not_a_schema = json!(3);
        let bad = ToolSchema {
            name: "bad",
            parameters: Some(&not_a_schema),
        };
        assert!(any_tool_call(&[bad]).unwrap_err().0.contains("\"bad\""));
    }
}
