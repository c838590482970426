//! The store path of one decision: the key's lock, a second look, then a lease (hot
//! keys) or one exact call (cold keys) within the rule's timeout, and what the reply
//! leaves in the key's cell and policy.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use leasehold_core::cell::refill_ns;
use leasehold_core::model::{Op, Reply};
use leasehold_core::rule::Leasing;
use tokio::time::{Instant, timeout_at};

use crate::breaker::Refusal;
use crate::counters::Counter;
use crate::redis_store::ErrorKind;
use crate::store::Store;

use super::call::CallError;
use super::decide::denied;
use super::keys::{Driver, KeyState};
use super::route::{dest, term_ending};
use super::table::RuleEntry;
use super::{Admission, Decision, Limiter};

/// The store answered for `ks`: an emergency limit in force ends.
pub(super) fn store_answered(ks: &KeyState) {
    if ks.in_emergency.swap(false, Ordering::AcqRel) {
        *ks.emergency.lock() = None;
    }
}

impl Limiter {
    pub(super) async fn decide_with_store(
        &self,
        ks: Arc<KeyState>,
        entry: Arc<RuleEntry>,
        cost: u64,
    ) -> Decision {
        // A key that leases reaches the store before its first lease, and a region's
        // bucket before its first report: from here on the sweep visits it every tick.
        if ks.hot().leases() || ks.region {
            self.track(&ks);
        }
        // A region's bucket the region's broker may not feed yet: tell it now rather than
        // with the next report.
        if entry.params.region.is_some()
            && !ks.announced.load(Ordering::Relaxed)
            && !ks.announced.swap(true, Ordering::Relaxed)
            && let Store::Redis(store) = &self.inner.store
        {
            let (store, key) = (store.clone(), ks.bucket.clone());
            tokio::spawn(async move {
                if let Err(e) = store.announce_region_key(&key).await {
                    tracing::debug!(error = %e, "announcing a region key to the broker failed");
                }
            });
        }
        let d = match self.consult_store(ks.clone(), entry.clone(), cost).await {
            // The seat may have refilled meanwhile; if not, the caller may come back when
            // it has, if that is sooner than the store's time.
            Decision::Denied { retry_after } if entry.local.is_some() => {
                match self.spend_seat(&ks, cost, self.now_ns()) {
                    Ok(d) => d,
                    Err(wait) => Decision::Denied {
                        retry_after: retry_after.min(Duration::from_nanos(wait.max(1))),
                    },
                }
            }
            d => d,
        };
        entry.enforce(d)
    }

    pub(super) async fn consult_store(
        &self,
        ks: Arc<KeyState>,
        entry: Arc<RuleEntry>,
        cost: u64,
    ) -> Decision {
        let deadline = Instant::now() + entry.rule.timeout();
        if self.inner.breakers.is_open(ks.slot, self.now_ns()) {
            return self.degraded(&ks, &entry, cost);
        }
        // A cold key: its shard's next exact batch decides, with no lock held meanwhile.
        // Rules that wait for replicas, keys found split, and the embedded store (no
        // round trip to share: a call returns at once) take the per-key path.
        let now = self.now_ns();
        if !self.is_hot(&ks, &entry)
            && matches!(self.inner.store, Store::Redis(_))
            && entry.rule.replication().is_none()
            && entry.params.region.is_none()
            && now >= ks.batch_after_ns.load(Ordering::Relaxed)
        {
            if let Some(d) = self.recheck(&ks, &entry, cost, now) {
                return d;
            }
            if let Some(d) = self.exact_batched(&ks, &entry, cost, deadline).await {
                return d;
            }
            ks.batch_after_ns
                .store(self.now_ns() + 1_000_000_000, Ordering::Relaxed);
        }
        let Ok(mut driver) = timeout_at(deadline, ks.driver.lock()).await else {
            entry.counters.incr(Counter::StoreErrors);
            return self.degraded(&ks, &entry, cost);
        };
        let hot = self.is_hot(&ks, &entry);
        // Look again: a refill or a denial may have landed while we waited for the lock.
        let now = self.now_ns();
        if let Some(d) = self.recheck(&ks, &entry, cost, now) {
            return d;
        }
        ks.last_io_ns.store(now, Ordering::Relaxed);
        let outcome = if hot {
            timeout_at(
                deadline,
                self.lease_and_spend(&ks, &mut driver, &entry, cost),
            )
            .await
        } else {
            timeout_at(deadline, self.exact(&ks, &mut driver, &entry, cost)).await
        };
        drop(driver);
        match outcome {
            Ok(Ok(d)) => {
                store_answered(&ks);
                d
            }
            Ok(Err(CallError::Refused(why))) => {
                if why == Refusal::Saturated {
                    entry.counters.incr(Counter::StoreErrors);
                }
                self.degraded(&ks, &entry, cost)
            }
            Ok(Err(CallError::Store(e))) => {
                tracing::debug!(error = %e, key = %ks.bucket.for_logs(), "store failed; the failure policy decides");
                self.degraded(&ks, &entry, cost)
            }
            // The call in flight was dropped (ending a probe, if it was one).
            Err(_) => self.timed_out(&ks, &entry, cost),
        }
    }

    /// A decision the store did not answer within the rule's timeout: the timeout counts
    /// against the shard only if nothing on it succeeded since this decision began, and
    /// the failure policy decides.
    pub(super) fn timed_out(&self, ks: &Arc<KeyState>, entry: &RuleEntry, cost: u64) -> Decision {
        let began = self
            .now_ns()
            .saturating_sub(entry.rule.timeout().as_nanos() as u64);
        self.inner
            .breakers
            .for_slot(ks.slot)
            .failure(self.now_ns(), began, false);
        self.waited_out(ks, entry, cost)
    }

    /// A decision whose answer did not come within the rule's timeout, from a call that
    /// counts against the shard on its own (a batch's): the failure policy decides.
    pub(super) fn waited_out(&self, ks: &Arc<KeyState>, entry: &RuleEntry, cost: u64) -> Decision {
        entry.counters.incr(Counter::StoreErrors);
        self.inner.error_kinds.incr(ErrorKind::Timeout);
        // Timeouts that do not open the breaker (a store, or this process, slow for a
        // moment) are still worth a line: a burst of them was answered 503 unlogged.
        static SAID: AtomicU64 = AtomicU64::new(0);
        if super::once_per(&SAID, self.now_ns(), 10_000_000_000) {
            tracing::warn!(
                rule = %entry.name,
                timeout = ?entry.rule.timeout(),
                "store answered past a decision's timeout: the failure policy decided it \
                 (see leasehold_store_errors_by_kind_total{{kind=\"timeout\"}}; said at most every 10 s)"
            );
        }
        self.degraded(ks, entry, cost)
    }

    pub(super) async fn lease_and_spend(
        &self,
        ks: &Arc<KeyState>,
        driver: &mut Driver,
        entry: &RuleEntry,
        cost: u64,
    ) -> Result<Decision, CallError> {
        if entry.rule.leasing() == Leasing::Rate {
            return self.rate_decide(ks, driver, entry, cost).await;
        }
        // Two rounds at most: other callers may spend the grant before we do.
        for _ in 0..2 {
            let reply = self.acquire(ks, driver, entry, cost).await?;
            if let Some(d) = self.spend_leased(ks.hot(), &entry.counters, ks, cost, self.now_ns()) {
                return Ok(d);
            }
            if term_ending(driver, &reply) {
                // No lease can outlive the term; each decision is one exact call until
                // it ends (at most the rule's grace).
                return self.exact(ks, driver, entry, cost).await;
            }
            if reply.granted == 0 {
                break;
            }
        }
        entry.counters.incr(entry.denied);
        ks.hot().count_denied(cost);
        let now = self.now_ns();
        Ok(denied(match ks.cached_wait(cost, now) {
            Some(wait) => wait,
            None => refill_ns(cost, entry.params.rate),
        }))
    }

    pub(super) async fn exact(
        &self,
        ks: &Arc<KeyState>,
        driver: &mut Driver,
        entry: &RuleEntry,
        cost: u64,
    ) -> Result<Decision, CallError> {
        let reply = self.call(ks, driver, entry, Op::Exact { cost }).await?;
        let admitted = reply.granted == cost;
        self.count_exact(
            ks,
            driver,
            entry,
            &[(cost, admitted)],
            1,
            reply.scale_ppm != 0,
        );
        Ok(self.exact_decided(ks, entry, cost, admitted, reply.retry_us, reply.remaining))
    }

    /// Counts exact decisions `(cost, admitted)` taken now in the key's policy, from
    /// a store call of `call_keys` keys (`leased_elsewhere`: the store said other agents
    /// lease the key). Promotion: a cold key used faster than the threshold (higher for a
    /// key whose calls carry many, see `promote_above`), or leased elsewhere, starts
    /// leasing, and the sweep lists it.
    pub(super) fn count_exact(
        &self,
        ks: &Arc<KeyState>,
        driver: &mut Driver,
        entry: &RuleEntry,
        decisions: &[(u64, bool)],
        call_keys: u64,
        leased_elsewhere: bool,
    ) {
        let now = self.now_ns();
        let mut hot = false;
        for &(cost, admitted) in decisions {
            hot |= driver.policy.exact_done(
                &entry.rule,
                &self.inner.policy,
                now,
                cost,
                admitted,
                call_keys,
                leased_elsewhere,
            );
        }
        if hot {
            ks.refill.set_share_milli(driver.policy.share_milli());
            ks.hot().set_leases(true);
            // Visited by the sweep from now on, not only once the pass over the map
            // comes by.
            if !ks.transient {
                self.track(ks);
            }
        }
    }

    /// The decision the store made on an exact call of `cost`: counted, and a denial
    /// remembered until `cost` tokens could exist (`retry_us`).
    pub(super) fn exact_decided(
        &self,
        ks: &KeyState,
        entry: &RuleEntry,
        cost: u64,
        admitted: bool,
        retry_us: u64,
        remaining: u64,
    ) -> Decision {
        ks.saw_store_left(remaining, self.now_ns());
        if admitted {
            entry.counters.incr(Counter::AdmittedExact);
            Decision::Allowed {
                remaining,
                via: Admission::Exact,
            }
        } else {
            let wait = retry_us.max(1) * 1000;
            ks.hot().deny(self.now_ns() + wait, cost);
            entry.counters.incr(entry.denied);
            ks.hot().count_denied(cost);
            denied(wait)
        }
    }

    /// Leases for `ks`: declares what is held, asks for about `horizon` of demand (at
    /// least `needed`), and installs the grant with a deadline measured from the moment
    /// the request was sent.
    #[tracing::instrument(level = "debug", name = "refill", skip_all, fields(key = %ks.bucket.for_logs(), needed))]
    pub(super) async fn acquire(
        &self,
        ks: &KeyState,
        driver: &mut Driver,
        entry: &RuleEntry,
        needed: u64,
    ) -> Result<Reply, CallError> {
        let sent = self.now_ns();
        // A key that leases has traffic: the rule's seat stays wanted (its decisions
        // covered by the lease never reach the seat).
        if let Some((_, seat)) = &entry.local {
            seat.wanted(sent);
        }
        let args = driver.policy.acquire(
            &entry.rule,
            &self.inner.policy,
            sent,
            &ks.hot().lease,
            ks.hot().denied_tokens(),
            needed,
        );
        let op = Op::Acquire {
            held: args.held,
            want: args.want,
            min: args.min,
            demand: args.demand,
        };
        let reply = self.call(ks, driver, entry, op).await?;
        // A part in the last moments of its split's term leases nothing (ttl 0).
        let ending = term_ending(driver, &reply);
        let now = self.now_ns();
        let policy = &mut driver.policy;
        ks.saw_reply(
            || {
                policy.granted(
                    &entry.rule,
                    &self.inner.policy,
                    ks.hot(),
                    &ks.refill,
                    sent,
                    now,
                    needed,
                    &reply,
                    ending,
                )
            },
            (!reply.moved).then_some(reply.remaining),
            now,
        );
        if reply.granted > 0 {
            entry.counters.incr(Counter::LeaseGrants);
            entry
                .counters
                .add(Counter::LeaseTokensGranted, reply.granted);
        }
        Ok(reply)
    }

    /// Returns what the lease holds. `withdraw` (the agent went idle on the key) also
    /// clears the demand it reported, even with nothing to return, so it stops counting
    /// in the key's proportional shares.
    pub(super) async fn release(
        &self,
        ks: &KeyState,
        driver: &mut Driver,
        entry: &RuleEntry,
        withdraw: bool,
    ) -> Result<(), CallError> {
        let now = self.now_ns();
        let expired = now >= ks.hot().lease.deadline_ns();
        let taken = ks.hot().lease.take_all();
        let withdraw = driver.policy.released(taken, withdraw);
        // An expired lease is forfeited: it can no longer be spent, so saying so early
        // only frees room.
        let returned = if expired { 0 } else { taken };
        if returned == 0 && !withdraw {
            return Ok(());
        }
        self.send_release(ks, driver, entry, returned).await
    }

    /// Sends a release of `returned` tokens (a token lease's, or a rate lease's with its
    /// share), counted.
    pub(super) async fn send_release(
        &self,
        ks: &KeyState,
        driver: &mut Driver,
        entry: &RuleEntry,
        returned: u64,
    ) -> Result<(), CallError> {
        let reply = self
            .send(dest(ks, driver, entry), entry, &Op::Release { returned })
            .await?;
        entry.counters.incr(Counter::LeaseReturns);
        entry
            .counters
            .add(Counter::LeaseTokensReturned, reply.granted);
        Ok(())
    }
}
