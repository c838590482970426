//! The systems measured side by side: Leasehold's agents, the naive per-request Lua
//! script, and governor (local only).

use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use governor::{Quota, RateLimiter};
use leasehold::agent::{Decision, Limiter, LimiterConfig, Rules, Store};
use leasehold::core::rule::Rule;
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
}

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
            other => Err(format!("unknown system {other:?}: naive, governor")),
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
            Self::Governor(limiters) => {
                let n = NonZeroU32::new(cost as u32).unwrap_or(NonZeroU32::MIN);
                match limiters[agent].check_key_n(&key, n) {
                    Ok(Ok(())) => Outcome::Admitted,
                    _ => Outcome::Denied,
                }
            }
        }
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
        }
    }

    pub(super) async fn finish(&self) {
        if let Self::Leasehold { agents, .. } = self {
            let limiters: Vec<Limiter> = agents.iter().filter_map(|a| a.lock().clone()).collect();
            for l in limiters {
                l.shutdown().await;
            }
        }
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
