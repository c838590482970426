//! The HTTP edge: a tower [`Layer`] that checks every request against the limiter.
//!
//! A [`Classify`] reads the request head ([`Parts`]: method, URI, headers, extensions)
//! and names the checks it must pass, one or several (tenant, endpoint, global), applied
//! all or nothing. Allowed requests go on to the inner service, and their response
//! carries `RateLimit-Policy` (one item per rule, `"RULE";q=B;w=SECONDS`) and
//! `RateLimit` (`"RULE";r=REMAINING;t=SECONDS`, see [`Limiter::quota_left`]). Refused
//! ones get what the [`Reject`] makes of the [`Rejection`] (by default an empty `429 Too
//! Many Requests`, `503 Service Unavailable` when the store is unreachable and the rule
//! fails closed, `401` without an identity, `400` for a bad subject or cost), with
//! `Retry-After` (whole seconds, rounded up, never 0) and the same two headers.
//!
//! When every check is covered by a local lease the layer adds no allocation but the
//! `RateLimit` value, no boxing and no rule lookup: the decision is made in `call`, and
//! the response future is the inner service's. A check that needs the store goes
//! through one boxed future (a network round trip costs far more).
//!
//! Every clone of the layer and of its services shares the one [`Limiter`]: a limit is
//! never multiplied by the number of connections or clones.
//!
//! Identity must come from authenticated data (a validated API key, a session); the
//! client address is a fallback for unauthenticated traffic only, with its own rule,
//! since many users can share one address.

use std::future::Future;
use std::io::Write as _;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::request::Parts;
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode};
use smallvec::SmallVec;
use tower::{Layer, Service};

use crate::headers::retry_secs;
use crate::limiter::{Check, CheckError, Decision, Limiter, RuleEntry, RuleRef};

/// The checks of one request, all or nothing; none means the request is not limited.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Checks(SmallVec<[Check; 2]>);

impl Checks {
    /// No check: the request is not limited.
    pub fn none() -> Self {
        Self::default()
    }

    /// This check and the ones before it.
    pub fn and(mut self, check: Check) -> Self {
        self.0.push(check);
        self
    }

    /// Adds a check.
    pub fn push(&mut self, check: Check) {
        self.0.push(check);
    }

    /// The checks.
    pub fn iter(&self) -> impl Iterator<Item = &Check> {
        self.0.iter()
    }

    /// The checks, as [`Limiter::check_all`] takes them.
    pub fn as_slice(&self) -> &[Check] {
        &self.0
    }

    /// True when the request is not limited.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl From<Check> for Checks {
    fn from(c: Check) -> Self {
        Self::none().and(c)
    }
}

impl FromIterator<Check> for Checks {
    fn from_iter<I: IntoIterator<Item = Check>>(iter: I) -> Self {
        Self(iter.into_iter().collect())
    }
}

/// Names the checks of a request from its head. `None`: the request carries no identity
/// to limit ([`Rejection::NoIdentity`]).
pub trait Classify: Clone + Send + Sync + 'static {
    /// The checks `req` must pass.
    fn classify(&self, req: &Parts) -> Option<Checks>;
}

impl<F> Classify for F
where
    F: Fn(&Parts) -> Option<Checks> + Clone + Send + Sync + 'static,
{
    fn classify(&self, req: &Parts) -> Option<Checks> {
        self(req)
    }
}

/// Limits by the value of one header under one rule, cost 1 (see
/// [`RateLimitLayer::by_header`]).
#[derive(Clone, Debug)]
pub struct ByHeader {
    header: http::HeaderName,
    rule: RuleRef,
}

impl Classify for ByHeader {
    fn classify(&self, req: &Parts) -> Option<Checks> {
        let v = req.headers.get(&self.header)?;
        Some(Check::new(&self.rule, v.as_bytes(), 1).into())
    }
}

/// Why the layer answers a request itself.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Rejection {
    /// A limit is exhausted (429).
    Limited {
        /// The rule that refused.
        rule: String,
        /// When `cost` tokens can exist.
        retry_after: Duration,
    },
    /// The store is unreachable and the rule fails closed (503).
    Unavailable {
        /// The rule.
        rule: String,
        /// When the limiter tries the store again.
        retry_after: Duration,
    },
    /// A cost larger than the rule's capacity: never admitted (429, no retry time).
    TooCostly {
        /// The rule.
        rule: String,
    },
    /// The classifier found no identity (401).
    NoIdentity,
    /// The subject or cost cannot be checked (400).
    Invalid {
        /// What is wrong.
        reason: String,
    },
    /// The request was classified under a rule that does not exist (500): a
    /// configuration error, logged.
    UnknownRule {
        /// What is wrong.
        reason: String,
    },
}

impl Rejection {
    /// The status the default rejection answers with.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::Limited { .. } | Self::TooCostly { .. } => StatusCode::TOO_MANY_REQUESTS,
            Self::Unavailable { .. } => StatusCode::SERVICE_UNAVAILABLE,
            Self::NoIdentity => StatusCode::UNAUTHORIZED,
            Self::Invalid { .. } => StatusCode::BAD_REQUEST,
            Self::UnknownRule { .. } => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// When to come back, for `Retry-After`.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Self::Limited { retry_after, .. } | Self::Unavailable { retry_after, .. } => {
                Some(*retry_after)
            }
            _ => None,
        }
    }

    fn from_error(e: CheckError, rule: &str) -> Self {
        match e {
            CheckError::CostExceedsCapacity { .. } => Self::TooCostly {
                rule: rule.to_owned(),
            },
            CheckError::UnknownRule(e) => {
                tracing::error!(error = %e, "request classified under an unknown rule");
                Self::UnknownRule {
                    reason: e.to_string(),
                }
            }
            e => Self::Invalid {
                reason: e.to_string(),
            },
        }
    }
}

/// Makes the response to a refused request. The layer then adds `Retry-After`,
/// `RateLimit` and `RateLimit-Policy` unless the response already has them.
pub trait Reject<RB>: Clone + Send + Sync + 'static {
    /// The response for `rejection`.
    fn reject(&self, rejection: &Rejection) -> Response<RB>;
}

impl<F, RB> Reject<RB> for F
where
    F: Fn(&Rejection) -> Response<RB> + Clone + Send + Sync + 'static,
{
    fn reject(&self, rejection: &Rejection) -> Response<RB> {
        self(rejection)
    }
}

/// An empty body with [`Rejection::status`].
#[derive(Clone, Copy, Debug, Default)]
pub struct DefaultRejection;

impl<RB: Default> Reject<RB> for DefaultRejection {
    fn reject(&self, rejection: &Rejection) -> Response<RB> {
        let mut r = Response::new(RB::default());
        *r.status_mut() = rejection.status();
        r
    }
}

/// Rate limits every request of the wrapped service.
#[derive(Clone)]
pub struct RateLimitLayer<C, R = DefaultRejection> {
    limiter: Limiter,
    classify: C,
    reject: R,
}

impl<C, R> std::fmt::Debug for RateLimitLayer<C, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateLimitLayer")
            .field("limiter", &self.limiter)
            .finish()
    }
}

impl<C: Classify> RateLimitLayer<C> {
    /// Checks each request as `classify` says.
    pub fn new(limiter: Limiter, classify: C) -> Self {
        Self {
            limiter,
            classify,
            reject: DefaultRejection,
        }
    }
}

impl RateLimitLayer<ByHeader> {
    /// Limits by the value of `header` (say `x-api-key`) under `rule`, cost 1; a request
    /// without it is refused as [`Rejection::NoIdentity`].
    pub fn by_header(limiter: Limiter, header: http::HeaderName, rule: impl Into<RuleRef>) -> Self {
        Self::new(
            limiter,
            ByHeader {
                header,
                rule: rule.into(),
            },
        )
    }
}

impl<C, R> RateLimitLayer<C, R> {
    /// Answers refused requests with `reject` instead of an empty body.
    pub fn on_reject<R2>(self, reject: R2) -> RateLimitLayer<C, R2> {
        RateLimitLayer {
            limiter: self.limiter,
            classify: self.classify,
            reject,
        }
    }
}

impl<S, C: Clone, R: Clone> Layer<S> for RateLimitLayer<C, R> {
    type Service = RateLimit<S, C, R>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimit {
            inner,
            limiter: self.limiter.clone(),
            classify: self.classify.clone(),
            reject: self.reject.clone(),
        }
    }
}

/// The service [`RateLimitLayer`] makes.
#[derive(Clone)]
pub struct RateLimit<S, C, R = DefaultRejection> {
    inner: S,
    limiter: Limiter,
    classify: C,
    reject: R,
}

impl<S, C, R> std::fmt::Debug for RateLimit<S, C, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateLimit")
            .field("limiter", &self.limiter)
            .finish()
    }
}

/// What the response headers report: per check, what is left and the entry in force.
type Limits = SmallVec<[(Decision, Arc<RuleEntry>); 2]>;

type SlowFuture<RB, E> = Pin<Box<dyn Future<Output = Result<Response<RB>, E>> + Send>>;

impl<S, C, R, B, RB> Service<Request<B>> for RateLimit<S, C, R>
where
    S: Service<Request<B>, Response = Response<RB>> + Clone + Send + 'static,
    S::Future: Send,
    B: Send + 'static,
    RB: Send + 'static,
    C: Classify,
    R: Reject<RB>,
{
    type Response = Response<RB>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, RB, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let (parts, body) = req.into_parts();
        let checks = self.classify.classify(&parts);
        let req = Request::from_parts(parts, body);
        let Some(checks) = checks else {
            return ResponseFuture::ready(refuse(&self.reject, &Rejection::NoIdentity, &[]));
        };
        if checks.is_empty() {
            return ResponseFuture::inner(self.inner.call(req), Limits::new());
        }
        let mut decided = Limits::new();
        match self.limiter.try_check_all_now(&checks.0, &mut decided) {
            Ok(true) => match refusal(&checks, &decided) {
                None => ResponseFuture::inner(self.inner.call(req), decided),
                Some(rejection) => {
                    ResponseFuture::ready(refuse(&self.reject, &rejection, &decided))
                }
            },
            Ok(false) => {
                // The clone that was polled ready serves this request.
                let clone = self.inner.clone();
                let inner = std::mem::replace(&mut self.inner, clone);
                let (limiter, reject) = (self.limiter.clone(), self.reject.clone());
                ResponseFuture::slow(Box::pin(slow(limiter, reject, inner, req, checks)))
            }
            Err(e) => {
                let rule = checks.iter().next().map_or("", Check::rule);
                let rejection = Rejection::from_error(e, rule);
                ResponseFuture::ready(refuse(&self.reject, &rejection, &decided))
            }
        }
    }
}

/// The first refusal among decided checks.
fn refusal(checks: &Checks, decided: &Limits) -> Option<Rejection> {
    checks.iter().zip(decided).find_map(|(c, (d, _))| match *d {
        Decision::Allowed { .. } => None,
        Decision::Denied { retry_after } => Some(Rejection::Limited {
            rule: c.rule().to_owned(),
            retry_after,
        }),
        Decision::Unavailable { retry_after } => Some(Rejection::Unavailable {
            rule: c.rule().to_owned(),
            retry_after,
        }),
    })
}

/// A check that needs the store: all of them through `check_all`, then the inner
/// service.
async fn slow<S, R, B, RB>(
    limiter: Limiter,
    reject: R,
    mut inner: S,
    req: Request<B>,
    checks: Checks,
) -> Result<Response<RB>, S::Error>
where
    S: Service<Request<B>, Response = Response<RB>>,
    R: Reject<RB>,
{
    let mut each = Vec::new();
    let (decision, at) = match limiter.check_all_each(checks.as_slice(), &mut each).await {
        Ok(decided) => decided,
        Err(e) => {
            let rule = checks.iter().next().map_or("", Check::rule);
            return Ok(refuse(&reject, &Rejection::from_error(e, rule), &[]));
        }
    };
    let Some(check) = checks.iter().nth(at) else {
        return inner.call(req).await;
    };
    let rule = check.rule().to_owned();
    let rejection = match decision {
        Decision::Allowed { .. } => {
            // Every check, with what it left.
            let limits: Limits = checks
                .iter()
                .zip(each)
                .filter_map(|(c, d)| Some((d?, limiter.entry_for(c.rule(), c.subject())?)))
                .collect();
            let mut resp = inner.call(req).await?;
            add_limit_headers(resp.headers_mut(), &limits);
            return Ok(resp);
        }
        Decision::Denied { retry_after } => Rejection::Limited { rule, retry_after },
        Decision::Unavailable { retry_after } => Rejection::Unavailable { rule, retry_after },
    };
    // A refusal reports the check that refused.
    let limits: Limits = limiter
        .entry_for(check.rule(), check.subject())
        .map(|e| (decision, e))
        .into_iter()
        .collect();
    Ok(refuse(&reject, &rejection, &limits))
}

fn refuse<RB, R: Reject<RB>>(
    reject: &R,
    rejection: &Rejection,
    limits: &[(Decision, Arc<RuleEntry>)],
) -> Response<RB> {
    let mut r = reject.reject(rejection);
    let headers = r.headers_mut();
    if let Some(wait) = rejection.retry_after()
        && !headers.contains_key(http::header::RETRY_AFTER)
    {
        headers.insert(http::header::RETRY_AFTER, number(retry_secs(wait)));
    }
    if !headers.contains_key("ratelimit") {
        add_limit_headers(headers, limits);
    }
    r
}

/// `RateLimit-Policy` and `RateLimit`, one item per check (see [`crate::headers`]).
fn add_limit_headers(headers: &mut HeaderMap, limits: &[(Decision, Arc<RuleEntry>)]) {
    let policy = match limits {
        [] => return,
        [(_, e)] => HeaderValue::from_maybe_shared(e.policy_item.clone()).ok(),
        many => {
            let mut v = Vec::with_capacity(many.len() * 32);
            for (i, (_, e)) in many.iter().enumerate() {
                if i > 0 {
                    v.extend_from_slice(b", ");
                }
                v.extend_from_slice(&e.policy_item);
            }
            HeaderValue::from_maybe_shared(bytes::Bytes::from(v)).ok()
        }
    };
    if let Some(p) = policy {
        headers.insert("ratelimit-policy", p);
    }
    let mut buf = [0u8; 512];
    let len = buf.len();
    let mut w = &mut buf[..];
    // What the whole items written so far take (an item that does not fit is dropped).
    let (mut items, mut used) = (0, 0);
    for (d, e) in limits {
        let Some((remaining, t)) = e.policy.left(*d) else {
            continue;
        };
        let sep = if items > 0 { &b", "[..] } else { b"" };
        if w.write_all(sep).is_err()
            || crate::headers::write_limit_item(&mut w, e.policy.name(), remaining, t).is_err()
        {
            break;
        }
        items += 1;
        used = len - w.len();
    }
    if items > 0
        && let Ok(v) = HeaderValue::from_bytes(&buf[..used])
    {
        headers.insert("ratelimit", v);
    }
}

fn number(n: u64) -> HeaderValue {
    HeaderValue::from(n)
}

pin_project_lite::pin_project! {
    /// The response future of [`RateLimit`]: the inner service's when the checks were
    /// decided locally, a ready response when refused, a boxed one when the store was
    /// asked.
    pub struct ResponseFuture<F, RB, E> {
        #[pin]
        state: State<F, RB, E>,
    }
}

pin_project_lite::pin_project! {
    #[project = StateProj]
    enum State<F, RB, E> {
        Inner { #[pin] fut: F, limits: Limits },
        Ready { resp: Option<Response<RB>> },
        Slow { fut: SlowFuture<RB, E> },
    }
}

impl<F, RB, E> std::fmt::Debug for ResponseFuture<F, RB, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

impl<F, RB, E> ResponseFuture<F, RB, E> {
    fn inner(fut: F, limits: Limits) -> Self {
        Self {
            state: State::Inner { fut, limits },
        }
    }

    fn ready(resp: Response<RB>) -> Self {
        Self {
            state: State::Ready { resp: Some(resp) },
        }
    }

    fn slow(fut: SlowFuture<RB, E>) -> Self {
        Self {
            state: State::Slow { fut },
        }
    }
}

impl<F, RB, E> Future for ResponseFuture<F, RB, E>
where
    F: Future<Output = Result<Response<RB>, E>>,
{
    type Output = Result<Response<RB>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().state.project() {
            StateProj::Inner { fut, limits } => {
                let mut resp = std::task::ready!(fut.poll(cx))?;
                add_limit_headers(resp.headers_mut(), limits);
                Poll::Ready(Ok(resp))
            }
            StateProj::Ready { resp } => match resp.take() {
                Some(r) => Poll::Ready(Ok(r)),
                None => Poll::Pending,
            },
            StateProj::Slow { fut } => fut.as_mut().poll(cx),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_rounds_up_and_never_says_zero() {
        assert_eq!(retry_secs(Duration::from_nanos(1)), 1);
        assert_eq!(retry_secs(Duration::from_millis(1500)), 2);
    }
}
