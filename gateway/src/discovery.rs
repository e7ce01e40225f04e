//! `--model-dir DIR`: finds the models in a folder tree: GGUF files, and safetensors folders
//! (a `config.json` next to `*.safetensors`, also as `org/name` sub-folders, as the Hugging
//! Face cache and LM Studio lay them out). Each gets a stable id: its path below DIR, without
//! the `.gguf` extension, with `/` between folders. The kind comes from the config.

use std::path::{Path, PathBuf};

use crate::config::ModelKind;

/// How deep below DIR to look (DIR/org/name/file is depth 3).
const MAX_DEPTH: usize = 4;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Found {
    pub id: String,
    pub path: PathBuf,
    pub kind: ModelKind,
}

/// Every model below `dir`, sorted by id. Unreadable folders are skipped (and logged).
pub fn scan(dir: &Path) -> std::io::Result<Vec<Found>> {
    let mut out = Vec::new();
    // The top folder must be readable: a typo in the flag is an error, not an empty list.
    std::fs::read_dir(dir)?;
    walk(dir, dir, 0, &mut out);
    out.sort_by(|a, b| a.id.cmp(&b.id));
    Ok(out)
}

fn walk(root: &Path, dir: &Path, depth: usize, out: &mut Vec<Found>) {
    if depth > MAX_DEPTH {
        return;
    }
    if let Some(kind) = folder_kind(dir) {
        if dir != root {
            out.push(Found {
                id: id_of(root, dir),
                path: dir.to_path_buf(),
                kind,
            });
        }
        return;
    }
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) => {
            tracing::warn!(dir = %dir.display(), error = %e, "model discovery skips a folder it cannot read");
            return;
        }
    };
    let mut paths: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
    paths.sort();
    for path in paths {
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if name.starts_with('.') {
            continue;
        }
        if path.is_dir() {
            walk(root, &path, depth + 1, out);
        } else if name.ends_with(".gguf") && !is_split_tail(name) {
            out.push(Found {
                id: id_of(root, &path.with_extension("")),
                path,
                // GGUF files that this server reads are decoder LLMs (llama, qwen2).
                kind: ModelKind::Llm,
            });
        }
    }
}

/// `model-00002-of-00003.gguf`: a later part of a split file, served through its first part.
fn is_split_tail(name: &str) -> bool {
    name.rsplit_once("-of-")
        .and_then(|(head, _)| head.rsplit_once('-'))
        .and_then(|(_, part)| part.parse::<u32>().ok())
        .is_some_and(|part| part > 1)
}

/// The kind of a safetensors model folder, from its `config.json`; None for anything else.
fn folder_kind(dir: &Path) -> Option<ModelKind> {
    let config = std::fs::read(dir.join("config.json")).ok()?;
    let has_weights = std::fs::read_dir(dir).ok()?.any(|e| {
        e.ok()
            .is_some_and(|e| e.path().extension().is_some_and(|x| x == "safetensors"))
    });
    if !has_weights {
        return None;
    }
    let config: serde_json::Value = serde_json::from_slice(&config).ok()?;
    Some(kind_of(&config))
}

/// embedding for BERT-family encoders, vlm when the config has a vision tower, else llm.
pub fn kind_of(config: &serde_json::Value) -> ModelKind {
    use strata_runtime::model_kind::{has_vision_tower, is_bert_encoder};
    if is_bert_encoder(config) {
        ModelKind::Embedding
    } else if has_vision_tower(config) {
        ModelKind::Vlm
    } else {
        ModelKind::Llm
    }
}

fn id_of(root: &Path, path: &Path) -> String {
    let rel = path.strip_prefix(root).unwrap_or(path);
    rel.components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join("/")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn folder(root: &Path, rel: &str, config: &str) {
        let d = root.join(rel);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("config.json"), config).unwrap();
        std::fs::write(d.join("model.safetensors"), b"x").unwrap();
    }

    #[test]
    fn finds_gguf_files_and_safetensors_folders_with_stable_ids_and_kinds() {
        let t = tempfile::tempdir().unwrap();
        let root = t.path();
        std::fs::create_dir_all(root.join("bartowski")).unwrap();
        std::fs::write(root.join("small.Q4_1.gguf"), b"x").unwrap();
        std::fs::write(root.join("bartowski/qwen-00001-of-00002.gguf"), b"x").unwrap();
        std::fs::write(root.join("bartowski/qwen-00002-of-00002.gguf"), b"x").unwrap();
        folder(
            root,
            "sentence-transformers/all-MiniLM-L6-v2",
            r#"{"model_type": "bert"}"#,
        );
        folder(root, "HuggingFaceTB/SmolLM2", r#"{"model_type": "llama"}"#);
        folder(
            root,
            "org/tiny-vlm",
            r#"{"model_type": "llava", "vision_config": {}}"#,
        );
        // A config without weights, and hidden folders, are not models.
        std::fs::create_dir_all(root.join("notes")).unwrap();
        std::fs::write(root.join("notes/config.json"), "{}").unwrap();
        folder(root, ".cache/x", r#"{"model_type": "llama"}"#);

        let found = scan(root).unwrap();
        let got: Vec<(&str, ModelKind)> = found.iter().map(|f| (f.id.as_str(), f.kind)).collect();
        assert_eq!(
            got,
            vec![
                ("HuggingFaceTB/SmolLM2", ModelKind::Llm),
                ("bartowski/qwen-00001-of-00002", ModelKind::Llm),
                ("org/tiny-vlm", ModelKind::Vlm),
                (
                    "sentence-transformers/all-MiniLM-L6-v2",
                    ModelKind::Embedding
                ),
                ("small.Q4_1", ModelKind::Llm),
            ]
        );
        // Stable: the same tree gives the same ids.
        assert_eq!(scan(root).unwrap(), found);
    }

    #[test]
    fn a_missing_folder_is_an_error() {
        assert!(scan(Path::new("/nonexistent/strata-models")).is_err());
    }
}
