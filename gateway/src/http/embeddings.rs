//! OpenAI's `POST /v1/embeddings`: a string, a list of strings, a list of token ids or a list
//! of lists of token ids; vectors as floats or base64 (little-endian f32, as OpenAI sends them).

use axum::body::Body;
use axum::extract::State;
use axum::response::Json;
use base64::Engine as _;
use serde::Deserialize;
use serde_json::{Value, json};
use strata_proto::worker as pb;

use super::AppState;
use super::error::{ApiError, Flavor, from_worker_status};
use super::generation::read_json;
use crate::config::ModelKind;

const FLAVOR: Flavor = Flavor::OpenAi;

/// OpenAI's limit on inputs per request.
const MAX_INPUTS: usize = 2048;

#[derive(Debug, Deserialize, utoipa::ToSchema)]
pub struct EmbeddingsRequest {
    model: String,
    input: Value,
    encoding_format: Option<String>,
    dimensions: Option<i64>,
}

#[utoipa::path(post, path = "/v1/embeddings", tag = "OpenAI",
    request_body = EmbeddingsRequest,
    responses(
        (status = 200, description = "One vector per input, as floats or base64"),
        super::openapi::ErrorResponses,
    ))]
pub async fn embeddings(
    State(state): State<AppState>,
    body: Body,
) -> Result<Json<Value>, ApiError> {
    let req: EmbeddingsRequest = read_json(body, state.max_body_bytes, FLAVOR).await?;
    let base64 = match req.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(ApiError::invalid(format!(
                "encoding_format must be \"float\" or \"base64\", not {other:?}"
            ))
            .param("encoding_format"));
        }
    };
    let dimensions = match req.dimensions {
        None => 0,
        Some(d) if (1..=u32::MAX as i64).contains(&d) => d as u32,
        Some(d) => {
            return Err(
                ApiError::invalid(format!("dimensions must be at least 1, not {d}"))
                    .param("dimensions"),
            );
        }
    };
    let inputs = parse_input(&req.input)?;
    let model = state.registry.resolve(&req.model)?;
    if model.kind != ModelKind::Embedding {
        return Err(ApiError::invalid(format!(
            "model {} is not an embedding model (it is an {:?} model); choose an embedding model from /v1/models",
            req.model, model.kind
        ))
        .param("model"));
    }
    let (mut client, _in_flight) = state.registry.acquire(&model).await?;
    let mut grpc = tonic::Request::new(pb::EmbedRequest { inputs, dimensions });
    grpc.set_timeout(state.request_timeout);
    strata_runtime::logging::inject(&mut grpc);
    let answer = client
        .embed(grpc)
        .await
        .map_err(|s| from_worker_status(&s))?
        .into_inner();
    let data: Vec<Value> = answer
        .embeddings
        .iter()
        .enumerate()
        .map(|(index, e)| {
            let embedding = if base64 {
                let bytes: Vec<u8> = e.values.iter().flat_map(|v| v.to_le_bytes()).collect();
                Value::String(base64::engine::general_purpose::STANDARD.encode(bytes))
            } else {
                json!(e.values)
            };
            json!({"object": "embedding", "index": index, "embedding": embedding})
        })
        .collect();
    Ok(Json(json!({
        "object": "list",
        "data": data,
        "model": req.model,
        "usage": {"prompt_tokens": answer.prompt_tokens, "total_tokens": answer.prompt_tokens},
    })))
}

/// OpenAI's four input shapes, checked: no empty input, no more than `MAX_INPUTS`, token ids
/// that are integers in range.
fn parse_input(input: &Value) -> Result<Vec<pb::EmbedInput>, ApiError> {
    let bad = |why: String| ApiError::invalid(why).param("input");
    let text = |s: &str, at: String| -> Result<pb::EmbedInput, ApiError> {
        if s.is_empty() {
            return Err(bad(format!("{at} must not be an empty string")));
        }
        Ok(pb::EmbedInput {
            input: Some(pb::embed_input::Input::Text(s.to_string())),
        })
    };
    let ids = |list: &[Value], at: String| -> Result<pb::EmbedInput, ApiError> {
        if list.is_empty() {
            return Err(bad(format!("{at} must not be an empty list of token ids")));
        }
        let ids = list
            .iter()
            .map(|v| {
                v.as_u64()
                    .and_then(|n| u32::try_from(n).ok())
                    .ok_or_else(|| bad(format!("{at} holds {v}, which is not a token id")))
            })
            .collect::<Result<Vec<u32>, ApiError>>()?;
        Ok(pb::EmbedInput {
            input: Some(pb::embed_input::Input::TokenIds(pb::TokenIds { ids })),
        })
    };
    match input {
        Value::String(s) => Ok(vec![text(s, "input".into())?]),
        Value::Array(items) if items.is_empty() => Err(bad("input must not be empty".into())),
        Value::Array(items) if items.len() > MAX_INPUTS => Err(bad(format!(
            "input holds {} items; at most {MAX_INPUTS} are allowed per request",
            items.len()
        ))),
        // One input given as token ids.
        Value::Array(items) if items.iter().all(Value::is_number) => {
            Ok(vec![ids(items, "input".into())?])
        }
        Value::Array(items) => items
            .iter()
            .enumerate()
            .map(|(i, item)| match item {
                Value::String(s) => text(s, format!("input[{i}]")),
                Value::Array(list) => ids(list, format!("input[{i}]")),
                other => Err(bad(format!(
                    "input[{i}] must be a string or a list of token ids, not {other}"
                ))),
            })
            .collect(),
        other => Err(bad(format!(
            "input must be a string, a list of strings or token ids, not {other}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kinds(v: Value) -> Result<Vec<&'static str>, ApiError> {
        Ok(parse_input(&v)?
            .into_iter()
            .map(|i| match i.input {
                Some(pb::embed_input::Input::Text(_)) => "text",
                Some(pb::embed_input::Input::TokenIds(_)) => "ids",
                None => "none",
            })
            .collect())
    }

    #[test]
    fn the_four_input_shapes_parse() {
        assert_eq!(kinds(json!("hi")).unwrap(), vec!["text"]);
        assert_eq!(kinds(json!(["a", "b"])).unwrap(), vec!["text", "text"]);
        assert_eq!(kinds(json!([1, 2, 3])).unwrap(), vec!["ids"]);
        assert_eq!(kinds(json!([[1], [2, 3]])).unwrap(), vec!["ids", "ids"]);
        assert_eq!(kinds(json!(["a", [2]])).unwrap(), vec!["text", "ids"]);
    }

    #[test]
    fn bad_inputs_are_refused() {
        for v in [
            json!(""),
            json!([]),
            json!([""]),
            json!([[]]),
            json!([-1]),
            json!([1.5]),
            json!([[4294967296u64]]),
            json!({"text": "x"}),
            json!([null]),
            json!(vec!["x"; MAX_INPUTS + 1]),
        ] {
            assert!(kinds(v.clone()).is_err(), "{v} was accepted");
        }
    }
}
