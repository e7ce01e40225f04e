//! Tool calls and structured output, shared by both APIs: tool definitions and choices checked
//! and normalised to one shape, the grammar that forces well-formed calls or a JSON schema
//! (compiled and enforced by the worker's grammar engine), and the parser that reads the
//! model's `<tool_call>` blocks (the Hermes format of Qwen and many open models) back out of
//! the generated text, streaming or not.

use serde_json::{Map, Value, json};
use strata_proto::worker as pb;

use super::error::ApiError;

/// At most this many calls in one answer when parallel calls are allowed (a bound, so that a
/// model that keeps calling cannot run to max_tokens on calls alone).
const MAX_PARALLEL_CALLS: usize = 8;

/// Most tools one request may define. Claude Code sends up to 27 and Codex fewer; a client
/// with many MCP servers a few hundred. Each becomes part of the prompt and of the grammar.
pub const MAX_TOOLS: usize = 1024;

fn check_count(tools: &[Value], param: &str) -> Result<(), ApiError> {
    if tools.len() > MAX_TOOLS {
        return Err(ApiError::invalid(format!(
            "{param}: {} tools sent, at most {MAX_TOOLS} are accepted",
            tools.len()
        ))
        .param(param));
    }
    Ok(())
}
/// The call markups read: the Hermes tags, and a fenced JSON block, which Qwen2.5-Coder
/// writes instead of the tags its template asks for (read as a call only when it names a tool
/// of the request; anything else in such a fence stays text).
const MARKERS: [(&str, &str); 2] = [("<tool_call>", "</tool_call>"), ("```json", "```")];
const FENCED: usize = 1;

/// One function the model may call.
#[derive(Debug, Clone, PartialEq)]
pub struct Tool {
    pub name: String,
    pub description: Option<String>,
    /// A JSON schema for the arguments (an object schema).
    pub parameters: Value,
    /// The arguments must follow `parameters` (enforced by the grammar).
    pub strict: bool,
}

#[derive(Debug, Clone, PartialEq)]
pub enum ToolChoice {
    /// Tools are not offered; the answer is text.
    None,
    /// The model decides.
    Auto,
    /// At least one call, to any tool.
    Required,
    /// One call to this tool.
    Named(String),
}

/// What a request says about tools.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolUse {
    pub tools: Vec<Tool>,
    pub choice: ToolChoice,
    pub parallel: bool,
}

fn check_name(name: &str, param: &str) -> Result<(), ApiError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    if ok {
        Ok(())
    } else {
        Err(ApiError::invalid(format!(
            "{param}: {name:?} is not a valid function name (1-64 letters, digits, _ or -)"
        ))
        .param(param))
    }
}

/// An argument schema: a JSON object describing an object. Deeper errors are the grammar
/// engine's to find when it compiles the schema.
fn check_schema(schema: Option<&Value>, param: &str) -> Result<Value, ApiError> {
    let bad = |why: &str| Err(ApiError::invalid(format!("{param}: {why}")).param(param));
    let schema = match schema {
        None | Some(Value::Null) => return Ok(json!({"type": "object", "properties": {}})),
        Some(Value::Object(m)) => m,
        Some(_) => return bad("must be a JSON schema object"),
    };
    match schema.get("type") {
        None => {}
        Some(Value::String(t)) if t == "object" => {}
        Some(other) => return bad(&format!("type must be \"object\", not {other}")),
    }
    if schema.get("properties").is_some_and(|p| !p.is_object()) {
        return bad("properties must be an object");
    }
    if let Some(required) = schema.get("required") {
        let names = required
            .as_array()
            .filter(|r| r.iter().all(Value::is_string));
        if names.is_none() {
            return bad("required must be an array of property names");
        }
    }
    Ok(Value::Object(schema.clone()))
}

fn check_unique(tools: &[Tool], flavor_param: &str) -> Result<(), ApiError> {
    // A set, not a scan of the earlier names: that was quadratic (20K tools cost 0.56 s).
    let mut seen = std::collections::HashSet::with_capacity(tools.len());
    for (i, t) in tools.iter().enumerate() {
        if !seen.insert(t.name.as_str()) {
            return Err(ApiError::invalid(format!(
                "{flavor_param}[{i}]: the tool name {:?} is used twice",
                t.name
            ))
            .param(format!("{flavor_param}[{i}]")));
        }
    }
    Ok(())
}

impl ToolUse {
    /// OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`; None when no tools are sent.
    pub fn openai(
        tools: Option<&[Value]>,
        tool_choice: Option<&Value>,
        parallel: Option<bool>,
    ) -> Result<Option<Self>, ApiError> {
        let tools = tools.unwrap_or_default();
        check_count(tools, "tools")?;
        let mut parsed = Vec::with_capacity(tools.len());
        for (i, t) in tools.iter().enumerate() {
            let at = format!("tools[{i}]");
            match t.get("type").and_then(Value::as_str) {
                Some("function") => {}
                Some(other) => {
                    return Err(ApiError::invalid(format!(
                        "{at}.type {other:?} is not supported (only \"function\")"
                    ))
                    .param(format!("{at}.type")));
                }
                None => {
                    return Err(ApiError::invalid(format!("{at}.type is missing"))
                        .param(format!("{at}.type")));
                }
            }
            let f = t
                .get("function")
                .and_then(Value::as_object)
                .ok_or_else(|| {
                    ApiError::invalid(format!("{at}.function must be an object"))
                        .param(format!("{at}.function"))
                })?;
            let name = f.get("name").and_then(Value::as_str).unwrap_or_default();
            check_name(name, &format!("{at}.function.name"))?;
            parsed.push(Tool {
                name: name.to_string(),
                description: f
                    .get("description")
                    .and_then(Value::as_str)
                    .map(str::to_string),
                parameters: check_schema(
                    f.get("parameters"),
                    &format!("{at}.function.parameters"),
                )?,
                strict: f.get("strict").and_then(Value::as_bool).unwrap_or(false),
            });
        }
        check_unique(&parsed, "tools")?;
        let choice = match tool_choice {
            None | Some(Value::Null) => ToolChoice::Auto,
            Some(Value::String(s)) => match s.as_str() {
                "auto" => ToolChoice::Auto,
                "none" => ToolChoice::None,
                "required" => ToolChoice::Required,
                other => {
                    return Err(ApiError::invalid(format!(
                        "tool_choice {other:?} is not one of none, auto, required, or a named function"
                    ))
                    .param("tool_choice"));
                }
            },
            Some(v) => {
                let name = v
                    .get("function")
                    .and_then(|f| f.get("name"))
                    .and_then(Value::as_str)
                    .ok_or_else(|| {
                        ApiError::invalid(
                            "tool_choice must be a string or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                        )
                        .param("tool_choice")
                    })?;
                ToolChoice::Named(name.to_string())
            }
        };
        Self::finish(parsed, choice, parallel.unwrap_or(true), "tool_choice")
    }

    /// Anthropic's `tools` and `tool_choice`; None when no tools are sent.
    pub fn anthropic(
        tools: Option<&[Value]>,
        tool_choice: Option<&Value>,
    ) -> Result<Option<Self>, ApiError> {
        let tools = tools.unwrap_or_default();
        check_count(tools, "tools")?;
        let mut parsed = Vec::with_capacity(tools.len());
        for (i, t) in tools.iter().enumerate() {
            let at = format!("tools.{i}");
            match t.get("type").and_then(Value::as_str) {
                None | Some("custom") => {}
                Some(other) => {
                    return Err(ApiError::invalid(format!(
                        "{at}: {other:?} is a server tool, which this server does not run; define it as a custom tool with an input_schema"
                    )));
                }
            }
            let name = t.get("name").and_then(Value::as_str).unwrap_or_default();
            check_name(name, &format!("{at}.name"))?;
            if t.get("input_schema").is_none() {
                return Err(ApiError::invalid(format!(
                    "{at}.input_schema: field required"
                )));
            }
            parsed.push(Tool {
                name: name.to_string(),
                description: t
                    .get("description")
                    .and_then(Value::as_str)
                    .map(str::to_string),
                parameters: check_schema(t.get("input_schema"), &format!("{at}.input_schema"))?,
                strict: t.get("strict").and_then(Value::as_bool).unwrap_or(false),
            });
        }
        check_unique(&parsed, "tools")?;
        let kind = tool_choice
            .and_then(|c| c.get("type"))
            .and_then(Value::as_str);
        let choice = match kind {
            None | Some("auto") => ToolChoice::Auto,
            Some("any") => ToolChoice::Required,
            Some("none") => ToolChoice::None,
            Some("tool") => {
                let name = tool_choice
                    .and_then(|c| c.get("name"))
                    .and_then(Value::as_str)
                    .ok_or_else(|| ApiError::invalid("tool_choice.name: field required"))?;
                ToolChoice::Named(name.to_string())
            }
            Some(other) => {
                return Err(ApiError::invalid(format!(
                    "tool_choice.type: {other:?} is not one of auto, any, tool, none"
                )));
            }
        };
        let parallel = !tool_choice
            .and_then(|c| c.get("disable_parallel_tool_use"))
            .and_then(Value::as_bool)
            .unwrap_or(false);
        Self::finish(parsed, choice, parallel, "tool_choice")
    }

    fn finish(
        tools: Vec<Tool>,
        choice: ToolChoice,
        parallel: bool,
        param: &str,
    ) -> Result<Option<Self>, ApiError> {
        if tools.is_empty() {
            return match choice {
                ToolChoice::Auto | ToolChoice::None => Ok(None),
                _ => Err(ApiError::invalid(format!(
                    "{param} asks for a tool call, but the request defines no tools"
                ))
                .param(param)),
            };
        }
        if let ToolChoice::Named(name) = &choice
            && !tools.iter().any(|t| &t.name == name)
        {
            return Err(ApiError::invalid(format!(
                "{param} names {name:?}, which is not one of the request's tools"
            ))
            .param(param));
        }
        Ok(Some(Self {
            tools,
            choice,
            parallel,
        }))
    }

    /// Whether calls are read out of the answer (tools offered).
    pub fn offered(&self) -> bool {
        self.choice != ToolChoice::None
    }

    /// The parser that reads this request's calls out of the answer; None when tools are not
    /// offered (the answer is text as written).
    pub fn parser(&self) -> Option<CallParser> {
        self.offered().then(|| CallParser {
            names: self.tools.iter().map(|t| t.name.clone()).collect(),
            ..CallParser::default()
        })
    }

    /// The tools as chat templates expect them (OpenAI's shape). They stay in the prompt even
    /// with `none` (as OpenAI keeps them in context): an agent's turns then share their prefix,
    /// and its cached blocks.
    pub fn template_tools(&self) -> Option<Value> {
        Some(Value::Array(
            self.tools
                .iter()
                .map(|t| {
                    let mut f = Map::new();
                    f.insert("name".into(), json!(t.name));
                    if let Some(d) = &t.description {
                        f.insert("description".into(), json!(d));
                    }
                    f.insert("parameters".into(), t.parameters.clone());
                    json!({"type": "function", "function": f})
                })
                .collect(),
        ))
    }

    /// The grammar the answer must follow: forced calls (required, named), or text or calls
    /// whose arguments follow their schemas (auto with a strict tool); None when the answer
    /// is free.
    pub fn constraint(&self) -> Option<pb::Constraint> {
        let callable: Vec<&Tool> = match &self.choice {
            ToolChoice::None => return None,
            ToolChoice::Auto if !self.tools.iter().any(|t| t.strict) => return None,
            ToolChoice::Named(name) => self.tools.iter().filter(|t| &t.name == name).collect(),
            ToolChoice::Auto | ToolChoice::Required => self.tools.iter().collect(),
        };
        let schemas: Vec<Value> = callable.iter().map(|t| call_schema(t)).collect();
        let body = if schemas.len() == 1 {
            schemas.into_iter().next().unwrap_or_default()
        } else {
            json!({"anyOf": schemas})
        };
        let calls = if self.parallel && !matches!(self.choice, ToolChoice::Named(_)) {
            format!(
                "tool_call (\"\\n\" tool_call){{0,{}}}",
                MAX_PARALLEL_CALLS - 1
            )
        } else {
            "tool_call".to_string()
        };
        let start = if self.choice == ToolChoice::Auto {
            // Text or calls. The text may not start like a call, tagged or fenced: a call
            // in a strict request is one the grammar wrote, following its schema.
            format!("start: TEXT | {calls}\nTEXT: /[^<`](.|\\n)*/\n")
        } else {
            format!("start: {calls}\n")
        };
        let lark = format!(
            "{start}tool_call: \"<tool_call>\\n\" %json {} \"\\n</tool_call>\"\n",
            with_compact_json(body)
        );
        Some(pb::Constraint {
            kind: Some(pb::constraint::Kind::Lark(lark)),
        })
    }
}

/// The one constraint of a request: its output format or its tool calls (a JSON answer that
/// must also be a call cannot be both); `format_param` names the format's field.
pub fn constraint(
    format: Option<pb::Constraint>,
    tool_use: Option<&ToolUse>,
    format_param: &str,
) -> Result<Option<pb::Constraint>, ApiError> {
    match (format, tool_use.and_then(ToolUse::constraint)) {
        (Some(_), Some(_)) => Err(ApiError::invalid(format!(
            "{format_param} cannot be combined with forced (required, named) or strict tool calls: send one or the other"
        ))
        .param(format_param)),
        (format, calls) => Ok(format.or(calls)),
    }
}

/// The JSON of one call, as the Hermes format writes it: `{"name": ..., "arguments": {...}}`.
fn call_schema(tool: &Tool) -> Value {
    json!({
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": tool.parameters},
        "required": ["name", "arguments"],
        "additionalProperties": false,
    })
}

/// JSON as Python's `json.dumps` writes it (what models are trained on), with no free
/// whitespace: a sampled answer cannot wander off into blank space until max_tokens.
fn with_compact_json(mut schema: Value) -> Value {
    if let Value::Object(m) = &mut schema {
        m.entry("x-guidance").or_insert_with(
            || json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
        );
    }
    schema
}

/// OpenAI's `response_format`: None for text, else the JSON schema the answer must follow.
pub fn response_format(format: Option<&Value>) -> Result<Option<pb::Constraint>, ApiError> {
    let Some(format) = format.filter(|f| !f.is_null()) else {
        return Ok(None);
    };
    let schema = match format.get("type").and_then(Value::as_str) {
        Some("text") => return Ok(None),
        Some("json_object") => json!({"type": "object"}),
        Some("json_schema") => {
            let schema = format
                .get("json_schema")
                .and_then(|j| j.get("schema"))
                .ok_or_else(|| {
                    ApiError::invalid("response_format.json_schema.schema is missing")
                        .param("response_format.json_schema.schema")
                })?;
            if !schema.is_object() && !schema.is_boolean() {
                return Err(ApiError::invalid(
                    "response_format.json_schema.schema must be a JSON schema object",
                )
                .param("response_format.json_schema.schema"));
            }
            schema.clone()
        }
        Some(other) => {
            return Err(ApiError::invalid(format!(
                "response_format.type {other:?} is not one of text, json_object, json_schema"
            ))
            .param("response_format.type"));
        }
        None => {
            return Err(
                ApiError::invalid("response_format.type is missing").param("response_format.type")
            );
        }
    };
    Ok(Some(pb::Constraint {
        kind: Some(pb::constraint::Kind::JsonSchema(
            with_compact_json(schema).to_string(),
        )),
    }))
}

/// A call id in the API's style (`call_…`, `toolu_…`).
pub fn call_id(prefix: &str) -> String {
    super::generation::response_id(prefix)
}

/// A call the model made: the tool's name and its arguments as JSON text (an object).
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: String,
}

/// A piece of the answer, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    Text(String),
    Call(ToolCall),
}

/// Reads `<tool_call>{json}</tool_call>` blocks (and fenced JSON calls, see `MARKERS`) out of
/// the answer as it streams. Text that might be the start of a block is held back until it is
/// known not to be, so the markup never reaches the content. A block whose JSON is not a call
/// stays text; whitespace between calls is dropped.
#[derive(Debug, Default)]
pub struct CallParser {
    buf: String,
    /// The marker of the block being read.
    inside: Option<usize>,
    calls: usize,
    /// The request's tool names (fenced blocks must name one); empty: tags only.
    names: Vec<String>,
    /// Whitespace-only text, kept until it is known to sit between text (kept) or around
    /// calls (dropped).
    held_space: String,
}

impl CallParser {
    pub fn calls(&self) -> usize {
        self.calls
    }

    /// The markers this parser reads.
    fn markers(&self) -> &'static [(&'static str, &'static str)] {
        if self.names.is_empty() {
            &MARKERS[..FENCED]
        } else {
            &MARKERS
        }
    }

    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        loop {
            if let Some(m) = self.inside {
                let (open, close) = MARKERS[m];
                let Some(end) = self.buf.find(close) else {
                    break;
                };
                let body: String = self.buf.drain(..end).collect();
                self.buf.drain(..close.len());
                self.inside = None;
                let names = (m == FENCED).then_some(self.names.as_slice());
                match parse_call(&body, names) {
                    Some(call) => {
                        self.calls += 1;
                        self.held_space.clear();
                        out.push(Piece::Call(call));
                    }
                    None => self.text(format!("{open}{body}{close}"), &mut out),
                }
                continue;
            }
            let first = self
                .markers()
                .iter()
                .enumerate()
                .filter_map(|(m, (open, _))| self.buf.find(open).map(|at| (at, m)))
                .min();
            if let Some((start, m)) = first {
                let before: String = self.buf.drain(..start).collect();
                self.buf.drain(..MARKERS[m].0.len());
                self.inside = Some(m);
                self.text(before, &mut out);
            } else {
                let keep = self
                    .markers()
                    .iter()
                    .map(|(open, _)| held_prefix(&self.buf, open))
                    .max()
                    .unwrap_or(0);
                let ready: String = self.buf.drain(..self.buf.len() - keep).collect();
                self.text(ready, &mut out);
                break;
            }
        }
        out
    }

    /// The end of the answer: what was held back. An unfinished block (the answer was cut)
    /// is returned as the text it is.
    pub fn finish(&mut self) -> Vec<Piece> {
        let mut out = Vec::new();
        let rest = std::mem::take(&mut self.buf);
        let rest = match self.inside.take() {
            Some(m) => format!("{}{rest}", MARKERS[m].0),
            None => rest,
        };
        self.text(rest, &mut out);
        if self.calls == 0 && !self.held_space.is_empty() {
            out.push(Piece::Text(std::mem::take(&mut self.held_space)));
        }
        out
    }

    /// Text goes out at once, except its trailing whitespace, held until what follows is
    /// known: more text (then it goes out) or a call (then it is dropped). However the
    /// answer is cut into chunks, the result is the same.
    fn text(&mut self, text: String, out: &mut Vec<Piece>) {
        let body_len = text.trim_end().len();
        if body_len == 0 {
            self.held_space.push_str(&text);
            return;
        }
        let tail = text[body_len..].to_string();
        let text = std::mem::take(&mut self.held_space) + &text[..body_len];
        self.held_space = tail;
        match out.last_mut() {
            Some(Piece::Text(prev)) => prev.push_str(&text),
            _ => out.push(Piece::Text(text)),
        }
    }
}

/// The length of the longest end of `buf` that could begin `marker`.
fn held_prefix(buf: &str, marker: &str) -> usize {
    (1..marker.len().min(buf.len() + 1))
        .rev()
        .find(|&n| buf.is_char_boundary(buf.len() - n) && marker.starts_with(&buf[buf.len() - n..]))
        .unwrap_or(0)
}

/// A block's JSON as a call; with `names`, only a call to one of them.
fn parse_call(body: &str, names: Option<&[String]>) -> Option<ToolCall> {
    let Value::Object(mut call) = serde_json::from_str::<Value>(body.trim()).ok()? else {
        return None;
    };
    let name = call.get("name")?.as_str()?.to_string();
    if names.is_some_and(|names| !names.contains(&name)) {
        return None;
    }
    let arguments = match call
        .remove("arguments")
        .or_else(|| call.remove("parameters"))
    {
        None => Value::Object(Map::new()),
        // Some models write the arguments as a JSON string.
        Some(Value::String(s)) => serde_json::from_str(&s).ok()?,
        Some(v) => v,
    };
    if !arguments.is_object() {
        return None;
    }
    Some(ToolCall {
        name,
        arguments: arguments.to_string(),
    })
}

impl CallParser {
    /// The pieces of a whole answer.
    pub fn pieces(mut self, text: &str) -> Vec<Piece> {
        let mut pieces = self.push(text);
        pieces.extend(self.finish());
        pieces
    }

    /// The text and calls of a whole answer.
    pub fn split(self, text: &str) -> (String, Vec<ToolCall>) {
        split_pieces(self.pieces(text))
    }
}

fn split_pieces(pieces: Vec<Piece>) -> (String, Vec<ToolCall>) {
    let mut content = String::new();
    let mut calls = Vec::new();
    for p in pieces {
        match p {
            Piece::Text(t) => content.push_str(&t),
            Piece::Call(c) => calls.push(c),
        }
    }
    (content, calls)
}

/// OpenAI history: assistant `tool_calls` with their arguments as objects (templates print
/// them with `tojson`; the API sends JSON text), and every `tool` message answering a call
/// an earlier assistant message made.
pub fn openai_history(messages: &mut [Value]) -> Result<(), ApiError> {
    let mut ids: Vec<String> = Vec::new();
    for (i, m) in messages.iter_mut().enumerate() {
        let at = format!("messages[{i}]");
        match m.get("role").and_then(Value::as_str) {
            Some("assistant") => {
                let Some(calls) = m.get_mut("tool_calls") else {
                    continue;
                };
                if calls.is_null() {
                    continue;
                }
                let Some(calls) = calls.as_array_mut() else {
                    return Err(
                        ApiError::invalid(format!("{at}.tool_calls must be an array"))
                            .param(format!("{at}.tool_calls")),
                    );
                };
                for (j, call) in calls.iter_mut().enumerate() {
                    let cat = format!("{at}.tool_calls[{j}]");
                    let id = call
                        .get("id")
                        .and_then(Value::as_str)
                        .ok_or_else(|| {
                            ApiError::invalid(format!("{cat}.id must be a string"))
                                .param(format!("{cat}.id"))
                        })?
                        .to_string();
                    let f = call
                        .get_mut("function")
                        .and_then(Value::as_object_mut)
                        .ok_or_else(|| {
                            ApiError::invalid(format!("{cat}.function must be an object"))
                                .param(format!("{cat}.function"))
                        })?;
                    if !f.get("name").is_some_and(Value::is_string) {
                        return Err(ApiError::invalid(format!(
                            "{cat}.function.name must be a string"
                        ))
                        .param(format!("{cat}.function.name")));
                    }
                    if let Some(Value::String(args)) = f.get("arguments") {
                        let parsed: Value = serde_json::from_str(args).map_err(|e| {
                            ApiError::invalid(format!(
                                "{cat}.function.arguments is not valid JSON: {e}"
                            ))
                            .param(format!("{cat}.function.arguments"))
                        })?;
                        f.insert("arguments".into(), parsed);
                    }
                    ids.push(id);
                }
            }
            Some("tool") => {
                let id = m
                    .get("tool_call_id")
                    .and_then(Value::as_str)
                    .ok_or_else(|| {
                        ApiError::invalid(format!("{at}.tool_call_id must be a string"))
                            .param(format!("{at}.tool_call_id"))
                    })?;
                if !ids.iter().any(|known| known == id) {
                    return Err(ApiError::invalid(format!(
                        "{at}.tool_call_id {id:?} does not match a tool call of an earlier assistant message"
                    ))
                    .param(format!("{at}.tool_call_id")));
                }
            }
            _ => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weather() -> Value {
        json!({"type": "function", "function": {"name": "get_weather", "strict": true,
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}})
    }

    #[test]
    fn streamed_calls_are_cut_out_of_the_text_wherever_the_chunks_split() {
        let answer = "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": \"{\\\"city\\\": \\\"Rome\\\"}\"}\n</tool_call>";
        for size in [1, 2, 3, 7, 50, answer.len()] {
            let mut parser = CallParser::default();
            let mut pieces = Vec::new();
            let chars: Vec<char> = answer.chars().collect();
            for chunk in chars.chunks(size) {
                pieces.extend(parser.push(&chunk.iter().collect::<String>()));
            }
            pieces.extend(parser.finish());
            let text: String = pieces
                .iter()
                .filter_map(|p| match p {
                    Piece::Text(t) => Some(t.as_str()),
                    Piece::Call(_) => None,
                })
                .collect();
            assert_eq!(text, "Let me look.", "chunks of {size}");
            let calls: Vec<&ToolCall> = pieces
                .iter()
                .filter_map(|p| match p {
                    Piece::Call(c) => Some(c),
                    Piece::Text(_) => None,
                })
                .collect();
            assert_eq!(calls.len(), 2);
            assert_eq!(calls[0].arguments, r#"{"city":"Paris"}"#);
            assert_eq!(calls[1].arguments, r#"{"city":"Rome"}"#);
        }
    }

    #[test]
    fn text_that_only_looks_like_a_call_is_kept() {
        assert_eq!(
            CallParser::default().split("a <tool b"),
            ("a <tool b".to_string(), Vec::new())
        );
        let (text, calls) = CallParser::default().split("<tool_call>not json</tool_call>");
        assert_eq!(text, "<tool_call>not json</tool_call>");
        assert!(calls.is_empty());
        // Cut by max_tokens inside a block: the text as it is.
        let (text, calls) = CallParser::default().split("<tool_call>\n{\"name\": \"f\", \"argu");
        assert_eq!(text, "<tool_call>\n{\"name\": \"f\", \"argu");
        assert!(calls.is_empty());
    }

    #[test]
    fn fenced_json_is_a_call_only_when_it_names_a_requested_tool() {
        let tools = [weather()];
        let parser = || {
            ToolUse::openai(Some(&tools[..]), None, None)
                .unwrap()
                .unwrap()
                .parser()
                .unwrap()
        };
        let answer = "```json\n{\n  \"name\": \"get_weather\",\n  \"arguments\": {\"city\": \"Paris\"}\n}\n```";
        let (text, calls) = parser().split(answer);
        assert_eq!((text.as_str(), calls.len()), ("", 1));
        assert_eq!(calls[0].arguments, r#"{"city":"Paris"}"#);
        // Streamed a character at a time: the same.
        let mut p = parser();
        let mut pieces: Vec<Piece> = answer
            .chars()
            .flat_map(|c| p.push(&c.to_string()))
            .collect();
        pieces.extend(p.finish());
        assert_eq!(split_pieces(pieces), (String::new(), calls));
        // Other JSON in a fence is text, whole.
        let other = "Here:\n```json\n{\"name\": \"x\", \"arguments\": {}}\n```";
        assert_eq!(parser().split(other), (other.to_string(), Vec::new()));
        // Without a request's tools (tags only) a fence is plain text.
        assert_eq!(CallParser::default().split(answer).1, Vec::new());
    }

    #[test]
    fn forced_calls_become_a_grammar_with_the_schemas() {
        let tools = [weather()];
        let use_ = ToolUse::openai(Some(&tools[..]), Some(&json!("required")), Some(false))
            .unwrap()
            .unwrap();
        let Some(pb::constraint::Kind::Lark(lark)) = use_.constraint().unwrap().kind else {
            panic!("a lark grammar")
        };
        assert!(lark.starts_with("start: tool_call\n"), "{lark}");
        assert!(lark.contains(r#""const":"get_weather""#), "{lark}");
        assert!(lark.contains(r#""whitespace_flexible":false"#), "{lark}");
        // auto with a strict tool: text or calls; auto without: free.
        let auto = ToolUse::openai(Some(&tools[..]), None, None)
            .unwrap()
            .unwrap();
        let Some(pb::constraint::Kind::Lark(lark)) = auto.constraint().unwrap().kind else {
            panic!("a lark grammar")
        };
        assert!(
            lark.starts_with("start: TEXT | tool_call (\"\\n\" tool_call){0,7}"),
            "{lark}"
        );
        let mut loose = weather();
        loose["function"]["strict"] = json!(false);
        let loose = [loose];
        let auto = ToolUse::openai(Some(&loose[..]), None, None)
            .unwrap()
            .unwrap();
        assert!(auto.constraint().is_none());
        let none = ToolUse::openai(Some(&loose[..]), Some(&json!("none")), None)
            .unwrap()
            .unwrap();
        assert!(!none.offered() && none.constraint().is_none());
        assert!(none.template_tools().is_some());
    }

    #[test]
    fn bad_tool_definitions_and_choices_are_named() {
        let err = |tools: Value, choice: Option<Value>| {
            let tools = tools.as_array().cloned().unwrap_or_default();
            ToolUse::openai(Some(&tools[..]), choice.as_ref(), None)
                .unwrap_err()
                .message
        };
        let e = err(
            json!([{"type": "function", "function": {"name": "bad name"}}]),
            None,
        );
        assert!(e.contains("tools[0].function.name"), "{e}");
        let e = err(
            json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]),
            None,
        );
        assert!(e.contains("must be \"object\""), "{e}");
        let e = err(
            json!([weather()]),
            Some(json!({"type": "function", "function": {"name": "nope"}})),
        );
        assert!(e.contains("not one of the request's tools"), "{e}");
        let e = err(json!([]), Some(json!("required")));
        assert!(e.contains("defines no tools"), "{e}");
        let e = err(json!([weather(), weather()]), None);
        assert!(e.contains("used twice"), "{e}");
        let e = ToolUse::anthropic(
            Some(&[json!({"type": "web_search_20250305", "name": "web_search"})][..]),
            None,
        )
        .unwrap_err()
        .message;
        assert!(e.contains("server tool"), "{e}");
    }

    #[test]
    fn history_arguments_are_parsed_and_results_must_answer_a_call() {
        let mut messages = vec![
            json!({"role": "user", "content": "hi"}),
            json!({"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]}),
            json!({"role": "tool", "tool_call_id": "call_1", "content": "18 C"}),
        ];
        openai_history(&mut messages).unwrap();
        assert_eq!(
            messages[1]["tool_calls"][0]["function"]["arguments"],
            json!({"city": "Paris"})
        );
        messages[2]["tool_call_id"] = json!("call_9");
        let e = openai_history(&mut messages).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[2].tool_call_id"));
    }

    #[test]
    fn response_formats() {
        assert!(
            response_format(Some(&json!({"type": "text"})))
                .unwrap()
                .is_none()
        );
        let Some(pb::constraint::Kind::JsonSchema(s)) =
            response_format(Some(&json!({"type": "json_object"})))
                .unwrap()
                .and_then(|c| c.kind)
        else {
            panic!("a schema")
        };
        assert!(s.contains(r#""type":"object""#));
        assert!(response_format(Some(&json!({"type": "json_schema"}))).is_err());
        assert!(response_format(Some(&json!({"type": "xml"}))).is_err());
    }
}
