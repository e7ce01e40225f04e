//! `--model-dir DIR`: finds the models in a folder tree. Three layouts are read:
//! - a plain tree (LM Studio's models folder, a folder of downloads): GGUF files, and
//!   safetensors folders (a `config.json` next to `*.safetensors`), each under its path below
//!   DIR, without `.gguf`, with `/` between folders;
//! - the Hugging Face hub cache (`models--org--name/snapshots/<rev>/`, files symlinked into
//!   `blobs/`): the revision `refs/main` names, offered as `org/name` (a GGUF file inside as
//!   `org/name/<file>`);
//! - Ollama's store (`manifests/<host>/<namespace>/<name>/<tag>` naming GGUF blobs in
//!   `blobs/`): offered under the Ollama name, `name:tag` for its own library.
//!
//! `--discover` adds the places those tools use on this machine (`standard_dirs`). The kind
//! comes from the config.

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
    let names: Vec<String> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    if names.iter().any(|n| n.starts_with("models--")) {
        scan_hf_cache(dir, &names, &mut out);
    } else if dir.join("manifests").is_dir() && dir.join("blobs").is_dir() {
        scan_ollama(dir, &mut out);
    } else {
        walk(dir, dir, "", 0, &mut out);
    }
    out.sort_by(|a, b| a.id.cmp(&b.id));
    Ok(out)
}

/// Where the Hugging Face cache, LM Studio and Ollama keep models on this machine, as their
/// own environment variables and defaults say; only folders that exist.
pub fn standard_dirs() -> Vec<PathBuf> {
    let env = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    let home = env("HOME");
    let under_home = |rel: &str| home.as_ref().map(|h| h.join(rel));
    let hf = env("HF_HUB_CACHE")
        .or_else(|| env("HF_HOME").map(|h| h.join("hub")))
        .or_else(|| under_home(".cache/huggingface/hub"));
    let candidates = [
        hf,
        under_home(".lmstudio/models"),
        under_home(".cache/lm-studio/models"),
        env("OLLAMA_MODELS").or_else(|| under_home(".ollama/models")),
    ];
    let mut dirs: Vec<PathBuf> = Vec::new();
    for dir in candidates.into_iter().flatten() {
        if dir.is_dir() && !dirs.contains(&dir) {
            dirs.push(dir);
        }
    }
    dirs
}

/// `models--org--name/snapshots/<rev>/`: the revision `refs/main` points at, else the most
/// recently written snapshot.
fn scan_hf_cache(root: &Path, names: &[String], out: &mut Vec<Found>) {
    let mut names: Vec<&String> = names.iter().filter(|n| n.starts_with("models--")).collect();
    names.sort();
    for name in names {
        let repo = root.join(name);
        let id = name["models--".len()..].replacen("--", "/", 1);
        let Some(snapshot) = hf_snapshot(&repo) else {
            tracing::info!(repo = %repo.display(), "model discovery: no snapshot in a hub cache entry");
            continue;
        };
        if let Some(kind) = folder_kind(&snapshot) {
            out.push(Found {
                id: id.clone(),
                path: snapshot.clone(),
                kind,
            });
        }
        // GGUF repositories hold one file per quantisation, sometimes in sub-folders.
        walk(&snapshot, &snapshot, &id, 0, out);
    }
}

fn hf_snapshot(repo: &Path) -> Option<PathBuf> {
    let snapshots = repo.join("snapshots");
    if let Ok(rev) = std::fs::read_to_string(repo.join("refs/main")) {
        let dir = snapshots.join(rev.trim());
        if dir.is_dir() {
            return Some(dir);
        }
    }
    std::fs::read_dir(&snapshots)
        .ok()?
        .filter_map(|e| e.ok())
        .filter(|e| e.path().is_dir())
        .max_by_key(|e| e.metadata().and_then(|m| m.modified()).ok())
        .map(|e| e.path())
}

/// The media type of the layer that holds an Ollama model's GGUF weights.
const OLLAMA_MODEL_LAYER: &str = "application/vnd.ollama.image.model";
/// Ollama's own registry, left out of the names it shows (`library/` too).
const OLLAMA_REGISTRY: &str = "registry.ollama.ai";

/// `manifests/<host>/<namespace>/<name>/<tag>`: JSON naming the weights layer by digest, held
/// in `blobs/sha256-<hex>`.
fn scan_ollama(root: &Path, out: &mut Vec<Found>) {
    let manifests = root.join("manifests");
    let mut files = Vec::new();
    collect_files(&manifests, 0, &mut files);
    files.sort();
    for manifest in files {
        let Some(rel) = manifest.strip_prefix(&manifests).ok() else {
            continue;
        };
        let parts: Vec<String> = rel
            .components()
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .collect();
        let [host, namespace, name, tag] = parts.as_slice() else {
            continue;
        };
        let id = match (host.as_str(), namespace.as_str()) {
            (OLLAMA_REGISTRY, "library") => format!("{name}:{tag}"),
            (OLLAMA_REGISTRY, _) => format!("{namespace}/{name}:{tag}"),
            _ => format!("{host}/{namespace}/{name}:{tag}"),
        };
        match ollama_weights(root, &manifest) {
            Ok(path) => out.push(Found {
                id,
                path,
                kind: ModelKind::Llm,
            }),
            Err(why) => {
                tracing::warn!(manifest = %manifest.display(), %why, "model discovery skips an Ollama model")
            }
        }
    }
}

fn ollama_weights(root: &Path, manifest: &Path) -> Result<PathBuf, String> {
    let text = std::fs::read(manifest).map_err(|e| e.to_string())?;
    let manifest: serde_json::Value =
        serde_json::from_slice(&text).map_err(|e| format!("not a manifest: {e}"))?;
    let digest = manifest["layers"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|l| l["mediaType"] == OLLAMA_MODEL_LAYER)
        .and_then(|l| l["digest"].as_str())
        .ok_or("no model layer")?;
    // Digests are `sha256:<hex>`; a name with a path in it is not one.
    let file = digest.replacen(':', "-", 1);
    if file.contains('/') || file.contains("..") {
        return Err(format!("odd digest {digest:?}"));
    }
    let blob = root.join("blobs").join(file);
    if blob.is_file() {
        Ok(blob)
    } else {
        Err(format!("blob {} missing", blob.display()))
    }
}

fn collect_files(dir: &Path, depth: usize, out: &mut Vec<PathBuf>) {
    if depth > MAX_DEPTH {
        return;
    }
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for path in entries.filter_map(|e| e.ok().map(|e| e.path())) {
        if path.is_dir() {
            collect_files(&path, depth + 1, out);
        } else {
            out.push(path);
        }
    }
}

/// A plain tree below `root`; ids are `prefix/` (when not empty) and the path below `root`.
fn walk(root: &Path, dir: &Path, prefix: &str, depth: usize, out: &mut Vec<Found>) {
    if depth > MAX_DEPTH {
        return;
    }
    if let Some(kind) = folder_kind(dir) {
        if dir != root {
            out.push(Found {
                id: id_of(root, dir, prefix),
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
            walk(root, &path, prefix, depth + 1, out);
        } else if name.ends_with(".gguf") && !is_split_tail(name) {
            out.push(Found {
                id: id_of(root, &path.with_extension(""), prefix),
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

fn id_of(root: &Path, path: &Path, prefix: &str) -> String {
    let rel = path.strip_prefix(root).unwrap_or(path);
    let parts = std::iter::once(prefix.to_string())
        .filter(|p| !p.is_empty())
        .chain(
            rel.components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned()),
        );
    parts.collect::<Vec<_>>().join("/")
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

    /// A hub cache entry as `huggingface_hub` writes it: files are symlinks into `blobs/`.
    fn hub_entry(root: &Path, repo: &str, rev: &str, files: &[(&str, &str)]) -> PathBuf {
        let entry = root.join(format!("models--{}", repo.replace('/', "--")));
        let snapshot = entry.join("snapshots").join(rev);
        std::fs::create_dir_all(entry.join("blobs")).unwrap();
        std::fs::create_dir_all(entry.join("refs")).unwrap();
        for (name, content) in files {
            let blob = entry
                .join("blobs")
                .join(format!("{:x}", name.len() * 7919 + content.len()));
            std::fs::write(&blob, content).unwrap();
            let link = snapshot.join(name);
            std::fs::create_dir_all(link.parent().unwrap()).unwrap();
            let depth = name.matches('/').count() + 2;
            let target = format!(
                "{}blobs/{}",
                "../".repeat(depth),
                blob.file_name().unwrap().to_string_lossy()
            );
            std::os::unix::fs::symlink(target, &link).unwrap();
        }
        snapshot
    }

    #[test]
    fn reads_the_hugging_face_cache_layout_at_the_revision_main_names() {
        let t = tempfile::tempdir().unwrap();
        let root = t.path();
        let config = r#"{"model_type": "qwen3"}"#;
        let old = hub_entry(
            root,
            "Qwen/Qwen3-0.6B",
            "aaa",
            &[("config.json", config), ("model.safetensors", "w")],
        );
        let main = hub_entry(
            root,
            "Qwen/Qwen3-0.6B",
            "bbb",
            &[("config.json", config), ("model.safetensors", "w2")],
        );
        std::fs::write(root.join("models--Qwen--Qwen3-0.6B/refs/main"), "bbb").unwrap();
        let gguf = hub_entry(
            root,
            "bartowski/Llama-3.2-1B-Instruct-GGUF",
            "ccc",
            &[
                ("Llama-3.2-1B-Instruct-Q4_K_M.gguf", "g"),
                ("Q8/Llama-3.2-1B-Instruct-Q8_0.gguf", "g8"),
                ("README.md", "r"),
            ],
        );
        // A dataset entry and an entry without snapshots are not models.
        std::fs::create_dir_all(root.join("datasets--x--y/snapshots/1")).unwrap();
        std::fs::create_dir_all(root.join("models--org--empty")).unwrap();

        let found = scan(root).unwrap();
        let got: Vec<(&str, &Path)> = found
            .iter()
            .map(|f| (f.id.as_str(), f.path.as_path()))
            .collect();
        assert_eq!(
            got,
            vec![
                ("Qwen/Qwen3-0.6B", main.as_path()),
                (
                    "bartowski/Llama-3.2-1B-Instruct-GGUF/Llama-3.2-1B-Instruct-Q4_K_M",
                    gguf.join("Llama-3.2-1B-Instruct-Q4_K_M.gguf").as_path()
                ),
                (
                    "bartowski/Llama-3.2-1B-Instruct-GGUF/Q8/Llama-3.2-1B-Instruct-Q8_0",
                    gguf.join("Q8/Llama-3.2-1B-Instruct-Q8_0.gguf").as_path()
                ),
            ]
        );
        assert_ne!(found[0].path, old);
        // Without refs/main the newest snapshot serves.
        std::fs::remove_file(root.join("models--Qwen--Qwen3-0.6B/refs/main")).unwrap();
        let found = scan(root).unwrap();
        assert!(
            found[0]
                .path
                .starts_with(root.join("models--Qwen--Qwen3-0.6B/snapshots"))
        );
    }

    #[test]
    fn reads_the_ollama_store_under_ollama_names() {
        let t = tempfile::tempdir().unwrap();
        let root = t.path();
        std::fs::create_dir_all(root.join("blobs")).unwrap();
        let manifest = |rel: &str, digest: &str| {
            let path = root.join("manifests").join(rel);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            let body = serde_json::json!({
                "schemaVersion": 2,
                "config": {"mediaType": "application/vnd.docker.container.image.v1+json", "digest": "sha256:cfg"},
                "layers": [
                    {"mediaType": "application/vnd.ollama.image.model", "digest": digest, "size": 4},
                    {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:t", "size": 1},
                ],
            });
            std::fs::write(path, body.to_string()).unwrap();
        };
        std::fs::write(root.join("blobs/sha256-aa11"), b"GGUF").unwrap();
        std::fs::write(root.join("blobs/sha256-bb22"), b"GGUF").unwrap();
        manifest("registry.ollama.ai/library/smollm2/135m", "sha256:aa11");
        manifest("registry.ollama.ai/someone/coder/latest", "sha256:bb22");
        manifest("hf.co/bartowski/Qwen3-GGUF/Q4_K_M", "sha256:bb22");
        // A manifest whose blob is gone, or that names a path, is skipped.
        manifest("registry.ollama.ai/library/gone/latest", "sha256:cc33");
        manifest(
            "registry.ollama.ai/library/evil/latest",
            "sha256:../../etc/passwd",
        );

        let found = scan(root).unwrap();
        let got: Vec<(&str, PathBuf)> = found
            .iter()
            .map(|f| (f.id.as_str(), f.path.clone()))
            .collect();
        assert_eq!(
            got,
            vec![
                (
                    "hf.co/bartowski/Qwen3-GGUF:Q4_K_M",
                    root.join("blobs/sha256-bb22")
                ),
                ("smollm2:135m", root.join("blobs/sha256-aa11")),
                ("someone/coder:latest", root.join("blobs/sha256-bb22")),
            ]
        );
    }

    #[test]
    fn a_missing_folder_is_an_error() {
        assert!(scan(Path::new("/nonexistent/strata-models")).is_err());
    }
}
