//! The Envoy rate limit service v3 (`ShouldRateLimit`) with tonic.

use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::HeaderValue;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{
    Entry, RateLimitOverride,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus, RateLimit,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::{
    RateLimitService, RateLimitServiceServer,
};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::{
    Duration as PbDuration, ListValue, Struct, UInt64Value, Value, value::Kind,
};
use tonic::{Request, Response, Status};

use crate::config::Unit;
use crate::decide::{Decider, Descriptor, hits};

/// The gRPC service.
#[derive(Clone, Debug)]
pub struct Rls {
    decider: Arc<Decider>,
}

impl Rls {
    /// Decides with `decider`.
    pub fn new(decider: Arc<Decider>) -> Self {
        Self { decider }
    }

    /// As a tonic service: envoy-types' generated server, but for `ShouldRateLimit`'s
    /// request, read by [`RawRequest`] (see [`Server`]).
    pub fn into_server(self) -> Server {
        Server(Arc::new(self))
    }
}

/// The rate limit service's gRPC server. The generated one reads descriptor entries as
/// protobuf strings, and a value that is not UTF-8 (a header's bytes, which Envoy passes
/// on as they came) fails the whole call with INTERNAL, which Envoy lets through by
/// default (`failure_mode_deny: false`): a client could skip its limit with one byte.
/// This one reads the entries as bytes and decides such a value as its own subject
/// ([`subject_text`]).
#[derive(Clone, Debug)]
pub struct Server(Arc<Rls>);

impl tonic::server::NamedService for Server {
    const NAME: &'static str = <RateLimitServiceServer<Rls> as tonic::server::NamedService>::NAME;
}

const SHOULD_RATE_LIMIT: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

type BoxFuture<T, E> = std::pin::Pin<Box<dyn std::future::Future<Output = Result<T, E>> + Send>>;

impl<B> tonic::codegen::Service<tonic::codegen::http::Request<B>> for Server
where
    B: tonic::codegen::Body + Send + 'static,
    B::Error: Into<tonic::codegen::StdError> + Send + 'static,
{
    type Response = tonic::codegen::http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(
        &mut self,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: tonic::codegen::http::Request<B>) -> Self::Future {
        if req.uri().path() != SHOULD_RATE_LIMIT {
            return Box::pin(async { Ok(Status::unimplemented("").into_http()) });
        }
        let method = ShouldRateLimit(self.0.clone());
        Box::pin(async move {
            let codec = tonic_prost::ProstCodec::<RateLimitResponse, RawRequest>::default();
            Ok(tonic::server::Grpc::new(codec).unary(method, req).await)
        })
    }
}

struct ShouldRateLimit(Arc<Rls>);

impl tonic::server::UnaryService<RawRequest> for ShouldRateLimit {
    type Response = RateLimitResponse;
    type Future = BoxFuture<Response<RateLimitResponse>, Status>;

    fn call(&mut self, request: Request<RawRequest>) -> Self::Future {
        let rls = self.0.clone();
        Box::pin(async move {
            let (metadata, extensions, raw) = request.into_parts();
            let request = Request::from_parts(metadata, extensions, raw.into_request());
            rls.should_rate_limit(request).await
        })
    }
}

/// `RateLimitRequest` with its descriptors' entries as bytes (the same wire format).
#[derive(Clone, PartialEq, prost::Message)]
struct RawRequest {
    #[prost(string, tag = "1")]
    domain: String,
    #[prost(message, repeated, tag = "2")]
    descriptors: Vec<RawDescriptor>,
    #[prost(uint32, tag = "3")]
    hits_addend: u32,
}

/// `RateLimitDescriptor`, its entries as bytes.
#[derive(Clone, PartialEq, prost::Message)]
struct RawDescriptor {
    #[prost(message, repeated, tag = "1")]
    entries: Vec<RawEntry>,
    #[prost(message, optional, tag = "2")]
    limit: Option<RateLimitOverride>,
    #[prost(message, optional, tag = "3")]
    hits_addend: Option<UInt64Value>,
    #[prost(bool, tag = "4")]
    is_negative_hits: bool,
}

/// A descriptor entry, key and value as bytes.
#[derive(Clone, PartialEq, prost::Message)]
struct RawEntry {
    #[prost(bytes = "vec", tag = "1")]
    key: Vec<u8>,
    #[prost(bytes = "vec", tag = "2")]
    value: Vec<u8>,
}

impl RawRequest {
    fn into_request(self) -> RateLimitRequest {
        RateLimitRequest {
            domain: self.domain,
            descriptors: self
                .descriptors
                .into_iter()
                .map(|d| RateLimitDescriptor {
                    entries: d
                        .entries
                        .into_iter()
                        .map(|e| Entry {
                            key: subject_text(e.key),
                            value: subject_text(e.value),
                        })
                        .collect(),
                    limit: d.limit,
                    hits_addend: d.hits_addend,
                    is_negative_hits: d.is_negative_hits,
                })
                .collect(),
            hits_addend: self.hits_addend,
        }
    }
}

/// A descriptor entry's bytes as text: UTF-8 as it is; any other byte as U+FFFD and its
/// two hex digits, so that values differing in such bytes stay different subjects
/// (a lossy decoding would make them one, and let one client spend another's limit).
fn subject_text(bytes: Vec<u8>) -> String {
    match String::from_utf8(bytes) {
        Ok(text) => text,
        Err(e) => {
            let bytes = e.into_bytes();
            let mut out = String::with_capacity(bytes.len() + 8);
            for chunk in bytes.utf8_chunks() {
                out.push_str(chunk.valid());
                for b in chunk.invalid() {
                    out.push('\u{FFFD}');
                    out.push_str(&format!("{b:02x}"));
                }
            }
            out
        }
    }
}

fn duration(d: std::time::Duration) -> PbDuration {
    PbDuration {
        seconds: d.as_secs().min(i64::MAX as u64) as i64,
        nanos: d.subsec_nanos() as i32,
    }
}

/// JSON as a protobuf `Struct` value.
fn value(v: &serde_json::Value) -> Value {
    let kind = match v {
        serde_json::Value::Null => Kind::NullValue(0),
        serde_json::Value::Bool(b) => Kind::BoolValue(*b),
        serde_json::Value::Number(n) => Kind::NumberValue(n.as_f64().unwrap_or(0.0)),
        serde_json::Value::String(s) => Kind::StringValue(s.clone()),
        serde_json::Value::Array(a) => Kind::ListValue(ListValue {
            values: a.iter().map(value).collect(),
        }),
        serde_json::Value::Object(o) => Kind::StructValue(structure(o)),
    };
    Value { kind: Some(kind) }
}

fn structure(o: &serde_json::Map<String, serde_json::Value>) -> Struct {
    Struct {
        fields: o.iter().map(|(k, v)| (k.clone(), value(v))).collect(),
    }
}

#[tonic::async_trait]
impl RateLimitService for Rls {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let req = request.into_inner();
        let mut descriptors = Vec::with_capacity(req.descriptors.len());
        for (i, d) in req.descriptors.iter().enumerate() {
            let limit = match &d.limit {
                None => None,
                Some(l) => match Unit::from_envoy(l.unit) {
                    Some(u) => Some((l.requests_per_unit, u)),
                    None => {
                        return Err(Status::invalid_argument(format!(
                            "descriptor {i}: limit unit {} is not one of SECOND, MINUTE, \
                             HOUR, DAY, WEEK, MONTH, YEAR",
                            l.unit
                        )));
                    }
                },
            };
            descriptors.push(Descriptor {
                entries: d
                    .entries
                    .iter()
                    .map(|e| (e.key.as_str(), e.value.as_str()))
                    .collect(),
                // Negative hits (giving back) are not taken back: nothing is taken.
                hits: if d.is_negative_hits {
                    0
                } else {
                    hits(d.hits_addend.as_ref().map(|h| h.value), req.hits_addend)
                },
                limit,
            });
        }
        let verdict = self
            .decider
            .decide(&req.domain, &descriptors, req.hits_addend)
            .await
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        if verdict.failed {
            // As envoyproxy/ratelimit answers a Redis error: Envoy's `failure_mode_deny`
            // decides (it lets the request through by default).
            metrics::counter!("leasehold_serve_requests_total", "api" => "grpc", "outcome" => "unavailable")
                .increment(1);
            return Err(Status::unavailable(
                "the rate limit store is unreachable (the limit sets no leasehold.on_failure)",
            ));
        }
        let statuses = verdict
            .statuses
            .iter()
            .map(|s| DescriptorStatus {
                code: if s.over_limit {
                    Code::OverLimit
                } else {
                    Code::Ok
                } as i32,
                current_limit: s.limit.as_ref().map(|(rpu, unit, name)| RateLimit {
                    name: name.clone().unwrap_or_default(),
                    requests_per_unit: *rpu,
                    unit: unit.envoy(),
                }),
                limit_remaining: s.remaining,
                duration_until_reset: s.reset.map(duration),
                ..DescriptorStatus::default()
            })
            .collect();
        let outcome = if verdict.unavailable {
            "unavailable"
        } else if verdict.over_limit {
            "over_limit"
        } else {
            "ok"
        };
        metrics::counter!("leasehold_serve_requests_total", "api" => "grpc", "outcome" => outcome)
            .increment(1);
        Ok(Response::new(RateLimitResponse {
            overall_code: if verdict.over_limit {
                Code::OverLimit
            } else {
                Code::Ok
            } as i32,
            statuses,
            response_headers_to_add: verdict
                .headers
                .into_iter()
                .map(|(k, v)| HeaderValue {
                    key: k,
                    value: v,
                    ..HeaderValue::default()
                })
                .collect(),
            dynamic_metadata: verdict.metadata.as_ref().map(structure),
            ..RateLimitResponse::default()
        }))
    }
}
