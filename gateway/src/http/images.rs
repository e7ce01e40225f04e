//! Images in chat requests for vision models: where a request may take them from, and
//! reading them. Inline data (OpenAI `data:` URIs, Anthropic base64 blocks) is always
//! accepted; `file://` URLs only inside the configured image folders (a request must not read
//! arbitrary files of this machine); `http(s)://` URLs only when remote images are enabled.
//! The gateway passes the encoded bytes on; the worker decodes and preprocesses them.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
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
const MAX_REDIRECTS: usize = 5;

/// Where images may come from (from the config).
#[derive(Debug, Clone, Default)]
pub struct ImagePolicy {
    /// Folders whose files `file://` URLs may name, canonicalised.
    pub dirs: Vec<PathBuf>,
    pub allow_remote: bool,
    /// URL hosts (names or addresses, lower case) that remote images may come from although
    /// they are not public addresses: a LAN image server. Every other private, loopback,
    /// link-local or metadata address is refused.
    pub private_hosts: Vec<String>,
}

impl ImagePolicy {
    pub fn new(
        dirs: &[PathBuf],
        allow_remote: bool,
        private_hosts: &[String],
    ) -> std::io::Result<Self> {
        let dirs = dirs
            .iter()
            .map(|d| d.canonicalize())
            .collect::<std::io::Result<_>>()?;
        Ok(Self {
            dirs,
            allow_remote,
            private_hosts: private_hosts
                .iter()
                .map(|h| h.trim().to_ascii_lowercase())
                .collect(),
        })
    }

    fn exempt(&self, host: &str) -> bool {
        let host = host.trim_start_matches('[').trim_end_matches(']');
        self.private_hosts
            .iter()
            .any(|h| h.trim_start_matches('[').trim_end_matches(']') == host)
    }
}

/// Whether `ip` is an address on the public internet: not loopback, private (RFC 1918, ULA),
/// link-local (where cloud metadata services answer), shared (CGNAT), multicast, broadcast,
/// documentation or unspecified, and not an IPv4 address hidden in IPv6.
pub fn is_public(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            let [a, b, ..] = v4.octets();
            !(v4.is_loopback()
                || v4.is_private()
                || v4.is_link_local()
                || v4.is_broadcast()
                || v4.is_documentation()
                || v4.is_unspecified()
                || v4.is_multicast()
                || a == 0
                || (a == 100 && (64..128).contains(&b))
                || (a == 198 && (b == 18 || b == 19))
                || a >= 240)
        }
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return is_public(IpAddr::V4(v4));
            }
            let first = v6.segments()[0];
            !(v6.is_loopback()
                || v6.is_unspecified()
                || v6.is_multicast()
                || (first & 0xfe00) == 0xfc00
                || (first & 0xffc0) == 0xfe80
                || first == 0x2001 && v6.segments()[1] == 0x0db8
                || first == 0x0064 && v6.segments()[1] == 0xff9b)
        }
    }
}

/// Name resolution for image fetches: only public addresses come back (a name that resolves
/// to 127.0.0.1 or 169.254.169.254 is refused after resolution, so DNS cannot smuggle an
/// internal address past a check of the URL), unless the name is exempt.
struct PublicAddresses(Arc<ImagePolicy>);

impl reqwest::dns::Resolve for PublicAddresses {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let policy = self.0.clone();
        Box::pin(async move {
            let host = name.as_str().to_ascii_lowercase();
            let exempt = policy.exempt(&host);
            let found: Vec<SocketAddr> = tokio::net::lookup_host((host.as_str(), 0))
                .await?
                .filter(|a| exempt || is_public(a.ip()))
                .collect();
            if found.is_empty() {
                return Err(format!("{host} has no public address").into());
            }
            Ok(Box::new(found.into_iter()) as reqwest::dns::Addrs)
        })
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
    policy: &Arc<ImagePolicy>,
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

async fn fetch_remote(url: &str, policy: &Arc<ImagePolicy>) -> Result<Vec<u8>, String> {
    if !policy.allow_remote {
        return Err(
            "remote image URLs are refused; send the image inline as a data: URL, or start the \
             server with --allow-remote-images"
                .into(),
        );
    }
    // Whatever went wrong, the client learns only this: neither the status an internal host
    // answered nor why a connection failed (the log has it).
    let uniform = |why: String| {
        tracing::info!(%url, reason = %why, "a remote image was not fetched");
        "the image could not be fetched: it must be on a public http(s) address and at most \
         20 MiB"
            .to_string()
    };
    check_address(url, policy).map_err(uniform)?;
    let redirects = policy.clone();
    let client = reqwest::Client::builder()
        .timeout(FETCH_TIMEOUT)
        // A proxy would resolve names itself, out of reach of the address check.
        .no_proxy()
        .dns_resolver(Arc::new(PublicAddresses(policy.clone())))
        .redirect(reqwest::redirect::Policy::custom(move |attempt| {
            if attempt.previous().len() >= MAX_REDIRECTS {
                return attempt.error("too many redirects");
            }
            match check_address(attempt.url().as_str(), &redirects) {
                Ok(()) => attempt.follow(),
                Err(why) => attempt.error(why),
            }
        }))
        .build()
        .map_err(|e| uniform(e.to_string()))?;
    let mut response = client
        .get(url)
        .send()
        .await
        .map_err(|e| uniform(format!("{e:?}")))?;
    if !response.status().is_success() {
        return Err(uniform(format!("HTTP {}", response.status())));
    }
    let mut bytes = Vec::new();
    while let Some(chunk) = response.chunk().await.map_err(|e| uniform(e.to_string()))? {
        if bytes.len() + chunk.len() > MAX_IMAGE_BYTES {
            return Err(too_big());
        }
        bytes.extend_from_slice(&chunk);
    }
    Ok(bytes)
}

/// A URL's scheme and, when its host is an address, that address (names are checked when
/// they are resolved).
fn check_address(url: &str, policy: &ImagePolicy) -> Result<(), String> {
    let parsed = reqwest::Url::parse(url).map_err(|e| format!("not a URL: {e}"))?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err(format!("scheme {} is not http(s)", parsed.scheme()));
    }
    let host = parsed.host_str().ok_or("no host")?;
    let Ok(ip) = host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .parse::<IpAddr>()
    else {
        return Ok(());
    };
    if is_public(ip) || policy.exempt(&ip.to_string()) {
        Ok(())
    } else {
        Err(format!("{ip} is not a public address"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_public_addresses_are_fetched_from() {
        for private in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "100.64.0.1",
            "0.0.0.0",
            "::1",
            "fe80::1",
            "fd00::1",
            "::ffff:127.0.0.1",
            "::ffff:169.254.169.254",
            "224.0.0.1",
            "255.255.255.255",
        ] {
            assert!(!is_public(private.parse().unwrap()), "{private}");
        }
        for public in ["93.184.216.34", "1.1.1.1", "2606:4700::1111"] {
            assert!(is_public(public.parse().unwrap()), "{public}");
        }
        let policy = ImagePolicy::new(&[], true, &["127.0.0.1".into()]).unwrap();
        assert!(check_address("http://127.0.0.1:9/a.png", &policy).is_ok());
        assert!(check_address("http://[::1]:9/a.png", &policy).is_err());
        assert!(check_address("http://169.254.169.254/latest/meta-data", &policy).is_err());
        assert!(check_address("ftp://example.com/a.png", &policy).is_err());
        // Names pass here; their addresses are checked when they are resolved.
        assert!(check_address("http://localhost:9/a.png", &policy).is_ok());
    }

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
        let policy = ImagePolicy::new(std::slice::from_ref(&allowed), false, &[]).expect("policy");
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
        let err = fetch_remote("http://127.0.0.1:9/a.png", &Arc::new(none))
            .await
            .expect_err("remote off");
        assert!(err.contains("--allow-remote-images"), "{err}");
    }
}
