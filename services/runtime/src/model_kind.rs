//! What a Hugging Face `config.json` describes. The gateway (model discovery) and the worker
//! (what to serve from a folder) read it the same way through these.

/// A BERT-family encoder (served as an embedding model).
pub fn is_bert_encoder(config: &serde_json::Value) -> bool {
    let bert_arch = config["architectures"].as_array().is_some_and(|a| {
        a.iter()
            .any(|x| x.as_str().is_some_and(|s| s.starts_with("Bert")))
    });
    config["model_type"].as_str() == Some("bert") || bert_arch
}

/// Vision-language checkpoints whose text decoder the worker serves as a chat model, leaving
/// the vision tower out (the worker logs it and refuses images).
const TEXT_DECODER_SERVED: [&str; 4] = ["gemma3", "mistral3", "qwen3_5", "qwen3_5_moe"];

/// A vision-language model served as one (LLaVA): the config has a vision tower, and is not
/// one of the checkpoints whose text decoder is served alone.
pub fn has_vision_tower(config: &serde_json::Value) -> bool {
    let text_only = config["model_type"]
        .as_str()
        .is_some_and(|t| TEXT_DECODER_SERVED.contains(&t));
    config.get("vision_config").is_some() && !text_only
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn kinds_from_configs() {
        assert!(is_bert_encoder(&json!({"model_type": "bert"})));
        assert!(is_bert_encoder(&json!({"architectures": ["BertModel"]})));
        assert!(!is_bert_encoder(&json!({"model_type": "llama"})));
        assert!(has_vision_tower(&json!({"vision_config": {}})));
        assert!(!has_vision_tower(&json!({"model_type": "qwen2"})));
        // Served as text decoders (the worker leaves their vision towers out).
        for t in ["gemma3", "mistral3", "qwen3_5", "qwen3_5_moe"] {
            assert!(!has_vision_tower(
                &json!({"model_type": t, "vision_config": {}})
            ));
        }
        assert!(has_vision_tower(
            &json!({"model_type": "llava", "vision_config": {}})
        ));
    }
}
