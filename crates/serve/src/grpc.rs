//! The Envoy rate limit service v3 (`ShouldRateLimit`) with tonic.

use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::HeaderValue;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus, RateLimit,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::{
    RateLimitService, RateLimitServiceServer,
};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::{
    Duration as PbDuration, ListValue, Struct, Value, value::Kind,
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

    /// As a tonic service.
    pub fn into_server(self) -> RateLimitServiceServer<Self> {
        RateLimitServiceServer::new(self)
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
