//! Chat templates: the model's own Jinja template rendered with `minijinja`, configured as
//! Hugging Face's `apply_chat_template` configures Jinja (trim_blocks, lstrip_blocks, loop
//! controls, `raise_exception`, Python string methods), so that the prompt matches byte for byte.

use minijinja::value::{Kwargs, Serde};
use minijinja::{Environment, ErrorKind, Value};
use serde::Serialize;

/// The template used when a model ships none (and the log says so): ChatML.
pub const CHATML_FALLBACK: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error("chat template does not compile: {0}")]
    Compile(String),
    #[error("chat template failed: {0}")]
    Render(String),
}

/// One message as the template sees it; extra fields (tool calls, names) pass through.
#[derive(Debug, Clone, Serialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: serde_json::Value,
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl ChatMessage {
    pub fn text(role: &str, content: &str) -> Self {
        Self {
            role: role.to_string(),
            content: serde_json::Value::String(content.to_string()),
            extra: serde_json::Map::new(),
        }
    }
}

pub struct ChatTemplate {
    env: Environment<'static>,
    /// True when the model had no template and ChatML stands in.
    pub is_fallback: bool,
    /// The template renders `tools` itself; otherwise `fold_tools` writes them into the
    /// messages.
    pub reads_tools: bool,
    bos_token: String,
    eos_token: String,
}

fn raise_exception(message: String) -> Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
}

impl ChatTemplate {
    /// `source` is the model's template; `None` selects the ChatML fallback.
    pub fn new(
        source: Option<&str>,
        bos_token: &str,
        eos_token: &str,
    ) -> Result<Self, TemplateError> {
        let is_fallback = source.is_none();
        if is_fallback {
            tracing::warn!("the model has no chat template; using ChatML");
        }
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| TemplateError::Compile(e.to_string()))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned("chat", source.unwrap_or(CHATML_FALLBACK).to_string())
            .map_err(|e| TemplateError::Compile(format!("{e:#}")))?;
        Ok(Self {
            env,
            is_fallback,
            reads_tools: source.is_some_and(|s| s.contains("tools")),
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
        })
    }

    /// The prompt text for `messages`; `tools` are passed when the request has some.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        tools: Option<&serde_json::Value>,
    ) -> Result<String, TemplateError> {
        let template = self
            .env
            .get_template("chat")
            .map_err(|e| TemplateError::Render(format!("{e:#}")))?;
        // transformers drops message keys whose value is null before rendering.
        let messages: Vec<serde_json::Value> = messages
            .iter()
            .map(|m| match serde_json::to_value(m) {
                Ok(serde_json::Value::Object(map)) => serde_json::Value::Object(
                    map.into_iter().filter(|(_, v)| !v.is_null()).collect(),
                ),
                Ok(other) => other,
                Err(_) => serde_json::Value::Null,
            })
            .collect();
        let ctx = minijinja::context! {
            messages => Value::from(Serde(messages)),
            add_generation_prompt => add_generation_prompt,
            tools => tools.map(|t| Value::from(Serde(t))),
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
        };
        template
            .render(ctx)
            .map_err(|e| TemplateError::Render(format!("{e:#}")))
    }
}

/// For a template that cannot render a system message after the first message (many check
/// that roles alternate user/assistant): each such message's text joined to the start of the
/// next user message (or, with none after it, the end of the last user message before it).
/// Returns the messages and the positions moved, for the response's notice. Moving the text
/// changes nothing before it, so the prefix cache still serves what precedes it.
pub fn fold_late_system_messages(messages: &[ChatMessage]) -> (Vec<ChatMessage>, Vec<usize>) {
    let mut out: Vec<ChatMessage> = Vec::with_capacity(messages.len());
    let mut moved = Vec::new();
    // Text of late system messages waiting for the next user message.
    let mut pending: Vec<String> = Vec::new();
    for (i, m) in messages.iter().enumerate() {
        if m.role == "system" && i > 0 {
            moved.push(i);
            pending.push(text_of(&m.content));
            continue;
        }
        let mut m = m.clone();
        if m.role == "user" && !pending.is_empty() {
            let head = pending.join("\n\n");
            pending.clear();
            m.content = serde_json::Value::String(format!("{head}\n\n{}", text_of(&m.content)));
        }
        out.push(m);
    }
    if !pending.is_empty() {
        let tail = pending.join("\n\n");
        match out.iter_mut().rev().find(|m| m.role == "user") {
            Some(m) => {
                m.content = serde_json::Value::String(format!("{}\n\n{tail}", text_of(&m.content)));
            }
            None => out.push(ChatMessage::text("user", &tail)),
        }
    }
    (out, moved)
}

/// A message content's text: a string, or the text parts of a list.
fn text_of(content: &serde_json::Value) -> String {
    match content {
        serde_json::Value::String(s) => s.clone(),
        serde_json::Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(serde_json::Value::as_str))
            .collect::<Vec<_>>()
            .join(""),
        _ => String::new(),
    }
}

/// For a template that knows nothing of tools: the conversation with the tools written into
/// the system message and past calls and results written as text, in the Hermes format
/// (`<tools>`, `<tool_call>`, `<tool_response>`) that Qwen and many open models are trained
/// on, and that the gateway reads calls back from.
pub fn fold_tools(messages: &[ChatMessage], tools: Option<&serde_json::Value>) -> Vec<ChatMessage> {
    let tools = tools.and_then(|t| t.as_array()).filter(|t| !t.is_empty());
    let mut listing = String::from(
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n\
         You are provided with function signatures within <tools></tools> XML tags:\n<tools>",
    );
    for tool in tools.into_iter().flatten() {
        listing.push('\n');
        python_json(tool, None, false, 0, &mut listing);
    }
    listing.push_str(
        "\n</tools>\n\nFor each function call, return a json object with function name and \
         arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n\
         {\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>",
    );
    let mut out: Vec<ChatMessage> = Vec::with_capacity(messages.len() + 1);
    let mut skip = 0;
    if tools.is_some() {
        match messages.first() {
            Some(first) if first.role == "system" => {
                let text = first.content.as_str().unwrap_or_default();
                out.push(ChatMessage::text("system", &format!("{text}\n\n{listing}")));
                skip = 1;
            }
            _ => out.push(ChatMessage::text("system", &listing)),
        }
    }
    for m in &messages[skip..] {
        match m.role.as_str() {
            "assistant" if m.extra.contains_key("tool_calls") => {
                let mut text = m.content.as_str().unwrap_or_default().to_string();
                let calls = m.extra.get("tool_calls").and_then(|c| c.as_array());
                for call in calls.into_iter().flatten() {
                    let f = call.get("function").unwrap_or(call);
                    let body = serde_json::json!({
                        "name": f.get("name").cloned().unwrap_or_default(),
                        "arguments": f.get("arguments").cloned().unwrap_or_default(),
                    });
                    if !text.is_empty() {
                        text.push('\n');
                    }
                    text.push_str("<tool_call>\n");
                    python_json(&body, None, false, 0, &mut text);
                    text.push_str("\n</tool_call>");
                }
                out.push(ChatMessage::text("assistant", &text));
            }
            "tool" => {
                let result = format!(
                    "<tool_response>\n{}\n</tool_response>",
                    m.content.as_str().unwrap_or_default()
                );
                // Results of one turn's calls go together in one user message.
                match out.last_mut() {
                    Some(prev)
                        if prev.role == "user"
                            && prev
                                .content
                                .as_str()
                                .is_some_and(|t| t.ends_with("</tool_response>")) =>
                    {
                        let joined =
                            format!("{}\n{result}", prev.content.as_str().unwrap_or_default());
                        prev.content = serde_json::Value::String(joined);
                    }
                    _ => out.push(ChatMessage::text("user", &result)),
                }
            }
            _ => out.push(m.clone()),
        }
    }
    out
}

/// `tojson` as transformers defines it (`json.dumps(x, ensure_ascii=False, indent=...)`), not
/// minijinja's HTML-safe builtin: templates print tool schemas with it, and the model was
/// trained on Python's exact spelling (`", "` and `": "` separators, no `<` escaping).
fn tojson(value: Value, kwargs: Kwargs) -> Result<String, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&value)
        .map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    let mut out = String::new();
    python_json(&json, indent, sort_keys.unwrap_or(false), 0, &mut out);
    Ok(out)
}

fn python_json(
    v: &serde_json::Value,
    indent: Option<usize>,
    sort: bool,
    depth: usize,
    out: &mut String,
) {
    use serde_json::Value as J;
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    match v {
        J::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                python_json(item, indent, sort, depth + 1, out);
            }
            newline(out, depth);
            out.push(']');
        }
        J::Object(map) if !map.is_empty() => {
            let mut entries: Vec<(&String, &serde_json::Value)> = map.iter().collect();
            if sort {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            out.push('{');
            for (i, (k, item)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                out.push_str(&J::String(k.clone()).to_string());
                out.push_str(": ");
                python_json(item, indent, sort, depth + 1, out);
            }
            newline(out, depth);
            out.push('}');
        }
        J::Array(_) => out.push_str("[]"),
        J::Object(_) => out.push_str("{}"),
        J::Number(n) if n.is_f64() => {
            // Python prints integral floats with ".0", as serde_json does.
            out.push_str(&n.to_string());
        }
        other => out.push_str(&other.to_string()),
    }
}

/// `strftime_now(format)` as transformers provides it (Llama 3 templates print the date).
fn strftime_now(format: String) -> String {
    // Only the formats templates use in practice; anything else is returned as written.
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    let (y, m, d) = civil_from_days(secs.div_euclid(86_400));
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
        .replace("%Y", &y.to_string())
        .replace("%m", &format!("{m:02}"))
        .replace("%d", &format!("{d:02}"))
        .replace("%B", MONTHS[(m - 1) as usize])
        .replace("%b", &MONTHS[(m - 1) as usize][..3])
}

/// Days since 1970-01-01 to (year, month, day), proleptic Gregorian (Howard Hinnant's method).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

#[cfg(test)]
mod tests {
    #[test]
    fn late_system_messages_join_the_next_user_message() {
        use super::{ChatMessage, fold_late_system_messages};
        let m = |r: &str, c: &str| ChatMessage::text(r, c);
        let (out, moved) = fold_late_system_messages(&[
            m("system", "rules"),
            m("user", "hi"),
            m("system", "env"),
            m("user", "next"),
            m("assistant", "ok"),
            m("system", "late"),
        ]);
        assert_eq!(moved, vec![2, 5]);
        let roles: Vec<&str> = out.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "user", "assistant"]);
        assert_eq!(out[2].content, "env\n\nnext\n\nlate");
    }

    use super::*;

    #[test]
    fn chatml_fallback_renders_a_generation_prompt() {
        let t = ChatTemplate::new(None, "", "").unwrap();
        assert!(t.is_fallback);
        let out = t
            .render(&[ChatMessage::text("user", "hi")], true, None)
            .unwrap();
        assert_eq!(
            out,
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn raise_exception_becomes_a_render_error() {
        let t = ChatTemplate::new(Some("{{ raise_exception('no system role') }}"), "", "").unwrap();
        let err = t.render(&[], false, None).unwrap_err();
        assert!(err.to_string().contains("no system role"), "{err}");
    }

    #[test]
    fn tools_are_folded_into_a_template_without_them() {
        let tools = serde_json::json!([{"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
        let mut call = ChatMessage::text("assistant", "");
        call.extra.insert(
            "tool_calls".into(),
            serde_json::json!([{"id": "c1", "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]),
        );
        let mut result = ChatMessage::text("tool", "18 C");
        result
            .extra
            .insert("tool_call_id".into(), serde_json::json!("c1"));
        let messages = vec![
            ChatMessage::text("system", "Be brief."),
            ChatMessage::text("user", "Weather in Paris?"),
            call,
            result,
        ];
        let folded = fold_tools(&messages, Some(&tools));
        let roles: Vec<&str> = folded.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "user"]);
        let system = folded[0].content.as_str().unwrap();
        assert!(system.starts_with("Be brief.\n\n# Tools"), "{system}");
        assert!(system.contains(r#"{"type": "function", "function": {"name": "get_weather""#));
        assert_eq!(
            folded[2].content,
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"
        );
        assert_eq!(folded[3].content, "<tool_response>\n18 C\n</tool_response>");
        // Without tools offered, past calls and results are still written out.
        let folded = fold_tools(&messages, None);
        assert_eq!(folded.len(), 4);
        assert_eq!(folded[0].content, "Be brief.");
        assert!(
            folded[2]
                .content
                .as_str()
                .unwrap()
                .starts_with("<tool_call>")
        );
        assert!(!ChatTemplate::new(None, "", "").unwrap().reads_tools);
    }

    #[test]
    fn civil_dates() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(20_422), (2025, 11, 30));
    }
}
