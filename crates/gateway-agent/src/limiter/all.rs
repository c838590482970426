//! Several buckets for one request, all or nothing, and a look at a bucket that takes
//! nothing.
//!
//! A refused request charges nothing, whatever the order of its checks: checks on the
//! same bucket are summed into one; every check is validated before any is taken; when
//! two or more checks need the store, all but one are looked at first ([`Limiter::peek`],
//! an exact call of cost 0) and a refusal found there takes nothing. Then the checks are
//! taken: those the agent covers locally (lease, seat), then the one not looked at (if
//! it refuses, nothing of the others is taken), then the rest; a refusal gives back what
//! the leases and seats gave. What cannot be given
//! back is an exact admission made before a later check refused: that happens only when
//! the later bucket ran dry between its look and its take (another caller took it
//! meanwhile), and costs at most that request's tokens.

use futures_util::future::join_all;

use std::sync::Arc;

use leasehold_core::cell::refill_ns;
use leasehold_core::model::Op;
use leasehold_core::rule::FailurePolicy;
use tokio::time::{Instant, timeout_at};

use super::decide::denied;
use super::keys::KeyState;
use super::store_path::store_answered;
use super::{Admission, Check, CheckError, Decision, Limiter, RuleRef};

impl Limiter {
    /// What [`Limiter::check`] of `cost` would answer now, taking nothing: the tokens this
    /// agent holds for the key (lease, seat) and, unless they cover `cost`, the global
    /// bucket's level read from the store (one exact call of cost 0). `Allowed` with
    /// the tokens seen (via `Lease` when held locally, `Exact` when the store was read),
    /// `Denied` with the time until `cost` would exist. While the store cannot be
    /// reached: `Unavailable` for a rule that fails closed, else `Allowed` via
    /// `FailOpen` with nothing counted (the emergency limit is not consulted). A rule in
    /// shadow mode answers as [`Limiter::check`] does. Check-only requests (Envoy's
    /// `hits_addend: 0`) are answered with it.
    pub async fn peek(
        &self,
        rule: &RuleRef,
        subject: impl AsRef<[u8]>,
        cost: u64,
    ) -> Result<Decision, CheckError> {
        self.peek_named(rule.as_str(), subject.as_ref(), cost).await
    }

    /// [`Limiter::peek`] of a rule by its name.
    async fn peek_named(
        &self,
        rule: &str,
        subject: &[u8],
        cost: u64,
    ) -> Result<Decision, CheckError> {
        let (existing, entry) = self.resolve(subject, rule, cost)?;
        let now = self.now_ns();
        let ks = match existing {
            Some(ks) => ks,
            // Not kept: a look does not make the agent hold a key.
            None => Arc::new(KeyState::new(
                &self.inner.cells,
                rule,
                &entry,
                entry.key(subject)?,
                now,
                true,
            )),
        };
        let held = self.held_locally(&ks, now);
        if held >= cost {
            return Ok(Decision::Allowed {
                remaining: ks.quota_left(now).max(held),
                via: Admission::Lease,
            });
        }
        if let Some(wait) = ks.cached_wait(cost, now) {
            return Ok(entry.enforce(denied(wait)));
        }
        let unreachable = || match entry.rule.failure_policy() {
            FailurePolicy::FailClosed => Decision::Unavailable {
                retry_after: self.inner.breakers.for_slot(ks.slot).retry_in(now),
            },
            _ => Decision::Allowed {
                remaining: 0,
                via: Admission::FailOpen,
            },
        };
        if self.inner.breakers.is_open(ks.slot, now) {
            return Ok(entry.enforce(unreachable()));
        }
        let deadline = Instant::now() + entry.rule.timeout();
        let read = async {
            let mut driver = ks.driver.lock().await;
            self.call(&ks, &mut driver, &entry, Op::Exact { cost: 0 })
                .await
        };
        let d = match timeout_at(deadline, read).await {
            Ok(Ok(reply)) if !reply.moved => {
                store_answered(&ks);
                ks.saw_store_left(reply.remaining, self.now_ns());
                let seen = reply.remaining.saturating_add(held);
                if seen >= cost {
                    Decision::Allowed {
                        remaining: seen,
                        via: Admission::Exact,
                    }
                } else {
                    denied(refill_ns(cost - seen, entry.params.rate).max(1))
                }
            }
            // A split in transit: nothing to say; the take decides.
            Ok(Ok(_)) => Decision::Allowed {
                remaining: 0,
                via: Admission::Exact,
            },
            Ok(Err(_)) | Err(_) => unreachable(),
        };
        Ok(entry.enforce(d))
    }

    /// Tokens the agent holds for `ks` now: its live lease and its seat's bucket.
    fn held_locally(&self, ks: &KeyState, now: u64) -> u64 {
        let lease = &ks.hot().lease;
        let leased = if now < lease.deadline_ns() {
            lease.held()
        } else {
            0
        };
        leased.saturating_add(ks.seat_level(now))
    }

    /// Checks several rules for one request (for example tenant, endpoint and global):
    /// admitted only if every rule admits, and a refused request takes nothing (see the
    /// module's notes for the one race that can charge it). Checks of the same bucket
    /// count as one of their summed cost. The first refusal is returned; an admission
    /// reports the tightest check (least `remaining`, and how that one was admitted).
    /// A leased admission's `remaining` here is its key's [`Limiter::quota_left`], not
    /// what the lease alone holds.
    pub async fn check_all(&self, checks: &[Check]) -> Result<Decision, CheckError> {
        let mut each = Vec::new();
        Ok(self.check_all_each(checks, &mut each).await?.0)
    }

    /// [`Limiter::check_all`], also giving the index of the check that decided (the
    /// refusing one, or the tightest admission) and, in `each`, one entry per check in
    /// their order: its decision (a bucket named twice: the same decision for both), or
    /// `None` for a check not decided because another refused the request.
    pub async fn check_all_each(
        &self,
        checks: &[Check],
        each: &mut Vec<Option<Decision>>,
    ) -> Result<(Decision, usize), CheckError> {
        each.clear();
        each.resize(checks.len(), None);
        // One check per bucket: (subject, rule, summed cost, the first input's index);
        // `of[i]`: the bucket of input i.
        let mut buckets: Vec<(&[u8], &str, u64, usize)> = Vec::with_capacity(checks.len());
        let mut of = Vec::with_capacity(checks.len());
        for (i, c) in checks.iter().enumerate() {
            let (subject, rule, cost) = (c.subject(), c.rule(), c.cost());
            match buckets.iter().position(|b| b.0 == subject && b.1 == rule) {
                Some(j) => {
                    buckets[j].2 = buckets[j].2.saturating_add(cost);
                    of.push(j);
                }
                None => {
                    of.push(buckets.len());
                    buckets.push((subject, rule, cost, i));
                }
            }
        }
        for b in &buckets {
            self.resolve(b.0, b.1, b.2)?;
        }
        let answer = |each: &mut Vec<Option<Decision>>, j: usize, d: Decision| {
            for (i, _) in of.iter().enumerate().filter(|(_, b)| **b == j) {
                each[i] = Some(d);
            }
        };
        // The order of taking: the buckets covered locally first, then the others, the
        // one not looked at last.
        let now = self.now_ns();
        let covered = |b: &(&[u8], &str, u64, usize)| {
            self.key(b.1, b.0)
                .is_some_and(|ks| self.held_locally(&ks, now) >= b.2)
        };
        let (mut order, remote): (Vec<usize>, Vec<usize>) =
            (0..buckets.len()).partition(|&j| covered(&buckets[j]));
        if let Some((&first, looked)) = remote.split_last() {
            // Taken before the ones looked at: if it refuses, nothing of theirs is taken.
            order.push(first);
            order.extend_from_slice(looked);
        }
        if remote.len() > 1 {
            let looked = &remote[..remote.len() - 1];
            let peeks = looked.iter().map(|&j| {
                let (subject, rule, cost, _) = buckets[j];
                async move { (j, self.peek_named(rule, subject, cost).await) }
            });
            for (j, d) in join_all(peeks).await {
                let d = d?;
                if !matches!(d, Decision::Allowed { .. }) {
                    answer(each, j, d);
                    return Ok((d, buckets[j].3));
                }
            }
        }
        // What to give back should a later check refuse: (key, cost, the lease's epoch,
        // or None for the seat).
        let mut taken: Vec<(Arc<KeyState>, u64, Option<u64>)> = Vec::with_capacity(order.len());
        let mut tightest: Option<(u64, Admission, usize)> = None;
        for j in order {
            let (subject, rule, cost, first) = buckets[j];
            let before = self.key(rule, subject);
            let epoch = before.as_ref().map(|ks| ks.hot().lease.epoch());
            let mut decided = self.check_named(rule, subject, cost).await?;
            if let d @ Decision::Allowed {
                via: Admission::Lease | Admission::Local,
                ..
            } = decided
                && let Some(ks) = self.key(rule, subject)
            {
                decided = self.with_quota(&ks, d);
            }
            answer(each, j, decided);
            match decided {
                Decision::Allowed { remaining, via } => {
                    if tightest.is_none_or(|(r, _, _)| remaining < r) {
                        tightest = Some((remaining, via, first));
                    }
                    if via == Admission::Lease
                        && let (Some(ks), Some(epoch)) = (before, epoch)
                    {
                        taken.push((ks, cost, Some(epoch)));
                    } else if via == Admission::Local
                        && let Some(ks) = self.key(rule, subject)
                    {
                        taken.push((ks, cost, None));
                    }
                }
                refused => {
                    // Tokens spent from local leases go back to them when the store's
                    // view still covers them, and to the seats they came from. The
                    // checks admitted before are not decided after all.
                    for (ks, cost, epoch) in taken {
                        let Some(epoch) = epoch else {
                            Self::refund_seat(&ks, cost);
                            continue;
                        };
                        let _driver = ks.driver.lock().await;
                        ks.hot().lease.refund(cost, epoch);
                    }
                    for (i, d) in each.iter_mut().enumerate() {
                        if of[i] != j {
                            *d = None;
                        }
                    }
                    return Ok((refused, first));
                }
            }
        }
        let (remaining, via, i) = tightest.unwrap_or((0, Admission::Lease, 0));
        Ok((Decision::Allowed { remaining, via }, i))
    }
}
