//! A client of the rate limit quota service that behaves as Envoy's `rate_limit_quota`
//! filter is documented to, for tests, `simulate` and trying a server without an Envoy:
//! one stream, the domain in its first report; a bucket's first request sends a report
//! at once (its subscription), then every bucket is reported every reporting interval
//! (requests allowed and denied, time elapsed); a token bucket per assignment — a new one,
//! full, when the strategy differs from the active one or that one expired, the same one
//! extended otherwise; blanket rules as they say; requests refused while a bucket has no
//! assignment or its assignment expired (`no_assignment_behavior` and
//! `expired_assignment_behavior` set to `DENY_ALL`); an abandoned bucket forgotten until
//! its next request.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::BucketAction as Action;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_client::RateLimitQuotaServiceClient;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaUsageReports,
};
use envoy_types::pb::google::protobuf::Duration as PbDuration;
use tokio::sync::mpsc;
use tonic::codegen::tokio_stream::wrappers::ReceiverStream;

/// A bucket's entries, ordered by key: its identity.
pub type Entries = Vec<(String, String)>;

/// What a bucket holds.
#[derive(Clone, Debug, Default)]
enum Held {
    /// No assignment yet, or it expired: denied.
    #[default]
    None,
    Blanket(bool),
    Bucket {
        max: f64,
        per_ns: f64,
        level: f64,
        at: Instant,
        strategy: Strategy,
        expires: Option<Instant>,
    },
}

impl Held {
    fn apply(&mut self, strategy: Strategy, ttl: Option<Duration>, now: Instant) {
        let expires = ttl.map(|t| now + t);
        match strategy {
            Strategy::BlanketRule(r) => *self = Held::Blanket(r == BlanketRule::AllowAll as i32),
            Strategy::TokenBucket(tb) => {
                if let Held::Bucket {
                    strategy: s,
                    expires: e,
                    ..
                } = self
                    && *s == strategy
                    && e.is_none_or(|e| now < e)
                {
                    *e = expires;
                    return;
                }
                let tokens = f64::from(tb.tokens_per_fill.map_or(1, |v| v.value));
                let interval = tb
                    .fill_interval
                    .map_or(1e9, |d| d.seconds as f64 * 1e9 + f64::from(d.nanos));
                *self = Held::Bucket {
                    max: f64::from(tb.max_tokens),
                    per_ns: tokens / interval.max(1.0),
                    level: f64::from(tb.max_tokens),
                    at: now,
                    strategy,
                    expires,
                };
            }
            // Not assigned by Leasehold: a fixed rate, as a bucket of one second.
            Strategy::RequestsPerTimeUnit(_) => *self = Held::None,
        }
    }

    fn admit(&mut self, now: Instant) -> bool {
        match self {
            Held::None => false,
            Held::Blanket(allow) => *allow,
            Held::Bucket {
                max,
                per_ns,
                level,
                at,
                expires,
                ..
            } => {
                if expires.is_some_and(|e| now >= e) {
                    *self = Held::None;
                    return false;
                }
                *level = (*level + *per_ns * now.duration_since(*at).as_nanos() as f64).min(*max);
                *at = now;
                if *level >= 1.0 {
                    *level -= 1.0;
                    true
                } else {
                    false
                }
            }
        }
    }
}

#[derive(Clone, Debug)]
struct Bucket {
    id: BucketId,
    held: Held,
    allowed: u64,
    denied: u64,
    reported: Instant,
}

#[derive(Debug, Default)]
struct State {
    buckets: HashMap<Entries, Bucket>,
    received: u64,
    abandoned: u64,
    ended: Option<tonic::Status>,
}

/// One Envoy's filter: a stream to a server and its buckets.
#[derive(Clone, Debug)]
pub struct QuotaClient {
    domain: String,
    state: Arc<Mutex<State>>,
    reports: mpsc::Sender<RateLimitQuotaUsageReports>,
}

fn pb(d: Duration) -> PbDuration {
    PbDuration {
        seconds: d.as_secs() as i64,
        nanos: d.subsec_nanos() as i32,
    }
}

impl QuotaClient {
    /// Opens a stream to the server at `addr` for `domain`, reporting every `interval`
    /// (Envoy's `reporting_interval`; more than 100 ms).
    pub async fn connect(
        addr: SocketAddr,
        domain: &str,
        interval: Duration,
    ) -> Result<Self, tonic::transport::Error> {
        Self::connect_keeping(addr, domain, interval, None).await
    }

    /// [`QuotaClient::connect`], keeping what `previous` (a broken stream's client) holds:
    /// its assignments stay in force until they expire, as Envoy's do across reconnects.
    pub async fn connect_keeping(
        addr: SocketAddr,
        domain: &str,
        interval: Duration,
        previous: Option<&QuotaClient>,
    ) -> Result<Self, tonic::transport::Error> {
        let mut client = RateLimitQuotaServiceClient::connect(format!("http://{addr}")).await?;
        let (tx, rx) = mpsc::channel(64);
        let state = Arc::new(Mutex::new(State::default()));
        if let Some(p) = previous {
            let old = p.state.lock().unwrap_or_else(PoisonError::into_inner);
            state.lock().unwrap_or_else(PoisonError::into_inner).buckets = old.buckets.clone();
        }
        let this = Self {
            domain: domain.to_owned(),
            state: state.clone(),
            reports: tx,
        };
        // Subscriptions of what is held again, on the new stream.
        this.report_all();
        let response = client
            .stream_rate_limit_quotas(ReceiverStream::new(rx))
            .await;
        let mut inbound = match response {
            Ok(r) => r.into_inner(),
            Err(status) => {
                state.lock().unwrap_or_else(PoisonError::into_inner).ended = Some(status);
                return Ok(this);
            }
        };
        let s = state.clone();
        tokio::spawn(async move {
            loop {
                let msg = inbound.message().await;
                let mut st = s.lock().unwrap_or_else(PoisonError::into_inner);
                match msg {
                    Ok(Some(resp)) => {
                        let now = Instant::now();
                        for a in resp.bucket_action {
                            let (Some(id), Some(action)) = (a.bucket_id, a.bucket_action) else {
                                continue;
                            };
                            let q = match action {
                                Action::QuotaAssignmentAction(q) => q,
                                Action::AbandonAction(_) => {
                                    // Forgotten, reports and all, until its next request.
                                    st.buckets.remove(&entries(&id));
                                    st.abandoned += 1;
                                    continue;
                                }
                            };
                            let Some(strategy) = q.rate_limit_strategy.and_then(|r| r.strategy)
                            else {
                                continue;
                            };
                            let ttl = q.assignment_time_to_live.map(|d| {
                                Duration::new(d.seconds.max(0) as u64, d.nanos.max(0) as u32)
                            });
                            if let Some(b) = st.buckets.get_mut(&entries(&id)) {
                                b.held.apply(strategy, ttl, now);
                                st.received += 1;
                            }
                        }
                    }
                    Ok(None) => {
                        st.ended = Some(tonic::Status::ok("the server closed the stream"));
                        return;
                    }
                    Err(status) => {
                        st.ended = Some(status);
                        return;
                    }
                }
            }
        });
        let weak = Arc::downgrade(&state);
        let ticker = this.clone_with(weak);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            loop {
                tick.tick().await;
                if !ticker.tick(interval) {
                    return;
                }
            }
        });
        Ok(this)
    }

    /// A handle for the reporting task that does not keep the client alive.
    fn clone_with(&self, state: std::sync::Weak<Mutex<State>>) -> Ticker {
        Ticker {
            domain: self.domain.clone(),
            state,
            reports: self.reports.clone(),
        }
    }

    /// Decides a request of the bucket `entries` now (the first one subscribes it).
    pub fn admit(&self, entries: &[(&str, &str)]) -> bool {
        let key: Entries = {
            let mut v: Entries = entries
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect();
            v.sort_unstable();
            v
        };
        let now = Instant::now();
        let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let new = !s.buckets.contains_key(&key);
        let b = s.buckets.entry(key.clone()).or_insert_with(|| Bucket {
            id: BucketId {
                bucket: key.iter().cloned().collect(),
            },
            held: Held::None,
            allowed: 0,
            denied: 0,
            reported: now,
        });
        let ok = b.held.admit(now);
        if ok {
            b.allowed += 1;
        } else {
            b.denied += 1;
        }
        if new {
            let usage = usage(b, now);
            drop(s);
            let _ = self.reports.try_send(RateLimitQuotaUsageReports {
                domain: self.domain.clone(),
                bucket_quota_usages: vec![usage],
            });
        }
        ok
    }

    /// Reports every bucket.
    fn report_all(&self) {
        let now = Instant::now();
        let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let usages: Vec<BucketQuotaUsage> = s.buckets.values_mut().map(|b| usage(b, now)).collect();
        drop(s);
        if !usages.is_empty() {
            let _ = self.reports.try_send(RateLimitQuotaUsageReports {
                domain: self.domain.clone(),
                bucket_quota_usages: usages,
            });
        }
    }

    /// Assignments received (blanket rules included).
    pub fn received(&self) -> u64 {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .received
    }

    /// Buckets the server abandoned.
    pub fn abandoned(&self) -> u64 {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .abandoned
    }

    /// How the stream ended, if it did.
    pub fn ended(&self) -> Option<tonic::Status> {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .ended
            .clone()
    }
}

/// The usage of `b` since its last report, which it becomes.
fn usage(b: &mut Bucket, now: Instant) -> BucketQuotaUsage {
    let elapsed = now.duration_since(b.reported).max(Duration::from_micros(1));
    let u = BucketQuotaUsage {
        bucket_id: Some(b.id.clone()),
        time_elapsed: Some(pb(elapsed)),
        num_requests_allowed: b.allowed,
        num_requests_denied: b.denied,
    };
    b.allowed = 0;
    b.denied = 0;
    b.reported = now;
    u
}

fn entries(id: &BucketId) -> Entries {
    let mut v: Entries = id
        .bucket
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    v.sort_unstable();
    v
}

/// The reporting task's view of a client.
struct Ticker {
    domain: String,
    state: std::sync::Weak<Mutex<State>>,
    reports: mpsc::Sender<RateLimitQuotaUsageReports>,
}

impl Ticker {
    /// Reports the buckets due; false once the client is gone or its stream ended.
    fn tick(&self, interval: Duration) -> bool {
        let Some(state) = self.state.upgrade() else {
            return false;
        };
        let now = Instant::now();
        let mut s = state.lock().unwrap_or_else(PoisonError::into_inner);
        if s.ended.is_some() {
            return false;
        }
        let usages: Vec<BucketQuotaUsage> = s
            .buckets
            .values_mut()
            .filter(|b| now.duration_since(b.reported) + Duration::from_millis(5) >= interval)
            .map(|b| usage(b, now))
            .collect();
        drop(s);
        if !usages.is_empty()
            && self
                .reports
                .try_send(RateLimitQuotaUsageReports {
                    domain: self.domain.clone(),
                    bucket_quota_usages: usages,
                })
                .is_err()
        {
            return !self.reports.is_closed();
        }
        true
    }
}
