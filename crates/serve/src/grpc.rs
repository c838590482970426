//! The Envoy rate limit service v3 (`ShouldRateLimit`) with tonic.

use std::sync::Arc;

use arc_swap::ArcSwap;
use envoy_types::pb::envoy::config::core::v3::HeaderValue;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus, RateLimit,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::{
    RateLimitService, RateLimitServiceServer,
};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::Duration as PbDuration;
use leasehold_agent::Limiter;
use tonic::{Request, Response, Status};

use crate::config::Domains;
use crate::decide::{DecideError, Descriptor, decide};

/// The gRPC service.
#[derive(Clone, Debug)]
pub struct Rls {
    limiter: Limiter,
    domains: Arc<ArcSwap<Domains>>,
}

impl Rls {
    /// Decides with `limiter` under the limits of `domains` (swapped on reload).
    pub fn new(limiter: Limiter, domains: Arc<ArcSwap<Domains>>) -> Self {
        Self { limiter, domains }
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

#[tonic::async_trait]
impl RateLimitService for Rls {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let req = request.into_inner();
        let default_hits = u64::from(req.hits_addend.max(1));
        let descriptors: Vec<Descriptor<'_>> = req
            .descriptors
            .iter()
            .map(|d| Descriptor {
                entries: d
                    .entries
                    .iter()
                    .map(|e| (e.key.as_str(), e.value.as_str()))
                    .collect(),
                hits: d
                    .hits_addend
                    .as_ref()
                    .map_or(default_hits, |h| h.value.max(1)),
            })
            .collect();
        let domains = self.domains.load();
        let verdict = match decide(&self.limiter, &domains, &req.domain, &descriptors).await {
            Ok(v) => v,
            Err(DecideError::UnknownDomain(d)) => {
                // As ratelimit: no limit configured for the domain, so OK.
                tracing::debug!(domain = %d, "unknown domain");
                metrics::counter!("leasehold_serve_unknown_domain_total").increment(1);
                return Ok(Response::new(RateLimitResponse {
                    overall_code: Code::Ok as i32,
                    statuses: descriptors
                        .iter()
                        .map(|_| DescriptorStatus {
                            code: Code::Ok as i32,
                            ..DescriptorStatus::default()
                        })
                        .collect(),
                    ..RateLimitResponse::default()
                }));
            }
            Err(DecideError::Invalid(why)) => return Err(Status::invalid_argument(why)),
            Err(e) => return Err(Status::invalid_argument(e.to_string())),
        };
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
                    key: k.to_owned(),
                    value: v,
                    ..HeaderValue::default()
                })
                .collect(),
            ..RateLimitResponse::default()
        }))
    }
}
