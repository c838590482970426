//! The HTTP edge: a tower [`Layer`] that checks every request against the limiter.
//!
//! Allowed requests go on to the inner service; denied ones get `429 Too Many Requests`
//! with `Retry-After` (whole seconds, rounded up, never 0) and the IETF draft headers
//! `RateLimit-Policy: "RULE";q=B;w=SECONDS` and `RateLimit: "RULE";r=0;t=SECONDS`; when
//! the store is unreachable and the rule fails closed, `503 Service Unavailable`.
//!
//! Every clone of the layer and of its services shares the one [`Limiter`]: a limit is
//! never multiplied by the number of connections or clones.
//!
//! Identity must come from authenticated data (a validated API key, a session); the
//! client address is a fallback for unauthenticated traffic only, with its own rule,
//! since many users can share one address.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::{Extensions, HeaderMap, HeaderValue, Request, Response, StatusCode};
use tower::{Layer, Service};

use crate::limiter::{CheckError, Decision, Limiter};

/// What to check for one request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Check {
    /// The rule.
    pub rule: String,
    /// Who is limited.
    pub subject: Vec<u8>,
    /// Tokens the request costs.
    pub cost: u64,
}

type Classify = dyn Fn(&HeaderMap, &Extensions) -> Option<Check> + Send + Sync;

/// Rate limits every request of the wrapped service.
#[derive(Clone)]
pub struct RateLimitLayer {
    limiter: Limiter,
    classify: Arc<Classify>,
}

impl std::fmt::Debug for RateLimitLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateLimitLayer")
            .field("limiter", &self.limiter)
            .finish()
    }
}

impl RateLimitLayer {
    /// `classify` names the rule, subject and cost of a request from its headers and
    /// extensions; `None` answers `401 Unauthorized` (no identity to limit).
    pub fn new(
        limiter: Limiter,
        classify: impl Fn(&HeaderMap, &Extensions) -> Option<Check> + Send + Sync + 'static,
    ) -> Self {
        Self {
            limiter,
            classify: Arc::new(classify),
        }
    }

    /// Limits by the value of `header` (say `x-api-key`) under `rule`, cost 1.
    pub fn by_header(limiter: Limiter, header: &'static str, rule: &str) -> Self {
        let rule = rule.to_owned();
        Self::new(limiter, move |headers, _| {
            headers.get(header).map(|v| Check {
                rule: rule.clone(),
                subject: v.as_bytes().to_vec(),
                cost: 1,
            })
        })
    }
}

impl<S> Layer<S> for RateLimitLayer {
    type Service = RateLimit<S>;

    fn layer(&self, inner: S) -> RateLimit<S> {
        RateLimit {
            inner,
            limiter: self.limiter.clone(),
            classify: self.classify.clone(),
        }
    }
}

/// The service [`RateLimitLayer`] makes.
#[derive(Clone)]
pub struct RateLimit<S> {
    inner: S,
    limiter: Limiter,
    classify: Arc<Classify>,
}

impl<S> std::fmt::Debug for RateLimit<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateLimit")
            .field("limiter", &self.limiter)
            .finish()
    }
}

impl<S, B, RB> Service<Request<B>> for RateLimit<S>
where
    S: Service<Request<B>, Response = Response<RB>> + Clone + Send + 'static,
    S::Future: Send,
    B: Send + 'static,
    RB: Default + Send + 'static,
{
    type Response = Response<RB>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Response<RB>, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let check = (self.classify)(req.headers(), req.extensions());
        let limiter = self.limiter.clone();
        // The clone that was polled ready serves this request.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        Box::pin(async move {
            let Some(check) = check else {
                return Ok(empty(StatusCode::UNAUTHORIZED));
            };
            let policy = limiter
                .bucket_params(&check.rule)
                .ok()
                .map(|p| policy_header(&check.rule, p.capacity, p.rate.per_sec_f64()));
            let decision = limiter.check(&check.subject, &check.rule, check.cost).await;
            let mut resp = match decision {
                Ok(Decision::Allowed { .. }) => inner.call(req).await?,
                Ok(Decision::Denied { retry_after }) => {
                    let mut r = empty(StatusCode::TOO_MANY_REQUESTS);
                    let secs = retry_secs(retry_after);
                    set(r.headers_mut(), "retry-after", secs.to_string());
                    set(
                        r.headers_mut(),
                        "ratelimit",
                        format!("\"{}\";r=0;t={secs}", check.rule),
                    );
                    r
                }
                Ok(Decision::Unavailable { retry_after }) => {
                    let mut r = empty(StatusCode::SERVICE_UNAVAILABLE);
                    set(
                        r.headers_mut(),
                        "retry-after",
                        retry_secs(retry_after).to_string(),
                    );
                    r
                }
                // Can never be admitted: a denial with no time to come back.
                Err(CheckError::CostExceedsCapacity { .. }) => empty(StatusCode::TOO_MANY_REQUESTS),
                Err(CheckError::Subject(_) | CheckError::ZeroCost) => {
                    empty(StatusCode::BAD_REQUEST)
                }
                Err(CheckError::UnknownRule(e)) => {
                    tracing::error!(error = %e, "request classified under an unknown rule");
                    empty(StatusCode::INTERNAL_SERVER_ERROR)
                }
            };
            if let Some(policy) = policy {
                set(resp.headers_mut(), "ratelimit-policy", policy);
            }
            Ok(resp)
        })
    }
}

fn empty<RB: Default>(status: StatusCode) -> Response<RB> {
    let mut r = Response::new(RB::default());
    *r.status_mut() = status;
    r
}

fn set(headers: &mut HeaderMap, name: &'static str, value: String) {
    if let Ok(v) = HeaderValue::from_str(&value) {
        headers.insert(name, v);
    }
}

/// `Retry-After` in whole seconds: rounded up, at least 1.
pub fn retry_secs(wait: Duration) -> u64 {
    leasehold_core::retry_after_secs(wait.as_micros().min(u128::from(u64::MAX)) as u64).max(1)
}

/// `"RULE";q=B;w=W` with W the seconds an empty bucket takes to fill.
fn policy_header(rule: &str, capacity: u64, per_sec: f64) -> String {
    let w = (capacity as f64 / per_sec).ceil().max(1.0) as u64;
    format!("\"{rule}\";q={capacity};w={w}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_up_and_never_say_zero() {
        assert_eq!(retry_secs(Duration::from_nanos(1)), 1);
        assert_eq!(retry_secs(Duration::from_millis(1500)), 2);
        assert_eq!(policy_header("api", 100, 10.0), "\"api\";q=100;w=10");
        assert_eq!(policy_header("api", 5, 100.0), "\"api\";q=5;w=1");
    }
}
