//! Errors in each API's own shape. One `ApiError` carries what went wrong; `Flavor` decides
//! how it is written: OpenAI's `{"error": {"message", "type", "param", "code"}}` or
//! Anthropic's `{"type": "error", "error": {"type", "message"}}`, with the matching status.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavor {
    OpenAi,
    Anthropic,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    InvalidRequest,
    Authentication,
    /// Refused for who sent it (a foreign Host or browser origin), whatever the key.
    Forbidden,
    NotFound,
    /// A body that is not declared JSON.
    UnsupportedMediaType,
    TooLarge,
    /// This worker's queue is full: retry soon.
    RateLimited,
    /// No worker can take it now (starting, restarting, crashed mid-request).
    Overloaded,
    Timeout,
    /// The client did not send its request in time.
    RequestTimeout,
    Internal,
}

#[derive(Debug, Clone)]
pub struct ApiError {
    pub kind: ErrorKind,
    pub message: String,
    /// The request field at fault, when there is one (OpenAI's `param`).
    pub param: Option<String>,
    /// OpenAI's `code`, e.g. `model_not_found`, `context_length_exceeded`.
    pub code: Option<&'static str>,
    pub flavor: Flavor,
}

impl ApiError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
            param: None,
            code: None,
            flavor: Flavor::OpenAi,
        }
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidRequest, message)
    }

    pub fn param(mut self, param: impl Into<String>) -> Self {
        self.param = Some(param.into());
        self
    }

    pub fn code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    pub fn flavor(mut self, flavor: Flavor) -> Self {
        self.flavor = flavor;
        self
    }

    pub fn status(&self) -> StatusCode {
        match self.kind {
            ErrorKind::InvalidRequest => StatusCode::BAD_REQUEST,
            ErrorKind::Authentication => StatusCode::UNAUTHORIZED,
            ErrorKind::Forbidden => StatusCode::FORBIDDEN,
            ErrorKind::NotFound => StatusCode::NOT_FOUND,
            ErrorKind::UnsupportedMediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ErrorKind::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ErrorKind::RateLimited => StatusCode::TOO_MANY_REQUESTS,
            ErrorKind::Overloaded => StatusCode::SERVICE_UNAVAILABLE,
            ErrorKind::Timeout => StatusCode::GATEWAY_TIMEOUT,
            ErrorKind::RequestTimeout => StatusCode::REQUEST_TIMEOUT,
            ErrorKind::Internal => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    fn openai_type(&self) -> &'static str {
        match self.kind {
            ErrorKind::InvalidRequest
            | ErrorKind::TooLarge
            | ErrorKind::NotFound
            | ErrorKind::UnsupportedMediaType
            | ErrorKind::RequestTimeout => "invalid_request_error",
            ErrorKind::Authentication => "authentication_error",
            ErrorKind::Forbidden => "permission_error",
            ErrorKind::RateLimited => "rate_limit_error",
            ErrorKind::Overloaded | ErrorKind::Timeout | ErrorKind::Internal => "server_error",
        }
    }

    fn anthropic_type(&self) -> &'static str {
        match self.kind {
            ErrorKind::InvalidRequest | ErrorKind::UnsupportedMediaType => "invalid_request_error",
            ErrorKind::Authentication => "authentication_error",
            ErrorKind::Forbidden => "permission_error",
            ErrorKind::NotFound => "not_found_error",
            ErrorKind::TooLarge => "request_too_large",
            ErrorKind::RateLimited => "rate_limit_error",
            ErrorKind::Overloaded => "overloaded_error",
            ErrorKind::Timeout => "timeout_error",
            ErrorKind::RequestTimeout => "invalid_request_error",
            ErrorKind::Internal => "api_error",
        }
    }

    /// The JSON body (also used as the data of a final SSE error event).
    pub fn body(&self) -> serde_json::Value {
        match self.flavor {
            Flavor::OpenAi => json!({
                "error": {
                    "message": self.message,
                    "type": self.openai_type(),
                    "param": self.param,
                    "code": self.code,
                }
            }),
            Flavor::Anthropic => json!({
                "type": "error",
                "error": {"type": self.anthropic_type(), "message": self.message},
            }),
        }
    }

    /// Seconds a client should wait before retrying, for 429 and 503.
    pub fn retry_after(&self) -> Option<u32> {
        match self.kind {
            ErrorKind::RateLimited => Some(1),
            ErrorKind::Overloaded => Some(2),
            _ => None,
        }
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if self.kind == ErrorKind::Internal {
            tracing::error!(message = %self.message, "internal error");
        }
        let mut response = (self.status(), axum::Json(self.body())).into_response();
        if let Some(secs) = self.retry_after() {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }
}

/// A worker's gRPC status as the client should see it.
pub fn from_worker_status(status: &tonic::Status) -> ApiError {
    use tonic::Code;
    let message = status.message().to_string();
    match status.code() {
        Code::InvalidArgument => ApiError::invalid(message),
        Code::OutOfRange => ApiError::invalid(message).code("context_length_exceeded"),
        // Memory admission: the request can never fit this worker.
        Code::FailedPrecondition => {
            ApiError::new(ErrorKind::TooLarge, message).code("memory_budget_exceeded")
        }
        Code::ResourceExhausted => ApiError::new(ErrorKind::RateLimited, message),
        Code::DeadlineExceeded => ApiError::new(ErrorKind::Timeout, "the request took too long"),
        Code::Unimplemented => ApiError::invalid(message),
        Code::Unavailable | Code::Unknown | Code::Cancelled | Code::Aborted => ApiError::new(
            ErrorKind::Overloaded,
            format!(
                "the model's worker stopped while serving this request ({message}); it is being restarted, retry shortly"
            ),
        ),
        _ => ApiError::new(ErrorKind::Internal, format!("worker: {message}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_flavor_has_its_own_shape_and_retry_after() {
        let e = ApiError::new(ErrorKind::NotFound, "no model x").code("model_not_found");
        assert_eq!(e.status(), StatusCode::NOT_FOUND);
        assert_eq!(e.body()["error"]["code"], "model_not_found");
        assert_eq!(e.body()["error"]["type"], "invalid_request_error");
        let a = e.clone().flavor(Flavor::Anthropic);
        assert_eq!(a.body()["type"], "error");
        assert_eq!(a.body()["error"]["type"], "not_found_error");
        let busy = ApiError::new(ErrorKind::RateLimited, "full");
        let r = busy.into_response();
        assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(r.headers()[header::RETRY_AFTER], "1");
    }
}
