//! Images in chat requests for vision models: where a request may take them from, and
//! reading them. Inline data (OpenAI `data:` URIs, Anthropic base64 blocks) is always
//! accepted; `file://` URLs only inside the configured image folders (a request must not read
//! arbitrary files of this machine); `http(s)://` URLs only when remote images are enabled.
//! The gateway passes the encoded bytes on; the worker decodes and preprocesses them.

use std::path::{Path, PathBuf};
use std::time::Duration;

use base64::Engine as _;

use super::error::{ApiError, Flavor};

/// Largest image accepted, encoded.
pub const MAX_IMAGE_BYTES: usize = 20 << 20;
/// Most images one request may carry, and their encoded bytes together. The worker decodes
/// every image (at most 50 megapixels each, its own bound) before the prompt runs.
pub const MAX_IMAGES: usize = 16;
pub const MAX_TOTAL_IMAGE_BYTES: usize = 64 << 20;
const FETCH_TIMEOUT: Duration = Duration::from_secs(20);

/// Where images may come from (from the config).
#[derive(Debug, Clone, Default)]
pub struct ImagePolicy {
    /// Folders whose files `file://` URLs may name, canonicalised.
    pub dirs: Vec<PathBuf>,
    pub allow_remote: bool,
}

impl ImagePolicy {
    pub fn new(dirs: &[PathBuf], allow_remote: bool) -> std::io::Result<Self> {
        let dirs = dirs
            .iter()
            .map(|d| d.canonicalize())
            .collect::<std::io::Result<_>>()?;
        Ok(Self { dirs, allow_remote })
    }
}

/// An image as a request names it.
#[derive(Debug, Clone)]
pub enum ImageSource {
    Inline(Vec<u8>),
    File(PathBuf),
    Remote(String),
}

/// Reads an image URL: `data:<type>;base64,<data>`, `file:///path` or `http(s)://...`.
pub fn parse_url(url: &str) -> Result<ImageSource, String> {
    if let Some(rest) = url.strip_prefix("data:") {
        let (meta, data) = rest
            .split_once(',')
            .ok_or("a data: URL needs a comma before its data")?;
        if !meta.ends_with(";base64") {
            return Err(
                "a data: URL for an image must be base64 (data:image/png;base64,...)".into(),
            );
        }
        return decode_base64(data).map(ImageSource::Inline);
    }
    if let Some(path) = url.strip_prefix("file://") {
        return Ok(ImageSource::File(PathBuf::from(path)));
    }
    if url.starts_with("http://") || url.starts_with("https://") {
        return Ok(ImageSource::Remote(url.to_string()));
    }
    Err("an image URL must be a data: URL, a file:// URL or an http(s):// URL".into())
}

pub fn decode_base64(data: &str) -> Result<Vec<u8>, String> {
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(data.trim())
        .map_err(|e| format!("the image data is not valid base64: {e}"))?;
    if bytes.len() > MAX_IMAGE_BYTES {
        return Err(too_big());
    }
    Ok(bytes)
}

fn too_big() -> String {
    format!("the image is larger than {} MiB", MAX_IMAGE_BYTES >> 20)
}

/// The encoded bytes of every image, in order; a refused or unreadable one is a 400 that
/// names it.
pub async fn load(
    sources: Vec<ImageSource>,
    policy: &ImagePolicy,
    flavor: Flavor,
) -> Result<Vec<Vec<u8>>, ApiError> {
    if sources.len() > MAX_IMAGES {
        return Err(ApiError::invalid(format!(
            "{} images sent, at most {MAX_IMAGES} per request are accepted",
            sources.len()
        ))
        .flavor(flavor));
    }
    let mut out = Vec::with_capacity(sources.len());
    let mut total = 0;
    for (i, source) in sources.into_iter().enumerate() {
        let bytes = match source {
            ImageSource::Inline(b) => Ok(b),
            ImageSource::File(path) => read_local(&path, policy).await,
            ImageSource::Remote(url) => fetch_remote(&url, policy).await,
        }
        .map_err(|e| ApiError::invalid(format!("image {}: {e}", i + 1)).flavor(flavor))?;
        total += bytes.len();
        if total > MAX_TOTAL_IMAGE_BYTES {
            return Err(ApiError::invalid(format!(
                "the images pass {} MiB together, the most one request may carry",
                MAX_TOTAL_IMAGE_BYTES >> 20
            ))
            .flavor(flavor));
        }
        out.push(bytes);
    }
    Ok(out)
}

async fn read_local(path: &Path, policy: &ImagePolicy) -> Result<Vec<u8>, String> {
    if policy.dirs.is_empty() {
        return Err(
            "file:// images are refused: no image folder is configured (--image-dir or image_dirs)"
                .into(),
        );
    }
    // Canonical paths: `..` and symbolic links cannot lead outside the folders.
    let real = tokio::fs::canonicalize(path)
        .await
        .map_err(|e| format!("{}: {e}", path.display()))?;
    if !policy.dirs.iter().any(|d| real.starts_with(d)) {
        return Err(format!(
            "{} is outside the configured image folders",
            path.display()
        ));
    }
    let meta = tokio::fs::metadata(&real)
        .await
        .map_err(|e| format!("{}: {e}", path.display()))?;
    if !meta.is_file() {
        return Err(format!("{} is not a file", path.display()));
    }
    if meta.len() > MAX_IMAGE_BYTES as u64 {
        return Err(too_big());
    }
    tokio::fs::read(&real)
        .await
        .map_err(|e| format!("{}: {e}", path.display()))
}

async fn fetch_remote(url: &str, policy: &ImagePolicy) -> Result<Vec<u8>, String> {
    if !policy.allow_remote {
        return Err(
            "remote image URLs are refused; send the image inline as a data: URL, or start the \
             server with --allow-remote-images"
                .into(),
        );
    }
    let client = reqwest::Client::builder()
        .timeout(FETCH_TIMEOUT)
        .build()
        .map_err(|e| format!("cannot fetch {url}: {e}"))?;
    let mut response = client
        .get(url)
        .send()
        .await
        .map_err(|e| format!("cannot fetch {url}: {e}"))?;
    if !response.status().is_success() {
        return Err(format!("fetching {url} gave HTTP {}", response.status()));
    }
    let mut bytes = Vec::new();
    while let Some(chunk) = response
        .chunk()
        .await
        .map_err(|e| format!("cannot fetch {url}: {e}"))?
    {
        if bytes.len() + chunk.len() > MAX_IMAGE_BYTES {
            return Err(too_big());
        }
        bytes.extend_from_slice(&chunk);
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_read_by_scheme() {
        let ImageSource::Inline(b) = parse_url("data:image/png;base64,aGVsbG8=").expect("data")
        else {
            panic!("inline expected");
        };
        assert_eq!(b, b"hello");
        assert!(matches!(
            parse_url("file:///tmp/a.png"),
            Ok(ImageSource::File(p)) if p == Path::new("/tmp/a.png")
        ));
        assert!(matches!(
            parse_url("http://x/a.png"),
            Ok(ImageSource::Remote(_))
        ));
        assert!(parse_url("data:image/png,raw").is_err());
        assert!(parse_url("data:image/png;base64,@@@").is_err());
        assert!(parse_url("ftp://x/a.png").is_err());
    }

    #[tokio::test]
    async fn local_files_stay_inside_the_image_folders() {
        let root = tempfile::tempdir().expect("tmp");
        let allowed = root.path().join("images");
        std::fs::create_dir(&allowed).expect("mkdir");
        std::fs::write(allowed.join("a.png"), b"png").expect("write");
        std::fs::write(root.path().join("secret.png"), b"secret").expect("write");
        #[cfg(unix)]
        std::os::unix::fs::symlink(root.path().join("secret.png"), allowed.join("link.png"))
            .expect("symlink");
        let policy = ImagePolicy::new(std::slice::from_ref(&allowed), false).expect("policy");
        assert_eq!(
            read_local(&allowed.join("a.png"), &policy)
                .await
                .expect("inside"),
            b"png"
        );
        for outside in [
            allowed.join("../secret.png"),
            allowed.join("link.png"),
            root.path().join("secret.png"),
        ] {
            let err = read_local(&outside, &policy).await.expect_err("outside");
            assert!(err.contains("outside the configured"), "{err}");
        }
        let none = ImagePolicy::default();
        let err = read_local(&allowed.join("a.png"), &none)
            .await
            .expect_err("no folders");
        assert!(err.contains("no image folder"), "{err}");
        let err = fetch_remote("http://127.0.0.1:9/a.png", &none)
            .await
            .expect_err("remote off");
        assert!(err.contains("--allow-remote-images"), "{err}");
    }
}
