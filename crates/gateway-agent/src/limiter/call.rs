//! One store call: where it goes (the key's bucket or its split part), its breaker
//! permit, its sequence number and its retries.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use leasehold_core::model::{Op, Reply};
use tokio::time::Instant;

use crate::breaker::Refusal;
use crate::counters::Counter;
use crate::redis_store::{ErrorKind, StoreError};

use super::keys::{Driver, KeyState};
use super::route::{Dest, ROUTE_REFRESH_US, Route, dest};
use super::table::RuleEntry;
use super::{Limiter, once_per};

/// Why a store call did not happen or failed.
#[derive(Debug)]
pub(super) enum CallError {
    Refused(Refusal),
    Store(StoreError),
}

/// Records a store call's time (retries included) in `leasehold_store_call_seconds` when
/// dropped, so a call cancelled by its deadline is counted too.
pub(super) struct CallTimer {
    pub(super) shard: String,
    pub(super) op: &'static str,
    pub(super) started: Instant,
}

impl Drop for CallTimer {
    fn drop(&mut self) {
        metrics::histogram!(
            "leasehold_store_call_seconds",
            "shard" => std::mem::take(&mut self.shard),
            "op" => self.op
        )
        .record(self.started.elapsed().as_secs_f64());
    }
}

impl Limiter {
    /// An acquire or exact call to wherever the key's bucket is now: its own key, or the
    /// part of a split this agent uses. A reply saying the bucket moved (the parent is
    /// split, or the part's term is over) switches the route, after returning what the
    /// lease holds to the bucket that leased it, and the call is sent again.
    pub(super) async fn call(
        &self,
        ks: &KeyState,
        driver: &mut Driver,
        entry: &RuleEntry,
        mut op: Op,
    ) -> Result<Reply, CallError> {
        let now = self.now_ns();
        if driver.route.as_ref().is_some_and(|r| {
            let server_now = r.seen_server_us + now.saturating_sub(r.seen_ns) / 1000;
            r.split.until_us.saturating_sub(server_now) < ROUTE_REFRESH_US
                && now.saturating_sub(r.seen_ns) > 1_000_000_000
        }) {
            self.switch(ks, driver, entry, None, &mut op).await?;
        }
        let mut hops = 0;
        loop {
            driver.policy.called();
            let reply = self.send(dest(ks, driver, entry), entry, &op).await?;
            if !reply.moved {
                // Refused by its part while holding nothing from it: the next attempt
                // goes to the next part, so parts no agent starts on are drained too.
                let ending = matches!(op, Op::Acquire { .. }) && reply.ttl_us == 0;
                let read = matches!(op, Op::Exact { cost: 0 });
                let refused = reply.granted == 0 && !ending && !read;
                let empty = ks.hot().lease.held() == 0
                    && matches!(op, Op::Exact { .. } | Op::Acquire { held: 0, .. });
                if let Some(r) = &driver.route
                    && refused
                    && empty
                    && let Some(next) = r.next(&ks.bucket, &entry.params)
                {
                    driver.route = Some(Box::new(next));
                }
                return Ok(reply);
            }
            if hops == 2 {
                return Ok(reply);
            }
            hops += 1;
            let next = if driver.route.is_some() {
                None
            } else {
                // A parent answers `moved` only while a split is in force.
                let Some(split) = reply.split else {
                    return Ok(reply);
                };
                let first = self.inner.agent.0;
                let route = Route::new(
                    split,
                    first,
                    &ks.bucket,
                    &entry.params,
                    self.now_ns(),
                    reply.now_us,
                );
                if route.is_none() {
                    tracing::warn!(key = %ks.bucket.for_logs(), parts = split.parts, "split cannot be represented exactly; waiting for its end");
                    return Ok(reply);
                }
                route
            };
            self.switch(ks, driver, entry, next, &mut op).await?;
        }
    }

    /// Moves the key to another bucket (a part, or back to its own key): what the lease
    /// holds goes back to the bucket that leased it, and `op` declares an empty lease.
    pub(super) async fn switch(
        &self,
        ks: &KeyState,
        driver: &mut Driver,
        entry: &RuleEntry,
        next: Option<Route>,
        op: &mut Op,
    ) -> Result<(), CallError> {
        self.release(ks, driver, entry, false).await?;
        driver.route = next.map(Box::new);
        driver.policy.moved();
        if let Op::Acquire { held, .. } = op {
            *held = 0;
        }
        Ok(())
    }

    /// One store call through the key's breaker. Retries of a call whose outcome is
    /// unknown reuse its sequence number, so the store applies it at most once (I2).
    /// Every way out resolves the breaker's permit; a cancelled call drops it, which ends
    /// a probe without a verdict.
    pub(super) async fn send(
        &self,
        to: Dest<'_>,
        entry: &RuleEntry,
        op: &Op,
    ) -> Result<Reply, CallError> {
        let op = *op;
        let breaker = self.inner.breakers.for_slot(to.slot);
        let permit = breaker.enter(self.now_ns()).map_err(CallError::Refused)?;
        let req = leasehold_core::Request {
            agent: self.inner.agent,
            seq: self.inner.seq.fetch_add(1, Ordering::Relaxed) + 1,
            op,
        };
        let first = Instant::now();
        let _timed = CallTimer {
            shard: self.inner.breakers.shard_name(to.slot),
            op: match op {
                Op::Acquire { .. } => "acquire",
                Op::Release { .. } => "release",
                Op::Exact { .. } => "exact",
                Op::Split { .. } => "split",
                Op::Deposit { .. } => "deposit",
                Op::Rate { .. } => "rate",
            },
            started: first,
        };
        let replay_window = Duration::from_micros(entry.params.grace_us) / 2;
        let mut attempt = 0;
        loop {
            entry.counters.incr(Counter::StoreCalls);
            let replication = entry.rule.replication();
            match self
                .inner
                .store
                .call_replicated(to.key, to.params, &req, replication)
                .await
            {
                Ok(reply) => {
                    permit.succeeded(self.now_ns());
                    return Ok(reply);
                }
                Err(e) if e.is_retryable() && attempt < 2 && first.elapsed() < replay_window => {
                    attempt += 1;
                }
                Err(e) => {
                    entry.counters.incr(Counter::StoreErrors);
                    self.inner.error_kinds.incr(e.kind());
                    match e.kind() {
                        // The shard answered; the request itself was refused.
                        ErrorKind::Refused => permit.succeeded(self.now_ns()),
                        // Never sent: no verdict on the shard.
                        ErrorKind::Protocol => drop(permit),
                        _ => permit.failed(self.now_ns()),
                    }
                    if let StoreError::NotReplicated {
                        acked: 0, wanted, ..
                    } = &e
                    {
                        // No replica acknowledged at all: likely none is attached, and
                        // every grant of the rule is refused. Said once a minute.
                        static SAID: AtomicU64 = AtomicU64::new(0);
                        if once_per(&SAID, self.now_ns(), 60_000_000_000) {
                            tracing::warn!(
                                rule = %entry.name,
                                replicas = wanted,
                                "no replica acknowledged a grant: is one attached to the primary? \
                                 Until one is, the rule's failure policy decides"
                            );
                        }
                    } else if e.kind() == ErrorKind::NotReplicated {
                        tracing::debug!(error = %e, key = %to.key.for_logs(), "grant not replicated in time");
                    } else if !e.is_retryable() {
                        // Every request on the key would say it again (a key holding
                        // foreign data, Redis out of memory): once every 10 s.
                        static SAID: AtomicU64 = AtomicU64::new(0);
                        if once_per(&SAID, self.now_ns(), 10_000_000_000) {
                            tracing::error!(
                                error = %e,
                                key = %to.key.for_logs(),
                                "store refused a request (said at most every 10 s)"
                            );
                        }
                    }
                    return Err(CallError::Store(e));
                }
            }
        }
    }
}
