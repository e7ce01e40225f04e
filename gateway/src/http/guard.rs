//! What a web page in the user's browser may do with the local server: nothing, unless the
//! user allowed its origin. Three checks, before any route (the Ollama CVE-2024-28224 class):
//!
//! - **Host.** A page on attacker.example that re-points its name at 127.0.0.1 (DNS rebinding)
//!   sends `Host: attacker.example`. Requests are answered only when addressed to a loopback
//!   name or address, the bind address (any address when bound to all interfaces), or a
//!   configured `allowed_hosts` entry. An IP literal cannot be rebound, so it is safe.
//! - **Origin.** Browsers name the page that sent a request. Requests from another origin are
//!   refused unless that origin is a loopback or allowed host (the dashboard's own origin is)
//!   or listed in `allowed_origins`; those get CORS headers, preflights included.
//! - **Content type.** A page may POST `text/plain` to any address without a preflight. A body
//!   that is not declared JSON is refused with 415, so such a "simple" request never reaches a
//!   handler.
//!
//! Clients that are not browsers (SDKs, agents, curl) send no Origin and address the server by
//! the name they were given, so none of this touches them.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::error::{ApiError, ErrorKind};
use super::flavor_of;

/// Who may address the server, from `bind`, `allowed_hosts` and `allowed_origins`.
#[derive(Debug, Clone)]
pub struct BrowserPolicy {
    bind: SocketAddr,
    /// Host names (lower case, no port) allowed besides loopback and the bind address; "*"
    /// allows any.
    hosts: Vec<String>,
    /// Origins (`scheme://host[:port]`, lower case) allowed besides loopback and allowed
    /// hosts; "*" allows any.
    origins: Vec<String>,
}

impl BrowserPolicy {
    pub fn new(bind: SocketAddr, hosts: &[String], origins: &[String]) -> Self {
        let clean = |v: &[String]| -> Vec<String> {
            v.iter()
                .map(|s| s.trim().trim_end_matches('/').to_ascii_lowercase())
                .filter(|s| !s.is_empty())
                .collect()
        };
        Self {
            bind,
            hosts: clean(hosts),
            origins: clean(origins),
        }
    }

    /// Whether `host` (a Host header or URI authority, port optional) names this server.
    pub fn host_allowed(&self, host: &str) -> bool {
        let name = host_name(host).to_ascii_lowercase();
        if name == "localhost" || name.ends_with(".localhost") {
            return true;
        }
        if let Ok(ip) = name.parse::<IpAddr>() {
            return ip.is_loopback() || ip == self.bind.ip() || self.bind.ip().is_unspecified();
        }
        self.hosts.iter().any(|h| h == "*" || *h == name)
    }

    /// Whether a browser page of `origin` may use the server.
    pub fn origin_allowed(&self, origin: &str) -> bool {
        let origin = origin.trim_end_matches('/').to_ascii_lowercase();
        if self.origins.iter().any(|o| o == "*" || *o == origin) {
            return true;
        }
        // "null" (sandboxed frames, file: pages) and anything that is not http(s) is foreign.
        match origin
            .strip_prefix("http://")
            .or_else(|| origin.strip_prefix("https://"))
        {
            Some(authority) if !authority.is_empty() => self.host_allowed(authority),
            _ => false,
        }
    }
}

/// The host part of `host[:port]`, `[v6]:port` or a bare v6 address.
fn host_name(host: &str) -> &str {
    if let Some(rest) = host.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    match host.rsplit_once(':') {
        // A bare IPv6 address has more than one colon: it has no port to strip.
        Some((name, port)) if !name.contains(':') && port.chars().all(|c| c.is_ascii_digit()) => {
            name
        }
        _ => host,
    }
}

/// Whether a request's declared body type is JSON (`application/json`, `…+json`, parameters
/// allowed).
fn is_json(headers: &HeaderMap) -> bool {
    let Some(value) = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let essence = value
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    essence == "application/json"
        || (essence.starts_with("application/") && essence.ends_with("+json"))
}

/// Whether the request carries a body (a declared length above 0, or a chunked one).
fn has_body(headers: &HeaderMap) -> bool {
    match headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
    {
        Some(n) => n.trim() != "0",
        None => headers.contains_key(header::TRANSFER_ENCODING),
    }
}

fn refuse(path: &str, status: StatusCode, message: String) -> Response {
    ::metrics::counter!("strata_http_refused_total", "reason" => status.as_str().to_string())
        .increment(1);
    tracing::warn!(%path, %status, "{message}");
    let kind = match status {
        StatusCode::UNSUPPORTED_MEDIA_TYPE => ErrorKind::UnsupportedMediaType,
        _ => ErrorKind::Forbidden,
    };
    ApiError::new(kind, message)
        .flavor(flavor_of(path))
        .into_response()
}

/// The middleware: Host, then Origin (with CORS for allowed origins), then content type.
pub async fn browser_guard(
    State(policy): State<Arc<BrowserPolicy>>,
    req: Request,
    next: Next,
) -> Response {
    let path = req.uri().path().to_string();
    // HTTP/2 carries the host as the URI's authority; HTTP/1.1 in the Host header.
    let host = req
        .uri()
        .authority()
        .map(|a| a.as_str().to_string())
        .or_else(|| {
            req.headers()
                .get(header::HOST)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        });
    if let Some(host) = host.filter(|h| !policy.host_allowed(h)) {
        return refuse(
            &path,
            StatusCode::FORBIDDEN,
            format!(
                "requests addressed to host {host:?} are refused: Strata answers requests for \
                 localhost and its bind address (a guard against DNS rebinding); add the name \
                 to allowed_hosts in strata.toml or pass --allow-host"
            ),
        );
    }
    let origin = match req.headers().get(header::ORIGIN) {
        None => None,
        Some(value) => {
            let origin = value.to_str().unwrap_or("").to_string();
            if !policy.origin_allowed(&origin) {
                return refuse(
                    &path,
                    StatusCode::FORBIDDEN,
                    format!(
                        "cross-origin request from {origin:?} refused: a web page may use Strata \
                         only from an origin in allowed_origins (strata.toml or --allow-origin)"
                    ),
                );
            }
            Some(value.clone())
        }
    };
    if let Some(origin) = origin.as_ref().filter(|_| {
        req.method() == Method::OPTIONS
            && req
                .headers()
                .contains_key(header::ACCESS_CONTROL_REQUEST_METHOD)
    }) {
        return preflight(origin.clone(), req.headers());
    }
    let writes = matches!(*req.method(), Method::POST | Method::PUT | Method::PATCH);
    if writes && has_body(req.headers()) && !is_json(req.headers()) {
        let declared = req
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("none")
            .to_string();
        return refuse(
            &path,
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            format!(
                "request bodies must be JSON: send Content-Type: application/json (got {declared})"
            ),
        );
    }
    let mut response = next.run(req).await;
    if let Some(origin) = origin {
        let h = response.headers_mut();
        h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin);
        h.append(header::VARY, HeaderValue::from_static("Origin"));
        h.insert(
            header::ACCESS_CONTROL_EXPOSE_HEADERS,
            HeaderValue::from_static("x-strata-warnings, retry-after"),
        );
    }
    response
}

/// The answer to an allowed origin's CORS preflight.
fn preflight(origin: HeaderValue, headers: &HeaderMap) -> Response {
    let mut response = StatusCode::NO_CONTENT.into_response();
    let h = response.headers_mut();
    h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin);
    h.insert(
        header::ACCESS_CONTROL_ALLOW_METHODS,
        HeaderValue::from_static("GET, POST, OPTIONS"),
    );
    let requested = headers
        .get(header::ACCESS_CONTROL_REQUEST_HEADERS)
        .cloned()
        .unwrap_or_else(|| HeaderValue::from_static("authorization, content-type, x-api-key"));
    h.insert(header::ACCESS_CONTROL_ALLOW_HEADERS, requested);
    h.insert(
        header::ACCESS_CONTROL_MAX_AGE,
        HeaderValue::from_static("600"),
    );
    h.append(header::VARY, HeaderValue::from_static("Origin"));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(bind: &str) -> BrowserPolicy {
        BrowserPolicy::new(
            bind.parse().unwrap(),
            &["strata.lan".into()],
            &["https://app.example.com/".into()],
        )
    }

    #[test]
    fn hosts_are_loopback_the_bind_address_or_configured() {
        let p = policy("127.0.0.1:8080");
        for ok in [
            "localhost:8080",
            "LOCALHOST",
            "dev.localhost:1",
            "127.0.0.1:8080",
            "127.0.0.2",
            "[::1]:8080",
            "::1",
            "strata.lan:8080",
        ] {
            assert!(p.host_allowed(ok), "{ok}");
        }
        for bad in [
            "attacker.example:8080",
            "attacker.example",
            "localhost.attacker.example",
            "192.168.1.5:8080",
            "strata.lan.evil",
        ] {
            assert!(!p.host_allowed(bad), "{bad}");
        }
        // Bound to every interface: any address literal names this server, names still do not.
        let all = policy("0.0.0.0:8080");
        assert!(all.host_allowed("192.168.1.5:8080"));
        assert!(!all.host_allowed("attacker.example"));
    }

    #[test]
    fn origins_are_loopback_allowed_hosts_or_listed() {
        let p = policy("127.0.0.1:8080");
        for ok in [
            "http://127.0.0.1:8080",
            "http://localhost:3000",
            "https://app.example.com",
            "http://strata.lan:8080",
        ] {
            assert!(p.origin_allowed(ok), "{ok}");
        }
        for bad in [
            "null",
            "https://attacker.example",
            "http://app.example.com",
            "file://",
            "",
        ] {
            assert!(!p.origin_allowed(bad), "{bad}");
        }
    }

    #[test]
    fn only_json_bodies_pass() {
        let with = |ct: &str| {
            let mut h = HeaderMap::new();
            h.insert(header::CONTENT_TYPE, HeaderValue::from_str(ct).unwrap());
            is_json(&h)
        };
        assert!(with("application/json"));
        assert!(with("Application/JSON; charset=utf-8"));
        assert!(with("application/vnd.api+json"));
        assert!(!with("text/plain"));
        assert!(!with("application/x-www-form-urlencoded"));
        assert!(!with("multipart/form-data; boundary=x"));
        assert!(!is_json(&HeaderMap::new()));
    }
}
