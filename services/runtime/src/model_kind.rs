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

/// A vision-language model: the config has a vision tower.
pub fn has_vision_tower(config: &serde_json::Value) -> bool {
    config.get("vision_config").is_some()
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
    }
}
