//! Our chat-template rendering (minijinja) against Python jinja2 configured as transformers'
//! `apply_chat_template` (fixtures/template/templates.json, from gen_template_fixtures.py):
//! byte for byte, for SmolLM2's template and Qwen2.5-Coder's (from their GGUF files), and the
//! published templates of Qwen3, Llama 3.1, Gemma, Phi-3.5, SmolLM3, Mistral Nemo and
//! Ministral 3 (llama.cpp's copies of their tokenizer_config.json), with tools and tool calls
//! where the template renders them. Where jinja2 refuses a conversation (Gemma's system role,
//! Mistral's tool call ids, ...), we must refuse it too.

mod common;

use strata_worker::template::{ChatMessage, ChatTemplate};

#[test]
fn rendered_prompts_equal_jinja2_byte_for_byte() {
    let fixture = common::fixture("template/templates.json");
    let cases = fixture["cases"].as_array().unwrap();
    assert!(cases.len() >= 10);
    let mut failures = Vec::new();
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let t = &fixture["templates"][case["template"].as_str().unwrap()];
        let template = ChatTemplate::new(
            Some(t["source"].as_str().unwrap()),
            t["bos_token"].as_str().unwrap_or(""),
            t["eos_token"].as_str().unwrap_or(""),
        )
        .unwrap();
        let messages: Vec<ChatMessage> = case["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| {
                let mut extra = m.as_object().unwrap().clone();
                let role = extra.remove("role").unwrap().as_str().unwrap().to_string();
                let content = extra.remove("content").unwrap_or(serde_json::Value::Null);
                ChatMessage {
                    role,
                    content,
                    extra,
                }
            })
            .collect();
        let tools = case["tools"].is_array().then_some(&case["tools"]);
        let add = case["add_generation_prompt"].as_bool().unwrap();
        let rendered = template.render(&messages, add, tools);
        if let Some(refusal) = case["expected_error"].as_str() {
            // The template refuses this conversation under jinja2: so must we.
            if let Ok(got) = rendered {
                failures.push(format!(
                    "{name}: jinja2 refused ({refusal}), we rendered {got:?}"
                ));
            }
            continue;
        }
        let expected = case["expected"].as_str().unwrap();
        match rendered {
            Ok(got) if got == expected => {}
            Ok(got) => failures.push(format!(
                "{name}:\n--- expected\n{expected:?}\n--- got\n{got:?}"
            )),
            Err(e) => failures.push(format!("{name}: {e}")),
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} differ:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}
