//! The systems measured side by side: Leasehold's agents, the naive per-request Lua
//! script, and governor (local only).

use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use governor::{Quota, RateLimiter};
use leasehold::agent::{Decision, Limiter, LimiterConfig, Rules, Store};
use leasehold::core::rule::Rule;
use leasehold_serve::rlqs::client::QuotaClient;
use leasehold_serve::{Decider, Domains};
use parking_lot::Mutex;

use super::AgentFaults;
use super::env::Target;
use super::scenario::{self};

pub(super) const RULE: &str = "sim";

/// The naive baseline: a per-request token bucket in one Lua script call (seed 003,
/// with the decision made atomically in the script).
pub(super) const NAIVE_LUA: &str = include_str!("naive.lua");

/// Per key: tokens (fractional, as the seed's script) and the last refill, µs.
pub(super) type NaiveShard = Mutex<std::collections::HashMap<u32, (f64, u64)>>;

pub(super) enum Naive {
    Redis(redis::aio::ConnectionManager, redis::Script),
    Cluster(redis::cluster_async::ClusterConnection, redis::Script),
    Embedded(Arc<Vec<NaiveShard>>, Arc<AtomicBool>),
}

pub(super) enum System {
    Leasehold {
        agents: Vec<Mutex<Option<Limiter>>>,
        crashed_calls: AtomicU64,
    },
    Naive {
        naive: Naive,
        calls: AtomicU64,
        cap: f64,
        rate: f64,
    },
    Governor(Vec<governor::DefaultKeyedRateLimiter<u32>>),
    /// Envoys' rate limit quota filters (one per agent) on `leasehold serve` instances.
    Rlqs(Rlqs),
}

/// Stops a serve instance once.
type StopServer = Mutex<Option<tokio::sync::oneshot::Sender<()>>>;

/// The `rlqs` system: `servers` serve instances on the store, each with the scenario's
/// rule as a YAML limit, and a [`QuotaClient`] per agent on one of them (agent i on
/// server i mod n), deciding locally.
pub(super) struct Rlqs {
    servers: Vec<(Arc<Decider>, StopServer)>,
    clients: Vec<QuotaClient>,
}

/// The scenario's rule as a YAML limit of domain `sim`, descriptor key `key`: its rate
/// per the smallest unit that makes it whole, its capacity in the Leasehold block.
fn rlqs_yaml(rule: &Rule) -> Result<String, String> {
    let (tokens, period_us) = (
        rule.rate().tokens() as u128,
        rule.rate().period_us() as u128,
    );
    let unit = [
        ("second", 1_000_000u128),
        ("minute", 60_000_000),
        ("hour", 3_600_000_000),
        ("day", 86_400_000_000),
    ]
    .into_iter()
    .find(|(_, us)| {
        (tokens * us) % period_us == 0 && tokens * us / period_us <= u128::from(u32::MAX)
    });
    let Some((unit, us)) = unit else {
        return Err(format!(
            "rlqs: the rule's rate {} is not a whole number of requests per second, minute, hour or day",
            rule.rate()
        ));
    };
    Ok(format!(
        "domain: sim\ndescriptors:\n  - key: key\n    rate_limit: {{unit: {unit}, requests_per_unit: {}}}\n    leasehold: {{capacity: {}}}\n",
        tokens * us / period_us,
        rule.capacity().get()
    ))
}

impl Rlqs {
    async fn start(
        rule: &Rule,
        agents: usize,
        servers: usize,
        target: &Target,
    ) -> Result<Self, String> {
        let yaml = rlqs_yaml(rule)?;
        let mut started = Vec::new();
        let mut addrs = Vec::new();
        for _ in 0..servers.max(1) {
            let domains = Domains::from_yaml(&yaml, "rlqs scenario").map_err(|e| e.to_string())?;
            let b = Limiter::builder().rules(domains.rules());
            let b = match target {
                Target::Embedded(store) => b.store(Store::Embedded(store.clone())),
                Target::Redis(url) => b.redis(url),
                Target::Cluster(nodes) => b.cluster(nodes.clone()),
            };
            let limiter = b.build().await.map_err(|e| e.to_string())?;
            let decider = Decider::new(limiter, domains, Default::default());
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .map_err(|e| e.to_string())?;
            addrs.push(listener.local_addr().map_err(|e| e.to_string())?);
            let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
            tokio::spawn(leasehold_serve::serve(
                decider.clone(),
                Some(listener),
                None,
                None,
                leasehold_net::Limits::default(),
                async {
                    let _ = stopped.await;
                },
            ));
            started.push((decider, Mutex::new(Some(stop))));
        }
        let mut clients = Vec::with_capacity(agents);
        for i in 0..agents {
            clients.push(
                QuotaClient::connect(addrs[i % addrs.len()], "sim", RLQS_REPORTING)
                    .await
                    .map_err(|e| e.to_string())?,
            );
        }
        Ok(Self {
            servers: started,
            clients,
        })
    }
}

/// The filters' reporting interval.
const RLQS_REPORTING: Duration = Duration::from_secs(1);

pub(super) enum Outcome {
    Admitted,
    Denied,
    Unavailable,
}

impl System {
    #[allow(clippy::too_many_arguments)] // one call per system and run
    pub(super) async fn build(
        name: &str,
        rule: &Rule,
        rules: &Rules,
        agents: usize,
        tuning: &scenario::AgentTuning,
        target: &Target,
        naive_offline: &Arc<AtomicBool>,
        rlqs_servers: usize,
    ) -> Result<Self, String> {
        match name {
            "leasehold" => {
                let config = tuning.apply(LimiterConfig::default())?;
                let mut limiters = Vec::with_capacity(agents);
                for _ in 0..agents {
                    let b = Limiter::builder()
                        .rules(rules.clone())
                        .config(config.clone());
                    let b = match target {
                        Target::Embedded(store) => b.store(Store::Embedded(store.clone())),
                        Target::Redis(url) => b.redis(url),
                        Target::Cluster(nodes) => b.cluster(nodes.clone()),
                    };
                    limiters.push(Mutex::new(Some(
                        b.build().await.map_err(|e| e.to_string())?,
                    )));
                }
                Ok(Self::Leasehold {
                    agents: limiters,
                    crashed_calls: AtomicU64::new(0),
                })
            }
            "naive" => {
                let script = redis::Script::new(NAIVE_LUA);
                let naive = match target {
                    Target::Redis(url) => {
                        let client =
                            redis::Client::open(url.as_str()).map_err(|e| e.to_string())?;
                        let conn = redis::aio::ConnectionManager::new(client)
                            .await
                            .map_err(|e| e.to_string())?;
                        Naive::Redis(conn, script)
                    }
                    Target::Cluster(nodes) => {
                        let client = redis::cluster::ClusterClient::new(nodes.clone())
                            .map_err(|e| e.to_string())?;
                        let conn = client
                            .get_async_connection()
                            .await
                            .map_err(|e| e.to_string())?;
                        Naive::Cluster(conn, script)
                    }
                    Target::Embedded(_) => Naive::Embedded(
                        Arc::new((0..64).map(|_| Mutex::default()).collect()),
                        naive_offline.clone(),
                    ),
                };
                Ok(Self::Naive {
                    naive,
                    calls: AtomicU64::new(0),
                    cap: rule.capacity().get() as f64,
                    rate: rule.rate().per_sec_f64(),
                })
            }
            "governor" => {
                let n = agents as f64;
                let period = Duration::from_secs_f64(n / rule.rate().per_sec_f64());
                let burst =
                    NonZeroU32::new(((rule.capacity().get() as f64 / n).ceil() as u32).max(1))
                        .unwrap_or(NonZeroU32::MIN);
                let quota = Quota::with_period(period)
                    .ok_or("governor cannot express this rate")?
                    .allow_burst(burst);
                Ok(Self::Governor(
                    (0..agents).map(|_| RateLimiter::keyed(quota)).collect(),
                ))
            }
            "rlqs" => Ok(Self::Rlqs(
                Rlqs::start(rule, agents, rlqs_servers, target).await?,
            )),
            other => Err(format!("unknown system {other:?}: naive, governor, rlqs")),
        }
    }

    pub(super) fn limiter(&self, agent: usize) -> Option<Limiter> {
        match self {
            Self::Leasehold { agents, .. } => agents[agent].lock().clone(),
            _ => None,
        }
    }

    /// The agent leaves the fleet in good order: its leases go back, it stops.
    pub(super) async fn leave(&self, agent: usize) {
        if let Self::Leasehold {
            agents,
            crashed_calls,
        } = self
        {
            let taken = agents[agent].lock().take();
            if let Some(l) = taken {
                l.shutdown().await;
                crashed_calls.fetch_add(
                    l.stats(RULE).map_or(0, |s| s.store_calls),
                    Ordering::Relaxed,
                );
            }
        }
    }

    /// The agent dies: its leases are abandoned, nothing is returned.
    pub(super) fn crash(&self, agent: usize) {
        if let Self::Leasehold {
            agents,
            crashed_calls,
        } = self
            && let Some(l) = agents[agent].lock().take()
        {
            crashed_calls.fetch_add(
                l.stats(RULE).map_or(0, |s| s.store_calls),
                Ordering::Relaxed,
            );
        }
    }

    pub(super) async fn decide(
        &self,
        limiter: Option<&Limiter>,
        agent: usize,
        key: u32,
        subject: &str,
        cost: u64,
    ) -> Outcome {
        match self {
            Self::Leasehold { .. } => match limiter {
                Some(l) => match l.check(&RULE.into(), subject, cost).await {
                    Ok(Decision::Allowed { .. }) => Outcome::Admitted,
                    Ok(Decision::Denied { .. }) | Err(_) => Outcome::Denied,
                    Ok(Decision::Unavailable { .. }) => Outcome::Unavailable,
                },
                None => Outcome::Unavailable,
            },
            Self::Naive {
                naive,
                calls,
                cap,
                rate,
            } => {
                calls.fetch_add(1, Ordering::Relaxed);
                let invoke = |script| naive_call(script, subject, *cap, *rate, cost);
                let answer = |r: Result<i64, redis::RedisError>| match r {
                    Ok(1) => Outcome::Admitted,
                    Ok(_) => Outcome::Denied,
                    Err(_) => Outcome::Unavailable,
                };
                match naive {
                    Naive::Redis(conn, script) => {
                        answer(invoke(script).invoke_async(&mut conn.clone()).await)
                    }
                    Naive::Cluster(conn, script) => {
                        answer(invoke(script).invoke_async(&mut conn.clone()).await)
                    }
                    Naive::Embedded(_, offline) if offline.load(Ordering::Acquire) => {
                        Outcome::Unavailable
                    }
                    Naive::Embedded(shards, _) => {
                        let mut shard = shards[key as usize % shards.len()].lock();
                        // The clock is read under the lock, as TIME is inside the script:
                        // a time read before waiting could move `ts` back and count
                        // the same interval twice.
                        let now = std::time::SystemTime::now()
                            .duration_since(std::time::UNIX_EPOCH)
                            .map_or(0, |d| d.as_micros() as u64);
                        let (tokens, ts) = shard.entry(key).or_insert((*cap, now));
                        *tokens = (*tokens + now.saturating_sub(*ts) as f64 * rate / 1e6).min(*cap);
                        *ts = (*ts).max(now);
                        if *tokens >= cost as f64 {
                            *tokens -= cost as f64;
                            Outcome::Admitted
                        } else {
                            Outcome::Denied
                        }
                    }
                }
            }
            Self::Rlqs(r) => {
                // A filter's bucket takes one request at a time: a cost of n is n of them.
                let client = &r.clients[agent];
                let _ = key;
                if (0..cost).all(|_| client.admit(&[("key", subject)])) {
                    Outcome::Admitted
                } else {
                    Outcome::Denied
                }
            }
            Self::Governor(limiters) => {
                let n = NonZeroU32::new(cost as u32).unwrap_or(NonZeroU32::MIN);
                match limiters[agent].check_key_n(&key, n) {
                    Ok(Ok(())) => Outcome::Admitted,
                    _ => Outcome::Denied,
                }
            }
        }
    }

    /// The rlqs run's servers, filters, assignments and store calls over `secs`.
    pub(super) fn rlqs_summary(&self, secs: f64) -> Option<super::RlqsSummary> {
        let Self::Rlqs(r) = self else {
            return None;
        };
        let assignments: u64 = r.clients.iter().map(QuotaClient::received).sum();
        let calls: u64 = r.servers.iter().map(|(d, _)| d.tier_calls()).sum();
        Some(super::RlqsSummary {
            servers: r.servers.len(),
            filters: r.clients.len(),
            assignments_per_sec: assignments as f64 / secs.max(1e-9),
            calls_per_sec: calls as f64 / secs.max(1e-9),
        })
    }

    /// What the live agents' counters say about the store's health during the run.
    pub(super) fn agent_faults(&self) -> Option<AgentFaults> {
        let Self::Leasehold { agents, .. } = self else {
            return None;
        };
        let mut f = AgentFaults::default();
        for a in agents {
            if let Some(s) = a.lock().as_ref().and_then(|l| l.stats(RULE).ok()) {
                f.store_errors += s.store_errors;
                f.emergency_activations += s.emergency_activations;
                f.admitted_emergency += s.admitted_emergency;
                f.admitted_fail_open += s.admitted_fail_open;
                f.unavailable += s.unavailable;
            }
        }
        Some(f)
    }

    pub(super) fn redis_calls(&self) -> u64 {
        match self {
            Self::Leasehold {
                agents,
                crashed_calls,
            } => {
                crashed_calls.load(Ordering::Relaxed)
                    + agents
                        .iter()
                        .filter_map(|a| {
                            a.lock()
                                .as_ref()
                                .map(|l| l.stats(RULE).map_or(0, |s| s.store_calls))
                        })
                        .sum::<u64>()
            }
            Self::Naive { calls, .. } => calls.load(Ordering::Relaxed),
            Self::Governor(_) => 0,
            Self::Rlqs(r) => r.servers.iter().map(|(d, _)| d.tier_calls()).sum(),
        }
    }

    /// Stops the system's servers and agents; the ids of the agents that reported to the
    /// store.
    pub(super) async fn finish(&self) -> Vec<leasehold::core::model::AgentId> {
        let mut ids = Vec::new();
        if let Self::Rlqs(r) = self {
            // The servers stop (their streams end, so their tiers call no more), then
            // their limiters.
            for (d, stop) in &r.servers {
                if let Some(stop) = stop.lock().take() {
                    let _ = stop.send(());
                }
                d.limiter().shutdown().await;
                ids.push(d.limiter().agent_id());
            }
        }
        if let Self::Leasehold { agents, .. } = self {
            let limiters: Vec<Limiter> = agents.iter().filter_map(|a| a.lock().clone()).collect();
            for l in limiters {
                l.shutdown().await;
                ids.push(l.agent_id());
            }
        }
        ids
    }
}

/// One call of the naive script for `subject`.
pub(super) fn naive_call<'a>(
    script: &'a redis::Script,
    subject: &str,
    cap: f64,
    rate: f64,
    cost: u64,
) -> redis::ScriptInvocation<'a> {
    let mut inv = script.key(format!("naive:{{{subject}}}"));
    inv.arg(cap).arg(rate).arg(cost);
    inv
}
