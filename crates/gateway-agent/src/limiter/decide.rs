//! The local decision: the hot path ([`Cell::decide`] on a known key, under its map
//! shard's read lock), the full look-up (validation, new keys), and the agent around the
//! cell (its seat, its prefetch queue, its breakers).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use leasehold_core::key::SubjectError;
use leasehold_core::rule::Leasing;
use leasehold_core::{Around, Cell, Rate, Verdict};

use crate::counters::{Counter, RuleCounters};

use super::keys::{KeyId, KeyRef, KeyState};
use super::table::RuleEntry;
use super::{Admission, CheckError, Decision, Limiter, keymap};

/// What deciding without the store gave: a decision, or the key and rule whose decision
/// needs the store.
pub(super) enum Local {
    Decided(Decision),
    NeedsStore(Arc<KeyState>, Arc<RuleEntry>),
}

/// The agent around a key's cell, for [`Cell::decide`]: the key's seat, its prefetch
/// queue, and whether it may wait for a refill (it leases, its shard's breaker is closed).
pub(super) struct AgentAround<'a> {
    pub(super) limiter: &'a Limiter,
    pub(super) ks: &'a Arc<KeyState>,
}

impl Around for AgentAround<'_> {
    fn rate(&self) -> Rate {
        self.ks.entry.load().params.rate
    }

    fn seat(&mut self, cost: u64, now_ns: u64) -> Result<u64, u64> {
        Limiter::take_seat(self.ks, cost, now_ns)
    }

    fn refill(&mut self, now_ns: u64) -> bool {
        if self.ks.entry.load().rule.leasing() == Leasing::Rate {
            return self.limiter.rate_refill(self.ks, now_ns);
        }
        self.limiter.request_prefetch(self.ks, now_ns);
        self.ks.prefetching.load(Ordering::Acquire)
    }

    fn may_await_refill(&mut self, now_ns: u64) -> bool {
        let entry = self.ks.entry.load();
        // With the shard's breaker open the failure policy decides, as for any caller
        // the lease cannot cover.
        self.limiter.is_hot(self.ks, &entry)
            && !self.limiter.inner.breakers.is_open(self.ks.slot, now_ns)
    }
}

#[inline]
pub(super) fn denied(wait_ns: u64) -> Decision {
    Decision::Denied {
        retry_after: Duration::from_nanos(wait_ns.max(1)),
    }
}

impl Limiter {
    /// `d` as the quota headers report it: an admission from the lease or the seat names
    /// its key's [`Limiter::quota_left`]; anything else stays as it is.
    pub(super) fn with_quota(&self, ks: &KeyState, d: Decision) -> Decision {
        match d {
            Decision::Allowed {
                via: via @ (Admission::Lease | Admission::Local),
                ..
            } => Decision::Allowed {
                remaining: ks.quota_left(self.now_ns()),
                via,
            },
            d => d,
        }
    }

    /// The hot path, under the shard's read lock and touching no reference count: the
    /// local decision of a known key ([`Cell::decide`]). Sets `now` when it read the
    /// clock. `None`: the key is unknown, the cost invalid, or only the store decides.
    #[inline(always)]
    pub(super) fn decide_hot(
        &self,
        subject: &[u8],
        rule: &str,
        cost: u64,
        now: &mut Option<u64>,
    ) -> Option<Decision> {
        self.inner
            .keys
            .with(&KeyRef::new(rule, subject), |slot| {
                let cell = slot.valid_for(cost)?;
                let t = self.now_ns();
                *now = Some(t);
                self.decide_local(cell, &slot.counters, &slot.ks, cost, t)
            })
            .flatten()
    }

    /// The key's local decision, counted: [`Cell::decide`] around this agent (its seat,
    /// its prefetch queue, its breakers). `None` when only the store can decide.
    #[inline(always)]
    pub(super) fn decide_local(
        &self,
        cell: &Cell,
        counters: &RuleCounters,
        ks: &Arc<KeyState>,
        cost: u64,
        now: u64,
    ) -> Option<Decision> {
        let mut around = AgentAround { limiter: self, ks };
        match cell.decide(&ks.refill, cost, now, &mut around) {
            Verdict::Lease { left } => Some(leased(counters, left)),
            Verdict::Seat { left } => Some(self.seat_admitted(ks, cost, left)),
            Verdict::Denied { wait_ns, .. } => Some(if cell.shadow() {
                counters.incr(Counter::ShadowDenied);
                Decision::Allowed {
                    remaining: 0,
                    via: Admission::Shadow,
                }
            } else {
                counters.incr(Counter::Denied);
                denied(wait_ns)
            }),
            Verdict::Store => None,
        }
    }

    /// For the HTTP layer: decides every check without waiting, all or nothing, or
    /// `None` when one of them needs the store (tokens taken by the others go back to
    /// their leases first, or are dropped if the lock that guards that is busy: that
    /// only under-admits). Each decided check comes with the entry that decided it.
    #[cfg(feature = "tower")]
    pub(crate) fn try_check_all_now(
        &self,
        checks: &[super::Check],
        decided: &mut smallvec::SmallVec<[(Decision, Arc<RuleEntry>); 2]>,
    ) -> Result<bool, CheckError> {
        decided.clear();
        // (key, cost, the lease's epoch or None for the seat), as in `check_all_each`.
        type Taken = smallvec::SmallVec<[(Arc<KeyState>, u64, Option<u64>); 2]>;
        let mut taken: Taken = smallvec::SmallVec::new();
        let give_back = |taken: &mut Taken| {
            for (ks, cost, epoch) in taken.drain(..) {
                match epoch {
                    None => Self::refund_seat(&ks, cost),
                    Some(epoch) => {
                        if let Ok(_driver) = ks.driver.try_lock() {
                            ks.hot().lease.refund(cost, epoch);
                        }
                    }
                }
            }
        };
        for c in checks {
            let (subject, rule, cost) = (c.subject(), c.rule(), c.cost());
            // The hot path, as in `check`: a live key whose lease covers the cost.
            let spent = self.inner.keys.with(&KeyRef::new(rule, subject), |slot| {
                let hot = slot.leased_for(cost)?;
                let epoch = hot.lease.epoch();
                self.spend_leased(hot, &slot.counters, &slot.ks, cost, self.now_ns())
                    .map(|d| (d, slot.ks.clone(), epoch))
            });
            if let Some(Some((d, ks, epoch))) = spent {
                decided.push((self.with_quota(&ks, d), ks.entry.load_full()));
                taken.push((ks, cost, Some(epoch)));
                continue;
            }
            // The lease's epoch before the look-up, which may spend from it.
            let before = self.key(rule, subject).map(|ks| {
                let epoch = ks.hot().lease.epoch();
                (ks, epoch)
            });
            let looked = self.look_up(subject, rule, cost, None);
            match looked {
                Ok(Local::Decided(d)) => {
                    // A key the look-up made has no lease yet.
                    let (ks, epoch) = match before {
                        Some((ks, epoch)) => (Some(ks), Some(epoch)),
                        None => (self.key(rule, subject), None),
                    };
                    let entry = match &ks {
                        Some(ks) => ks.entry.load_full(),
                        None => self.inner.rules.load().get(rule)?.resolve(subject).clone(),
                    };
                    let refused = !matches!(d, Decision::Allowed { .. });
                    let mut d = d;
                    // Admitted by the lease or the seat: named with the key's quota, and
                    // given back should a later check refuse.
                    let give_back_by = match d {
                        Decision::Allowed {
                            via: Admission::Lease,
                            ..
                        } => epoch.map(Some),
                        Decision::Allowed {
                            via: Admission::Local,
                            ..
                        } => Some(None),
                        _ => None,
                    };
                    if let (Some(by), Some(ks)) = (give_back_by, ks) {
                        d = self.with_quota(&ks, d);
                        taken.push((ks, cost, by));
                    }
                    decided.push((d, entry));
                    if refused {
                        give_back(&mut taken);
                        return Ok(true);
                    }
                }
                Ok(Local::NeedsStore(..)) => {
                    give_back(&mut taken);
                    decided.clear();
                    return Ok(false);
                }
                Err(e) => {
                    give_back(&mut taken);
                    return Err(e);
                }
            }
        }
        Ok(true)
    }

    /// The entry in force for `subject` under `rule` (its key's, or the rule table's).
    #[cfg(feature = "tower")]
    pub(crate) fn entry_for(&self, rule: &str, subject: &[u8]) -> Option<Arc<RuleEntry>> {
        if let Some(ks) = self.key(rule, subject) {
            return Some(ks.entry.load_full());
        }
        Some(
            self.inner
                .rules
                .load()
                .get(rule)
                .ok()?
                .resolve(subject)
                .clone(),
        )
    }

    /// The lease step of the local decision alone ([`Cell::spend`]), counted.
    #[inline]
    pub(super) fn spend_leased(
        &self,
        cell: &Cell,
        counters: &RuleCounters,
        ks: &Arc<KeyState>,
        cost: u64,
        now: u64,
    ) -> Option<Decision> {
        let mut around = AgentAround { limiter: self, ks };
        let Verdict::Lease { left } = cell.spend(cost, now, &ks.refill, &mut around)? else {
            return None;
        };
        Some(leased(counters, left))
    }

    /// What a caller finds on the store path once it holds the key's lock, or before
    /// it joins a batch: the lease, or the cached denial ([`Cell::recheck`]).
    pub(super) fn recheck(
        &self,
        ks: &Arc<KeyState>,
        entry: &RuleEntry,
        cost: u64,
        now: u64,
    ) -> Option<Decision> {
        let mut around = AgentAround { limiter: self, ks };
        match ks.hot().recheck(&ks.refill, cost, now, &mut around)? {
            Verdict::Lease { left } => Some(leased(&entry.counters, left)),
            Verdict::Denied { wait_ns, .. } => {
                entry.counters.incr(entry.denied);
                Some(denied(wait_ns))
            }
            Verdict::Seat { .. } | Verdict::Store => None,
        }
    }

    /// Everything the hot path does not cover: validation, new keys, the negative cache.
    /// `now`: the agent's clock if the caller read it already.
    pub(super) fn look_up(
        &self,
        subject: &[u8],
        rule: &str,
        cost: u64,
        now: Option<u64>,
    ) -> Result<Local, CheckError> {
        let (existing, entry) = self.resolve(subject, rule, cost)?;
        let now = now.unwrap_or_else(|| self.now_ns());
        let keys = &self.inner.keys;
        if let Some(ks) = existing {
            // The hot path decided already, unless the key came or the rule changed
            // meanwhile.
            return Ok(
                match self.decide_local(ks.hot(), &ks.counters, &ks, cost, now) {
                    Some(d) => Local::Decided(d),
                    None => Local::NeedsStore(ks, entry),
                },
            );
        }
        let bucket = entry.key(subject)?;
        let (ks, placed) = keys.get_or_insert_with(
            KeyId::new(rule, subject),
            self.inner.config.max_keys,
            now,
            |transient| {
                Arc::new(KeyState::new(
                    &self.inner.cells,
                    rule,
                    &entry,
                    bucket,
                    now,
                    transient,
                ))
            },
        );
        match placed {
            keymap::Placed::Found | keymap::Placed::Inserted => {}
            keymap::Placed::Evicted => {
                self.inner.keys_evicted.fetch_add(1, Ordering::Relaxed);
            }
            // Full of keys that lease or wait (a flood of distinct subjects while every
            // sampled key is busy): this key is decided by one exact call without keeping
            // its state. Memory stays bounded whatever the callers send.
            keymap::Placed::Transient => {
                self.inner.keys_over_cap.fetch_add(1, Ordering::Relaxed);
                return Ok(Local::NeedsStore(ks, entry));
            }
            // At the cap, a key not seen recently: one exact call, no state kept (most
            // subjects of a long tail are seen once).
            keymap::Placed::FirstSeen => {
                self.inner.keys_first_seen.fetch_add(1, Ordering::Relaxed);
                return Ok(Local::NeedsStore(ks, entry));
            }
        }
        if let Some(d) = self.decide_local(ks.hot(), &ks.counters, &ks, cost, now) {
            return Ok(Local::Decided(d));
        }
        // Another caller may have inserted it first, with the same entry.
        let entry = ks.entry.load_full();
        Ok(Local::NeedsStore(ks, entry))
    }

    /// What every decision checks first: the key if this agent holds it, and the rule
    /// entry in force for `subject` (the key's, else the rule table's); an unknown rule,
    /// a cost of 0 or above the capacity, or an empty subject is an error.
    pub(super) fn resolve(
        &self,
        subject: &[u8],
        rule: &str,
        cost: u64,
    ) -> Result<(Option<Arc<KeyState>>, Arc<RuleEntry>), CheckError> {
        let rules = self.inner.rules.load();
        let set = rules.get(rule)?;
        let existing = self.inner.keys.get(&KeyRef::new(rule, subject));
        let entry = match &existing {
            Some(ks) => ks.entry.load_full(),
            None => set.resolve(subject).clone(),
        };
        let capacity = entry.params.capacity;
        if cost == 0 {
            return Err(CheckError::ZeroCost);
        }
        if cost > capacity {
            return Err(CheckError::CostExceedsCapacity {
                rule: rule.to_owned(),
                cost,
                capacity,
            });
        }
        if subject.is_empty() {
            return Err(SubjectError::Empty.into());
        }
        Ok((existing, entry))
    }

    pub(super) fn request_prefetch(&self, ks: &Arc<KeyState>, now: u64) {
        if !ks.refill.may_prefetch(now) {
            return;
        }
        if !ks.prefetching.swap(true, Ordering::AcqRel)
            && self.inner.prefetch.try_send(ks.clone()).is_err()
        {
            ks.prefetching.store(false, Ordering::Release);
        }
    }

    pub(super) fn is_hot(&self, ks: &KeyState, entry: &RuleEntry) -> bool {
        if ks.transient || self.inner.shut.load(Ordering::Relaxed) {
            return false;
        }
        match entry.rule.leasing() {
            Leasing::Lease | Leasing::Rate => true,
            Leasing::Exact => false,
            Leasing::Auto => ks.hot().leases(),
        }
    }
}

/// An admission from the lease, which holds `left` after, counted.
#[inline(always)]
fn leased(counters: &RuleCounters, left: u64) -> Decision {
    counters.incr(Counter::AdmittedLease);
    Decision::Allowed {
        remaining: left,
        via: Admission::Lease,
    }
}
