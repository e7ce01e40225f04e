//! `strata pull org/name[@rev]`: a model from the Hugging Face Hub into the Hugging Face cache
//! layout (`models--org--name/blobs`, `snapshots/<commit>`, `refs/<rev>`), so that other tools
//! share the download and `--discover` finds it. The transfer is the `hf-hub` crate's
//! (ranged chunks, resumed from its `.sync.part` files, progress bar); what it does not do is
//! here: choosing the files, honouring the environment as `huggingface_hub` does, and checking
//! every LFS file's SHA-256 against the hub's ETag.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use hf_hub::api::tokio::{Api, ApiBuilder, ApiRepo};
use hf_hub::{Cache, Repo, RepoType};
use sha2::{Digest, Sha256};

/// Files a model does not need: the hub's own bookkeeping and documentation.
const SKIPPED: &[&str] = &[
    ".gitattributes",
    "*.md",
    "*.png",
    "*.jpg",
    "*.gif",
    "LICENSE*",
];

pub struct PullRequest {
    /// `org/name`, optionally `@revision` (branch, tag or commit).
    pub spec: String,
    /// Only files matching one of these (`*` wildcards); all model files when empty.
    pub include: Vec<String>,
    /// The hub cache; else $HF_HUB_CACHE, $HF_HOME/hub, ~/.cache/huggingface/hub.
    pub cache_dir: Option<PathBuf>,
    pub progress: bool,
}

/// The hub cache folder `huggingface_hub` itself would use.
pub fn default_cache_dir() -> anyhow::Result<PathBuf> {
    let env = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    env("HF_HUB_CACHE")
        .or_else(|| env("HF_HOME").map(|h| h.join("hub")))
        .or_else(|| env("HOME").map(|h| h.join(".cache/huggingface/hub")))
        .context("no HF_HUB_CACHE, HF_HOME or HOME to put the hub cache in (pass --cache-dir)")
}

fn parse_spec(spec: &str) -> anyhow::Result<(String, String)> {
    let (id, rev) = match spec.split_once('@') {
        Some((id, rev)) => (id, rev),
        None => (spec, "main"),
    };
    let valid = |s: &str| {
        !s.is_empty()
            && s != "."
            && s != ".."
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    };
    match id.split_once('/') {
        Some((org, name)) if valid(org) && valid(name) && !rev.is_empty() => {}
        _ => bail!("{spec:?} is not a model name: expected org/name or org/name@revision"),
    }
    Ok((id.to_string(), rev.to_string()))
}

/// The token as `huggingface_hub` finds it: $HF_TOKEN, else the token file of the cache.
fn token(cache: &Cache) -> Option<String> {
    std::env::var("HF_TOKEN")
        .ok()
        .filter(|t| !t.trim().is_empty())
        .map(|t| t.trim().to_string())
        .or_else(|| cache.token())
}

/// Downloads the model and returns its snapshot folder.
pub async fn pull(req: PullRequest) -> anyhow::Result<PathBuf> {
    let (id, rev) = parse_spec(&req.spec)?;
    let cache_dir = match req.cache_dir {
        Some(d) => d,
        None => default_cache_dir()?,
    };
    std::fs::create_dir_all(&cache_dir)
        .with_context(|| format!("create the hub cache {}", cache_dir.display()))?;
    let cache = Cache::new(cache_dir.clone());
    let mut builder = ApiBuilder::from_cache(cache.clone())
        .with_progress(req.progress)
        // Four 10 MB chunks in flight; a file is resumed from the last one all before it
        // completed.
        .with_max_files(4)
        .with_token(token(&cache));
    let endpoint = std::env::var("HF_ENDPOINT")
        .ok()
        .filter(|e| !e.is_empty())
        .map(|e| e.trim_end_matches('/').to_string());
    if let Some(e) = &endpoint {
        builder = builder.with_endpoint(e.clone());
    }
    let api = builder.build().context("set up the hub client")?;
    let repo = api.repo(Repo::with_revision(
        id.clone(),
        RepoType::Model,
        rev.clone(),
    ));
    let where_ = endpoint.as_deref().unwrap_or("https://huggingface.co");
    let info = repo
        .info()
        .await
        .with_context(|| format!("list {id}@{rev} on {where_}"))?;
    let files: Vec<String> = info
        .siblings
        .into_iter()
        .map(|s| s.rfilename)
        .filter(|f| wanted(f, &req.include))
        .collect();
    if files.is_empty() {
        bail!(
            "{id}@{rev} has no files to download (with --include {:?})",
            req.include
        );
    }
    let mut snapshot = None;
    for file in &files {
        let path = download_checked(&api, &repo, file)
            .await
            .with_context(|| format!("download {file} of {id}@{rev}"))?;
        snapshot = snapshot_of(&path, file);
    }
    snapshot.with_context(|| format!("{id}: no snapshot folder after the download"))
}

fn wanted(file: &str, include: &[String]) -> bool {
    // Nothing outside the snapshot: the hub never lists such names, a hostile mirror might.
    if file.split('/').any(|part| part.is_empty() || part == "..") {
        return false;
    }
    let name = file.rsplit('/').next().unwrap_or(file);
    if include.is_empty() {
        !SKIPPED
            .iter()
            .any(|p| crate::workers::wildcard_match(p, name))
    } else {
        include
            .iter()
            .any(|p| crate::workers::wildcard_match(p, file))
    }
}

/// One file through hf-hub, then its SHA-256 against the ETag when the hub gives one (LFS
/// files: the ETag is the content's SHA-256; small git files have a git hash, not checked).
async fn download_checked(api: &Api, repo: &ApiRepo, file: &str) -> anyhow::Result<PathBuf> {
    let meta = api.metadata(&repo.url(file)).await?;
    let path = repo.download(file).await?;
    let etag = meta.etag();
    if etag.len() == 64 && etag.chars().all(|c| c.is_ascii_hexdigit()) {
        let got = sha256_of(&path)?;
        if !got.eq_ignore_ascii_case(etag) {
            // The blob is wrong: leave nothing behind that a later run would trust.
            let blob = std::fs::canonicalize(&path).ok();
            let _ = std::fs::remove_file(&path);
            if let Some(b) = blob {
                let _ = std::fs::remove_file(b);
            }
            bail!("checksum mismatch: the hub says sha256 {etag}, the download has {got}");
        }
    }
    Ok(path)
}

fn sha256_of(path: &Path) -> anyhow::Result<String> {
    let mut file = std::fs::File::open(path).with_context(|| format!("open {}", path.display()))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = std::io::Read::read(&mut file, &mut buf)
            .with_context(|| format!("read {}", path.display()))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

/// `snapshots/<commit>` from the path of a file in it.
fn snapshot_of(path: &Path, file: &str) -> Option<PathBuf> {
    let depth = file.split('/').count();
    let mut dir = path.to_path_buf();
    for _ in 0..depth {
        dir = dir.parent()?.to_path_buf();
    }
    Some(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_name_a_repository_and_a_revision() {
        assert_eq!(
            parse_spec("HuggingFaceTB/SmolLM2-135M").unwrap(),
            ("HuggingFaceTB/SmolLM2-135M".into(), "main".into())
        );
        assert_eq!(
            parse_spec("org/name@v1.0").unwrap(),
            ("org/name".into(), "v1.0".into())
        );
        for bad in [
            "name",
            "org/",
            "/name",
            "a/b/c",
            "org/na me",
            "../x",
            "org/name@",
        ] {
            assert!(parse_spec(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn model_files_are_chosen_and_paths_stay_inside() {
        let none: Vec<String> = Vec::new();
        assert!(wanted("model.safetensors", &none));
        assert!(wanted("onnx/model.onnx", &none));
        assert!(!wanted("README.md", &none));
        assert!(!wanted(".gitattributes", &none));
        assert!(!wanted("../evil", &none));
        let only = vec!["*Q4_K_M.gguf".to_string()];
        assert!(wanted("qwen-Q4_K_M.gguf", &only));
        assert!(!wanted("qwen-Q8_0.gguf", &only));
    }
}
