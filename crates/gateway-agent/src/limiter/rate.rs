//! Keys of `leasing = "rate"` rules: the agent holds a share of the bucket's rate and a
//! burst for a term ([`RateKey`], sans-io in lease-core), stocks the key's cell from
//! them, and calls the store once a term, or when its demand changes. The hot path is
//! the lease's, unchanged; a caller the cell does not cover syncs it with the share's
//! accrual, and is refused with the time the share takes when that is not enough.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use leasehold_core::model::Reply;
use leasehold_core::rate_lease::{RateKey, Uncovered};

use crate::counters::Counter;

use super::call::CallError;
use super::decide::denied;
use super::keys::{Driver, KeyState};
use super::table::RuleEntry;
use super::{Decision, Limiter};

impl Limiter {
    /// A caller the cell did not cover ([`leasehold_core::Around::refill`]): the share's
    /// accrual goes into the cell, and a renewal is queued if one is due. Whether the
    /// caller must wait: the cell is still empty (a sync by another caller meanwhile may
    /// have stocked it) and the last grant left the level empty (else the store path may
    /// borrow from it: [`RateKey::uncovered`]).
    pub(super) fn rate_refill(&self, ks: &Arc<KeyState>, now: u64) -> bool {
        let (due, wait) = {
            let mut guard = ks.rate.lock();
            let rk = guard.get_or_insert_with(Box::default);
            rk.sync(ks.hot(), now);
            let rate = ks.entry.load().params.rate;
            (rk.due(now), rk.must_wait(ks.hot(), &ks.refill, rate))
        };
        if due {
            self.request_prefetch(ks, now);
        }
        wait
    }

    /// The store path of a rate key's caller the cell did not cover: a renewal if one is
    /// due (the first grant, a grown demand), else the share's accrual; then the cell; then
    /// what [`RateKey::uncovered`] says: one exact call, a renewal that borrows from the
    /// level (and the cell again), or a denial with the time the share takes to bring the
    /// cost.
    pub(super) async fn rate_decide(
        &self,
        ks: &Arc<KeyState>,
        driver: &mut Driver,
        entry: &RuleEntry,
        cost: u64,
    ) -> Result<Decision, CallError> {
        let now = self.now_ns();
        let due = ks.rate.lock().get_or_insert_with(Box::default).due(now);
        if due {
            self.rate_call(ks, driver, entry).await?;
        } else {
            self.rate_refill(ks, now);
        }
        let mut borrowed = false;
        let wait = loop {
            if let Some(d) = self.spend_leased(ks.hot(), &entry.counters, ks, cost, self.now_ns()) {
                return Ok(d);
            }
            let uncovered = (ks.rate.lock().as_ref()).map_or(Uncovered::Exact, |rk| {
                rk.uncovered(&ks.refill, cost, entry.params.rate, borrowed)
            });
            match uncovered {
                Uncovered::Wait(wait_ns) => break Some(wait_ns),
                Uncovered::Exact => break None,
                Uncovered::Borrow => {
                    self.rate_call(ks, driver, entry).await?;
                    borrowed = true;
                }
            }
        };
        let Some(wait_ns) = wait else {
            if let Some(d) = self.recheck(ks, entry, cost, self.now_ns()) {
                return Ok(d);
            }
            let d = self.exact(ks, driver, entry, cost).await?;
            match (&d, ks.rate.lock().as_mut()) {
                // Demand the cell did not see (a denial it counts).
                (Decision::Allowed { .. }, Some(rk)) => rk.offered(self.now_ns(), cost),
                // Remembered only until the key's first call may be due: held for the
                // store's whole wait (the level empty while other agents' shares hold
                // the rate: a gateway the load just moved to), its callers would be
                // refused without being counted, and the call that gets the key its
                // share put off, for that long.
                (Decision::Denied { retry_after }, _) => {
                    let wait = retry_after.as_nanos() as u64;
                    ks.hot()
                        .deny(self.now_ns() + RateKey::first_denial_ns(wait), cost);
                }
                _ => {}
            }
            return Ok(d);
        };
        entry.counters.incr(entry.denied);
        ks.hot().count_denied(cost);
        Ok(denied(wait_ns))
    }

    /// A rate lease's call: the burst declared and wanted and the demand, the grant
    /// installed in the cell.
    #[tracing::instrument(level = "debug", name = "rate lease", skip_all, fields(key = %ks.bucket.for_logs()))]
    pub(super) async fn rate_call(
        &self,
        ks: &Arc<KeyState>,
        driver: &mut Driver,
        entry: &RuleEntry,
    ) -> Result<Reply, CallError> {
        let op = ks.rate.lock().get_or_insert_with(Box::default).call(
            ks.hot(),
            &entry.params,
            self.now_ns(),
        );
        tracing::debug!(?op, "rate lease call");
        let reply = match self.call(ks, driver, entry, op).await {
            Ok(reply) => reply,
            Err(e) => {
                if let Some(rk) = ks.rate.lock().as_mut() {
                    rk.failed();
                }
                return Err(e);
            }
        };
        let now = self.now_ns();
        let margin = self.inner.policy.margin.as_nanos() as u64;
        let g = ks.saw_reply(
            || {
                ks.rate
                    .lock()
                    .as_mut()
                    .map(|rk| rk.granted(ks.hot(), &ks.refill, &entry.params, &reply, now, margin))
            },
            (!reply.moved).then_some(reply.remaining),
            now,
        );
        tracing::debug!(?g, "rate lease granted");
        // The key leases: its callers' hot path spends the cell (and an empty cell takes
        // the share's accrual, `rate_refill`), and the sweep visits it every tick, to
        // renew it when due (a demand that fell gives its share up within a window) and
        // give it up when idle.
        ks.hot().set_leases(true);
        if !ks.transient {
            self.track(ks);
        }
        if let Some(g) = g
            && g.paid > 0
        {
            entry.counters.incr(Counter::LeaseGrants);
            entry.counters.add(Counter::LeaseTokensGranted, g.paid);
        }
        Ok(reply)
    }

    /// The sweep's visit of a rate key: the cell synced; given up when nothing was
    /// offered for the rule's idle time, renewed when due.
    pub(super) fn rate_sweep(&self, ks: Arc<KeyState>, entry: Arc<RuleEntry>, driver: Driver2) {
        let now = self.now_ns();
        let ttl_ns = entry.rule.lease_ttl().as_nanos() as u64;
        let idle_ns = (self.inner.policy.idle_after.as_nanos() as u64).min(ttl_ns / 2);
        let (idle, due) = {
            let mut guard = ks.rate.lock();
            let Some(rk) = guard.as_mut().filter(|rk| rk.live()) else {
                return;
            };
            rk.sync(ks.hot(), now);
            (rk.idle(now, idle_ns), rk.due(now))
        };
        if !idle && !due {
            return;
        }
        let this = self.clone();
        tokio::spawn(async move {
            let mut driver = driver;
            if idle {
                let _ = this.rate_release(&ks, &mut driver, &entry).await;
            } else if !this.inner.shut.load(Ordering::Acquire) {
                let _ = this.rate_call(&ks, &mut driver, &entry).await;
            }
        });
    }

    /// Gives a rate lease up: its share and burst leave the bucket, and what the cell
    /// held goes back (nothing past the deadline).
    pub(super) async fn rate_release(
        &self,
        ks: &KeyState,
        driver: &mut Driver,
        entry: &RuleEntry,
    ) -> Result<(), CallError> {
        let now = self.now_ns();
        let Some(returned) = (ks.rate.lock().as_mut())
            .filter(|rk| rk.live())
            .map(|rk| rk.release(ks.hot(), &ks.refill, now))
        else {
            return Ok(());
        };
        ks.hot().set_leases(false);
        self.send_release(ks, driver, entry, returned).await
    }
}

/// The key's lock as the sweep holds it.
pub(super) type Driver2 = tokio::sync::OwnedMutexGuard<Driver>;

/// A rate key's state: none until its first call.
pub(super) type RateSlot = parking_lot::Mutex<Option<Box<RateKey>>>;
