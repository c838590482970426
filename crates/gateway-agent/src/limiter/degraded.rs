//! Decisions while the store cannot be used: the rule's failure policy (fail open, fail
//! closed, or the local emergency limit).

use std::sync::Arc;
use std::sync::atomic::Ordering;

use leasehold_core::Rate;
use leasehold_core::bucket::Level;
use leasehold_core::rule::FailurePolicy;

use crate::counters::Counter;

use super::decide::denied;
use super::keys::KeyState;
use super::table::RuleEntry;
use super::{Admission, Decision, Limiter};

#[derive(Debug)]
pub(super) struct Emergency {
    pub(super) level: Level,
    pub(super) rate: Rate,
    pub(super) cap: u64,
    pub(super) at_ns: u64,
}

impl Limiter {
    /// Counts an admission made without the store, for the next report.
    pub(super) fn admitted_without_store(&self, ks: &Arc<KeyState>, cost: u64) {
        ks.without_store.fetch_add(cost, Ordering::SeqCst);
        if !ks.transient {
            self.track(ks);
        }
    }

    /// The decision while the store cannot be used, by the rule's failure policy.
    pub(super) fn degraded(&self, ks: &Arc<KeyState>, entry: &RuleEntry, cost: u64) -> Decision {
        let c = &entry.counters;
        let now = self.now_ns();
        match entry.rule.failure_policy() {
            FailurePolicy::FailOpen => {
                c.incr(Counter::AdmittedFailOpen);
                self.admitted_without_store(ks, cost);
                Decision::Allowed {
                    remaining: 0,
                    via: Admission::FailOpen,
                }
            }
            FailurePolicy::FailClosed => {
                c.incr(entry.unavailable);
                Decision::Unavailable {
                    retry_after: self.inner.breakers.for_slot(ks.slot).retry_in(now),
                }
            }
            FailurePolicy::LocalEmergency { rate } => {
                let mut slot = ks.emergency.lock();
                let e = slot.get_or_insert_with(|| {
                    c.incr(Counter::EmergencyActivations);
                    ks.in_emergency.store(true, Ordering::Release);
                    let (share, cap) = leasehold_core::emergency_limit(
                        &entry.rule,
                        &self.inner.policy,
                        ks.refill.share_milli(),
                    );
                    // An explicit emergency rate overrides the share: a bucket of the
                    // rule's lease_max that starts full (each agent's own limit).
                    let (rate, cap, level) = match rate {
                        Some(r) => {
                            let cap = entry.rule.lease_max().get();
                            (r, cap, Level::full(cap))
                        }
                        None => (share, cap, Level::default()),
                    };
                    Box::new(Emergency {
                        level,
                        rate,
                        cap,
                        at_ns: now,
                    })
                });
                let dt_us = now.saturating_sub(e.at_ns) / 1000;
                e.level = e.level.refill(e.cap, e.rate, dt_us);
                e.at_ns = now;
                if e.level.tokens >= cost {
                    e.level = e.level.take(cost);
                    self.admitted_without_store(ks, cost);
                    c.incr(Counter::AdmittedEmergency);
                    Decision::Allowed {
                        remaining: e.level.tokens,
                        via: Admission::Emergency,
                    }
                } else {
                    c.incr(entry.denied);
                    denied(e.level.time_until(cost.min(e.cap), e.rate) * 1000)
                }
            }
        }
    }
}
