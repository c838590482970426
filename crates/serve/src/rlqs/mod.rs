//! Envoy's rate limit quota service (RLQS, `envoy.service.rate_limit_quota.v3`), on the
//! same gRPC port as the rate limit service: Envoy's `rate_limit_quota` filter reports
//! usage per bucket on a stream and enforces the token buckets this server assigns, so it
//! decides locally and calls nobody per request.
//!
//! **Buckets.** A stream's first message names its domain (the YAML's `domain`). A bucket
//! id's entries, ordered by key, are a descriptor of that domain, matched as the rate limit
//! service matches one (`{name: api, tenant: acme}` is the descriptor `(name, api),
//! (tenant, acme)`): a limit that is a Leasehold rule is assigned token buckets; an
//! unlimited limit, a shadow-mode one, or no match gets `ALLOW_ALL`; `requests_per_unit: 0`
//! gets `DENY_ALL` (both without expiry).
//!
//! **Tiers.** Every key (rule and subject) a stream reports is held by this process as one
//! agent of the global bucket, by rate lease ([`leasehold_core::tier`]): its share and
//! burst are handed on to the streams reporting the key, by their demand, as token
//! buckets whose total keeps the bound. The store sees a call per key every third of a
//! term, however many streams and requests there are; several processes share a key as
//! agents do. A stream that ends leaves its assignments counted until they expire. A
//! bucket whose reports show no request for a minute (`Options::rlqs_idle`) is
//! abandoned: the client forgets it until its next request.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use envoy_types::pb::envoy::r#type::v3::{RateLimitStrategy, TokenBucket};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::BucketAction;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::{
    AbandonAction, BucketAction as Action, QuotaAssignmentAction,
};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_server::{
    RateLimitQuotaService, RateLimitQuotaServiceServer,
};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use envoy_types::pb::google::protobuf::{Duration as PbDuration, UInt32Value};
use leasehold_core::key::BucketKey;
use leasehold_core::model::{AgentId, Request};
use leasehold_core::rule::{BucketParams, RuleName};
use leasehold_core::tier::{Assignment, Tier};
use tokio::sync::{Notify, mpsc};
use tonic::codegen::tokio_stream::wrappers::ReceiverStream;
use tonic::{Status, Streaming};

use crate::config;
use crate::decide::Decider;

pub mod client;

/// Responses a stream may have queued; a push that finds the queue full is dropped (the
/// client's assignment runs out, and the next one is a new bucket).
const QUEUE: usize = 64;

/// A tier with nothing due looks again this often (it is woken by reports too).
const IDLE_WAKE: Duration = Duration::from_millis(250);

/// A failed store call is tried again this much later.
const RETRY_AFTER: Duration = Duration::from_millis(100);

/// A bucket whose reports show no request for this long is abandoned, unless the options
/// say otherwise.
const IDLE: Duration = Duration::from_secs(60);

type Push = Result<RateLimitQuotaResponse, Status>;

/// The RLQS service.
#[derive(Clone, Debug)]
pub struct Rlqs {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    decider: Arc<Decider>,
    seq: AtomicU64,
    streams: AtomicU64,
    start: Instant,
    tiers: Mutex<HashMap<String, Arc<KeyTier>>>,
    /// True once the server stops: streams end (so Envoy reconnects elsewhere) rather
    /// than hold the shutdown.
    stopping: tokio::sync::watch::Receiver<bool>,
}

#[derive(Debug)]
struct KeyTier {
    /// Its identity in the store, drawn as the limiter draws its own: one per tier, so a
    /// tier that ends (and releases its record) never touches a later one's of the key.
    agent: AgentId,
    key: BucketKey,
    params: BucketParams,
    state: Mutex<TierState>,
    wake: Notify,
    /// Its task runs (started by the first stream to report the key, once it has).
    started: std::sync::atomic::AtomicBool,
}

#[derive(Debug, Default)]
struct TierState {
    tier: Tier,
    /// The tier ended: a stream that still holds it looks the key up again.
    closed: bool,
    /// Each stream reporting the key: where its pushes go, and its bucket id.
    clients: HashMap<u64, (mpsc::Sender<Push>, BucketId)>,
}

impl Rlqs {
    /// Assigns buckets with `decider`'s limits and store; ends every stream with
    /// `UNAVAILABLE` once `stopping` turns true.
    pub fn new(decider: Arc<Decider>, stopping: tokio::sync::watch::Receiver<bool>) -> Self {
        Self {
            shared: Arc::new(Shared {
                decider,
                seq: AtomicU64::new(0),
                streams: AtomicU64::new(0),
                start: Instant::now(),
                tiers: Mutex::default(),
                stopping,
            }),
        }
    }

    /// As a tonic service.
    pub fn into_server(self) -> RateLimitQuotaServiceServer<Self> {
        RateLimitQuotaServiceServer::new(self)
    }
}

fn pb_duration(ns: u64) -> PbDuration {
    PbDuration {
        seconds: (ns / 1_000_000_000) as i64,
        nanos: (ns % 1_000_000_000) as i32,
    }
}

fn blanket(bucket: BucketId, rule: BlanketRule) -> RateLimitQuotaResponse {
    RateLimitQuotaResponse {
        bucket_action: vec![BucketAction {
            bucket_id: Some(bucket),
            bucket_action: Some(Action::QuotaAssignmentAction(QuotaAssignmentAction {
                assignment_time_to_live: None,
                rate_limit_strategy: Some(RateLimitStrategy {
                    strategy: Some(Strategy::BlanketRule(rule as i32)),
                }),
            })),
        }],
    }
}

fn abandon(bucket: BucketId) -> RateLimitQuotaResponse {
    RateLimitQuotaResponse {
        bucket_action: vec![BucketAction {
            bucket_id: Some(bucket),
            bucket_action: Some(Action::AbandonAction(AbandonAction {})),
        }],
    }
}

fn assignment(bucket: BucketId, a: &Assignment) -> RateLimitQuotaResponse {
    let s = a.strategy;
    RateLimitQuotaResponse {
        bucket_action: vec![BucketAction {
            bucket_id: Some(bucket),
            bucket_action: Some(Action::QuotaAssignmentAction(QuotaAssignmentAction {
                assignment_time_to_live: Some(pb_duration(a.ttl_ns)),
                rate_limit_strategy: Some(RateLimitStrategy {
                    strategy: Some(Strategy::TokenBucket(TokenBucket {
                        max_tokens: u32::try_from(s.max_tokens).unwrap_or(u32::MAX),
                        tokens_per_fill: Some(UInt32Value {
                            value: s.tokens_per_fill,
                        }),
                        fill_interval: Some(pb_duration(s.fill_interval_ns)),
                    })),
                }),
            })),
        }],
    }
}

/// What a bucket id stands for.
enum Bucket {
    Blanket(BlanketRule),
    Tier(Arc<KeyTier>),
}

impl Shared {
    fn now_ns(&self) -> u64 {
        self.start.elapsed().as_nanos() as u64
    }

    /// Sends `op` of tier `t` to the store, counted.
    async fn call(
        &self,
        store: &leasehold_store::Store,
        t: &KeyTier,
        op: leasehold_core::model::Op,
    ) -> Result<leasehold_core::model::Reply, leasehold_store::StoreError> {
        let req = Request {
            agent: t.agent,
            seq: self.seq.fetch_add(1, Ordering::Relaxed) + 1,
            op,
        };
        self.decider.count_tier_call();
        store.call(&t.key, &t.params, &req).await
    }

    /// The bucket `id` of `domain`: a tier of its key (its task started by the stream
    /// once it reported to it), or a blanket rule.
    fn bucket(self: &Arc<Self>, domain: &str, id: &BucketId) -> Result<Bucket, Status> {
        let mut entries: Vec<(&str, &str)> = id
            .bucket
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        if entries.is_empty() {
            return Err(Status::invalid_argument("bucket_id has no entries"));
        }
        entries.sort_unstable();
        let domains = self.decider.domains();
        let Some(m) = domains.find(domain, &entries) else {
            return Ok(Bucket::Blanket(BlanketRule::AllowAll));
        };
        let rule = match &m.limit.action {
            _ if m.limit.shadow => return Ok(Bucket::Blanket(BlanketRule::AllowAll)),
            config::Action::Unlimited => return Ok(Bucket::Blanket(BlanketRule::AllowAll)),
            config::Action::DenyAll => return Ok(Bucket::Blanket(BlanketRule::DenyAll)),
            config::Action::Rule(rule) => rule,
        };
        let limiter = self.decider.limiter();
        let name = RuleName::new(rule.as_str()).map_err(|e| Status::internal(e.to_string()))?;
        let key = BucketKey::new(&name, m.subject.as_bytes())
            .map_err(|e| Status::invalid_argument(format!("bucket_id: {e}")))?;
        let params = limiter
            .bucket_params_for(rule, m.subject.as_bytes())
            .map_err(|e| Status::unavailable(e.to_string()))?;
        let mut tiers = self.tiers.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(t) = tiers.get(key.as_str())
            && t.params == params
        {
            return Ok(Bucket::Tier(t.clone()));
        }
        let t = Arc::new(KeyTier {
            agent: AgentId(rand::random::<u64>().max(1)),
            key: key.clone(),
            params,
            state: Mutex::default(),
            wake: Notify::new(),
            started: std::sync::atomic::AtomicBool::new(false),
        });
        tiers.insert(key.as_str().to_owned(), t.clone());
        Ok(Bucket::Tier(t))
    }
}

/// One key's tier: calls the store when due, pushes the assignments; ends when no stream
/// reports the key and nothing assigned runs.
async fn drive(shared: Arc<Shared>, t: Arc<KeyTier>) {
    let store = shared.decider.limiter().store().clone();
    loop {
        let (op, closing) = {
            let mut s = t.state.lock().unwrap_or_else(PoisonError::into_inner);
            let now = shared.now_ns();
            if s.tier.idle(now) {
                s.closed = true;
                let mut tiers = shared.tiers.lock().unwrap_or_else(PoisonError::into_inner);
                if tiers
                    .get(t.key.as_str())
                    .is_some_and(|x| Arc::ptr_eq(x, &t))
                {
                    tiers.remove(t.key.as_str());
                }
                // Nothing assigned runs any more: the share goes back at once (a process
                // killed leaves it to expire with its record).
                (s.tier.release(now), true)
            } else {
                (s.tier.due(now).then(|| s.tier.call(&t.params, now)), false)
            }
        };
        if closing {
            if let Some(op) = op
                && let Err(e) = shared.call(&store, &t, op).await
            {
                tracing::debug!(key = %t.key.for_logs(), error = %e, "RLQS tier: release failed; the record expires");
            }
            return;
        }
        if let Some(op) = op {
            match shared.call(&store, &t, op).await {
                Ok(reply) => {
                    let mut s = t.state.lock().unwrap_or_else(PoisonError::into_inner);
                    let now = shared.now_ns();
                    let out = s.tier.granted(&t.params, &reply, now);
                    for a in out {
                        let Some((tx, id)) = s.clients.get(&a.client) else {
                            s.tier.undelivered(a.client);
                            continue;
                        };
                        if tx.try_send(Ok(assignment(id.clone(), &a))).is_err() {
                            s.tier.undelivered(a.client);
                        } else {
                            metrics::counter!("leasehold_rlqs_assignments_total", "kind" => if a.new { "new" } else { "extension" })
                                .increment(1);
                        }
                    }
                }
                Err(e) => {
                    t.state
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .tier
                        .failed();
                    tracing::warn!(key = %t.key.for_logs(), error = %e, "RLQS tier: store call failed");
                    tokio::time::sleep(RETRY_AFTER).await;
                    continue;
                }
            }
        }
        let wait = {
            let s = t.state.lock().unwrap_or_else(PoisonError::into_inner);
            let now = shared.now_ns();
            Duration::from_nanos(s.tier.renew_at_ns().saturating_sub(now)).min(IDLE_WAKE)
        };
        let _ = tokio::time::timeout(wait, t.wake.notified()).await;
    }
}

/// A bucket a stream reported: its tier (none for a blanket rule), its id, and when its
/// reports last showed a request.
type Reported = (Option<Arc<KeyTier>>, BucketId, Instant);

/// Reads one stream's reports until it ends.
async fn stream(
    shared: Arc<Shared>,
    id: u64,
    mut inbound: Streaming<RateLimitQuotaUsageReports>,
    tx: mpsc::Sender<Push>,
) {
    let mut domain: Option<String> = None;
    // The buckets this stream reported, by their sorted entries.
    let mut buckets: HashMap<Vec<(String, String)>, Reported> = HashMap::new();
    let idle = shared.decider.options().rlqs_idle.unwrap_or(IDLE);
    let mut check = tokio::time::interval((idle / 4).max(Duration::from_millis(10)));
    let mut stopping = shared.stopping.clone();
    loop {
        let message = tokio::select! {
            m = inbound.message() => m,
            _ = stopping.wait_for(|s| *s) => {
                let _ = tx.try_send(Err(Status::unavailable("the server is stopping")));
                break;
            }
            _ = check.tick() => {
                // Buckets with no request for the idle time: abandoned, their tiers told
                // the stream is gone for them.
                let now = Instant::now();
                let stale: Vec<_> = buckets
                    .iter()
                    .filter(|(_, (_, _, seen))| now.duration_since(*seen) >= idle)
                    .map(|(k, _)| k.clone())
                    .collect();
                for k in stale {
                    if let Some((tier, bid, _)) = buckets.remove(&k) {
                        if let Some(t) = tier {
                            let mut s = t.state.lock().unwrap_or_else(PoisonError::into_inner);
                            s.clients.remove(&id);
                            s.tier.gone(id);
                        }
                        let _ = tx.try_send(Ok(abandon(bid)));
                    }
                }
                continue;
            }
        };
        let reports = match message {
            Ok(Some(r)) => r,
            Ok(None) => break,
            Err(e) => {
                tracing::debug!(stream = id, error = %e, "RLQS stream ended");
                break;
            }
        };
        let d = match &domain {
            Some(d) => d.clone(),
            None if reports.domain.is_empty() => {
                let _ = tx
                    .send(Err(Status::invalid_argument(
                        "the first report must name the domain",
                    )))
                    .await;
                break;
            }
            None => {
                domain = Some(reports.domain.clone());
                reports.domain.clone()
            }
        };
        let mut failed = None;
        for usage in &reports.bucket_quota_usages {
            let Some(bid) = usage.bucket_id.as_ref() else {
                failed = Some(Status::invalid_argument("a usage report has no bucket_id"));
                break;
            };
            let mut sorted: Vec<(String, String)> = bid
                .bucket
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            sorted.sort_unstable();
            let elapsed = usage.time_elapsed.map_or(0, |t| {
                (t.seconds.max(0) as u64)
                    .saturating_mul(1_000_000_000)
                    .saturating_add(t.nanos.max(0) as u64)
            });
            let requests = usage.num_requests_allowed + usage.num_requests_denied;
            let tier = match buckets.get_mut(&sorted) {
                Some((t, _, seen)) => {
                    if requests > 0 {
                        *seen = Instant::now();
                    }
                    t.clone()
                }
                None => match shared.bucket(&d, bid) {
                    Ok(Bucket::Blanket(rule)) => {
                        if tx.try_send(Ok(blanket(bid.clone(), rule))).is_err() {
                            continue;
                        }
                        buckets.insert(sorted.clone(), (None, bid.clone(), Instant::now()));
                        None
                    }
                    Ok(Bucket::Tier(t)) => {
                        buckets.insert(
                            sorted.clone(),
                            (Some(t.clone()), bid.clone(), Instant::now()),
                        );
                        Some(t)
                    }
                    Err(status) => {
                        failed = Some(status);
                        break;
                    }
                },
            };
            let mut tier = tier;
            while let Some(t) = tier.take() {
                let mut s = t.state.lock().unwrap_or_else(PoisonError::into_inner);
                if s.closed {
                    // The tier ended (nothing ran) since this stream last reported: the
                    // key's current one takes the report.
                    drop(s);
                    if let Ok(Bucket::Tier(next)) = shared.bucket(&d, bid) {
                        if let Some(e) = buckets.get_mut(&sorted) {
                            e.0 = Some(next.clone());
                        }
                        tier = Some(next);
                    }
                    continue;
                }
                s.clients.insert(id, (tx.clone(), bid.clone()));
                s.tier.report(
                    id,
                    usage.num_requests_allowed,
                    usage.num_requests_denied,
                    elapsed,
                    shared.now_ns(),
                );
                drop(s);
                if !t.started.swap(true, Ordering::AcqRel) {
                    tokio::spawn(drive(shared.clone(), t.clone()));
                }
                t.wake.notify_one();
            }
        }
        if let Some(status) = failed {
            let _ = tx.send(Err(status)).await;
            break;
        }
    }
    for t in buckets.into_values().filter_map(|(t, ..)| t) {
        let mut s = t.state.lock().unwrap_or_else(PoisonError::into_inner);
        s.clients.remove(&id);
        s.tier.gone(id);
    }
}

#[tonic::async_trait]
impl RateLimitQuotaService for Rlqs {
    type StreamRateLimitQuotasStream = ReceiverStream<Push>;

    async fn stream_rate_limit_quotas(
        &self,
        request: tonic::Request<Streaming<RateLimitQuotaUsageReports>>,
    ) -> Result<tonic::Response<Self::StreamRateLimitQuotasStream>, Status> {
        let (tx, rx) = mpsc::channel(QUEUE);
        let id = self.shared.streams.fetch_add(1, Ordering::Relaxed) + 1;
        tokio::spawn(stream(self.shared.clone(), id, request.into_inner(), tx));
        Ok(tonic::Response::new(ReceiverStream::new(rx)))
    }
}
