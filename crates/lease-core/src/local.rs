//! The local share: a standing part of every key's budget that an agent spends without
//! the store.
//!
//! A rule with `local_percent = p` and `local_agents = N` splits each key's bucket
//! (capacity B, rate r) in N + 1 parts: N seats of `s = floor(B * p / 100 / N)` tokens
//! refilling at `r * s / B`, and the global bucket in the store with what is left,
//! `B - N * s` at `r * (B - N * s) / B`. The parts add up to exactly B and r, so the
//! tokens admitted in any window W are at most `B + r * W` (I1) across any number of
//! agents, as long as at most N agents spend seats at any moment and each seat is a
//! bucket of its own:
//! - **tenure**: an agent spends its seat only while it holds one of the rule's N seats in
//!   the store (`lh_seat`: the rule's seat key records who holds a seat until when, by the
//!   server clock), and stops at its own deadline, measured from when it *sent* the
//!   claim, minus a margin, as for a lease (I4); so on the real timeline an agent's
//!   tenure lies inside its record's, and records never number more than N;
//! - **a new tenure starts empty**: a seat's buckets start empty when its holder's tenure
//!   starts (the store says whether a claim renewed a live record or made a new one), so
//!   whatever the seat's previous holder spent, the two together stay within one
//!   bucket's bound; a key the agent has not seen since is full once a whole refill has
//!   passed since the tenure began, so an agent needs no state for keys it forgot;
//! - **per key**: each key's seat bucket is a GCRA cell, one atomic word (its theoretical
//!   arrival time on the agent's clock), spent with a compare-and-swap, never below
//!   empty (I3).
//!
//! What it costs: a key whose demand comes from k < N of the seat holders can use only
//! k of the N seats: up to `p * (N - k) / N` of its budget stays unused. What it buys: a
//! decision on a key whose seat has tokens needs no store call, whatever the key.

use std::num::NonZeroU64;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::rate::Rate;

/// The store key of a rule's seats (`lh:{RULE}:seats`; rule names are plain, see
/// [`crate::rule::RuleName`]).
pub fn seats_key(rule: &str) -> String {
    format!("lh:{{{rule}}}:seats")
}

/// One agent's seat of a rule's local share: per key, `capacity` tokens refilling at
/// `rate`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LocalShare {
    /// How many agents hold seats at most (`local_agents`).
    pub agents: u32,
    /// The percentage of the budget the seats hold together (`local_percent`).
    pub percent: u8,
    /// Tokens one seat holds of each key (s).
    pub capacity: NonZeroU64,
    /// One seat's refill rate of each key (`r * s / B`).
    pub rate: Rate,
}

impl LocalShare {
    /// Nanoseconds the seat takes to refill `tokens` (rounded up: never early).
    #[inline]
    pub fn emission_ns(&self, tokens: u64) -> u64 {
        let num = u128::from(tokens) * u128::from(self.rate.period_us()) * 1000;
        let t = u128::from(self.rate.tokens());
        u64::try_from(num.div_ceil(t)).unwrap_or(u64::MAX)
    }

    /// Whole tokens the seat refills in `ns` nanoseconds (rounded down).
    #[inline]
    pub fn tokens_in(&self, ns: u64) -> u64 {
        let num = u128::from(ns) * u128::from(self.rate.tokens());
        (num / (u128::from(self.rate.period_us()) * 1000)) as u64
    }

    /// Nanoseconds a full seat bucket holds: the time an empty one takes to refill
    /// (rounded down: never more than `capacity` tokens).
    #[inline]
    pub fn tolerance_ns(&self) -> u64 {
        let num = u128::from(self.capacity.get()) * u128::from(self.rate.period_us()) * 1000;
        u64::try_from(num / u128::from(self.rate.tokens())).unwrap_or(u64::MAX)
    }
}

/// When an agent may spend its seat of a rule: its tenure, as the store last confirmed
/// it. Agent clock, nanoseconds; 0 deadline: no seat.
#[derive(Debug, Default)]
pub struct Tenure {
    deadline_ns: AtomicU64,
    since_ns: AtomicU64,
}

/// The store's answer to a seat claim.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SeatReply {
    /// A seat is held until `ttl_us` after the store handled the claim; `renewed`: the
    /// agent's record was live when the claim arrived (its tenure goes on).
    Held {
        /// How long the store keeps the record, µs.
        ttl_us: u64,
        /// The claim extended a live record rather than making a new one.
        renewed: bool,
    },
    /// Every seat is taken; one frees at the latest in `retry_us`.
    Full {
        /// When to try again, µs.
        retry_us: u64,
    },
}

impl Tenure {
    /// A tenure not yet held.
    pub fn new() -> Self {
        Self::default()
    }

    /// Applies the store's answer to a claim sent at `sent_ns` and answered at `now_ns`;
    /// `margin_ns` is taken off the record's lifetime (clock rate error, as for leases).
    pub fn answered(&self, reply: SeatReply, sent_ns: u64, now_ns: u64, margin_ns: u64) {
        match reply {
            SeatReply::Held { ttl_us, renewed } => {
                let deadline = sent_ns
                    .saturating_add(ttl_us.saturating_mul(1000))
                    .saturating_sub(margin_ns);
                if !renewed || self.deadline_ns.load(Ordering::Acquire) == 0 {
                    // A new record: whoever held a seat before may have spent it all.
                    self.since_ns.store(now_ns, Ordering::Release);
                }
                self.deadline_ns.store(deadline, Ordering::Release);
            }
            SeatReply::Full { .. } => self.lost(),
        }
    }

    /// The seat is gone (refused, or the agent stops): no more local spending.
    pub fn lost(&self) {
        self.deadline_ns.store(0, Ordering::Release);
    }

    /// When the tenure in force began, if the agent may spend its seat at `now_ns`.
    #[inline]
    pub fn since(&self, now_ns: u64) -> Option<u64> {
        (now_ns < self.deadline_ns.load(Ordering::Acquire))
            .then(|| self.since_ns.load(Ordering::Acquire))
    }

    /// The deadline of the tenure (0: none), agent clock.
    pub fn deadline_ns(&self) -> u64 {
        self.deadline_ns.load(Ordering::Acquire)
    }
}

/// One key's seat bucket: its theoretical arrival time (GCRA), agent clock ns. Full
/// when it is at or before now; a bucket of a key first seen during a tenure is taken as
/// full since a whole refill after the tenure began.
#[derive(Debug, Default)]
pub struct SeatBucket {
    tat_ns: AtomicU64,
}

/// Why a seat bucket did not admit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SeatRefusal {
    /// The agent holds no seat now.
    NoSeat,
    /// The seat's bucket has too few tokens; `cost` of them exist in `wait_ns`.
    Short {
        /// Nanoseconds until the cost fits.
        wait_ns: u64,
    },
}

impl SeatBucket {
    /// A bucket with nothing spent.
    pub fn new() -> Self {
        Self::default()
    }

    /// Takes `cost` tokens at `now_ns` during the tenure that began at `since_ns`;
    /// returns the tokens left.
    #[inline]
    pub fn take(
        &self,
        share: &LocalShare,
        cost: u64,
        now_ns: u64,
        since_ns: u64,
    ) -> Result<u64, SeatRefusal> {
        let tau = share.tolerance_ns();
        let step = share.emission_ns(cost);
        let floor = since_ns.saturating_add(tau);
        let mut tat = self.tat_ns.load(Ordering::Acquire);
        loop {
            let from = tat.max(now_ns).max(floor);
            let next = from.saturating_add(step);
            let limit = now_ns.saturating_add(tau);
            if next > limit {
                return Err(SeatRefusal::Short {
                    wait_ns: next - limit,
                });
            }
            match self
                .tat_ns
                .compare_exchange_weak(tat, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return Ok(share.tokens_in(limit - next)),
                Err(seen) => tat = seen,
            }
        }
    }

    /// Gives back `cost` tokens taken by [`SeatBucket::take`] (the request was refused by
    /// another rule).
    pub fn refund(&self, share: &LocalShare, cost: u64) {
        let step = share.emission_ns(cost);
        let _ = self
            .tat_ns
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |t| {
                Some(t.saturating_sub(step))
            });
    }

    /// Tokens the bucket holds at `now_ns`, during the tenure that began at `since_ns`.
    pub fn level(&self, share: &LocalShare, now_ns: u64, since_ns: u64) -> u64 {
        let tau = share.tolerance_ns();
        let from = (self.tat_ns.load(Ordering::Acquire))
            .max(now_ns)
            .max(since_ns.saturating_add(tau));
        share.tokens_in(now_ns.saturating_add(tau).saturating_sub(from))
    }

    /// Whether the bucket is full at `now_ns` (the key may be forgotten: a key not seen
    /// is taken as full).
    #[inline]
    pub fn full_at(&self, now_ns: u64) -> bool {
        self.tat_ns.load(Ordering::Acquire) <= now_ns
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn share(s: u64, rate: &str) -> LocalShare {
        LocalShare {
            agents: 4,
            percent: 40,
            capacity: NonZeroU64::new(s).unwrap(),
            rate: rate.parse().unwrap(),
        }
    }

    const MS: u64 = 1_000_000;

    fn held(tenure: &Tenure, sent: u64, renewed: bool) {
        let reply = SeatReply::Held {
            ttl_us: 1_000_000,
            renewed,
        };
        tenure.answered(reply, sent, sent + MS, 10 * MS);
    }

    #[test]
    fn a_new_tenure_starts_empty_and_refills_at_the_seat_rate() {
        // 10 tokens refilling at 100/s: empty at the claim, full 100 ms later.
        let sh = share(10, "100/s");
        let (t, b) = (Tenure::new(), SeatBucket::new());
        assert_eq!(t.since(0), None, "no seat yet");
        held(&t, 0, false);
        let since = t.since(MS).unwrap();
        assert_eq!(since, MS);
        assert_eq!(
            b.take(&sh, 1, MS, since),
            Err(SeatRefusal::Short { wait_ns: 10 * MS })
        );
        // 10 ms later one token exists.
        assert_eq!(b.level(&sh, 11 * MS, since), 1);
        assert_eq!(b.take(&sh, 1, 11 * MS, since), Ok(0));
        assert_eq!(b.level(&sh, 500 * MS, since), 10);
        // Long after, a whole bucket and no more.
        let later = 500 * MS;
        assert_eq!(b.take(&sh, 10, later, since), Ok(0));
        assert!(b.take(&sh, 1, later, since).is_err());
        b.refund(&sh, 4);
        assert_eq!(b.take(&sh, 4, later, since), Ok(0));
    }

    #[test]
    fn a_seat_is_spent_only_until_the_deadline_and_a_lapse_restarts_empty() {
        let sh = share(10, "100/s");
        let (t, b) = (Tenure::new(), SeatBucket::new());
        held(&t, 0, false);
        // Deadline: sent + 1 s - 10 ms margin.
        assert!(t.since(989 * MS).is_some());
        assert_eq!(t.since(990 * MS), None);
        // Renewed while live: the tenure goes on, the bucket keeps its level.
        held(&t, 900 * MS, true);
        assert_eq!(t.since(1500 * MS), Some(MS));
        assert_eq!(b.take(&sh, 10, 1500 * MS, MS), Ok(0));
        // A new record (the old one expired in the store): empty again.
        held(&t, 3000 * MS, false);
        let since = t.since(3001 * MS).unwrap();
        assert_eq!(since, 3001 * MS);
        assert!(b.take(&sh, 1, 3001 * MS, since).is_err());
        t.answered(SeatReply::Full { retry_us: 5 }, 3100 * MS, 3101 * MS, 0);
        assert_eq!(t.since(3102 * MS), None);
    }

    #[test]
    fn fractional_rates_round_against_the_spender() {
        // 3 tokens at 7 per 100 ms: a token every 14 285 714.28 ns.
        let sh = share(3, "7/100ms");
        assert_eq!(sh.emission_ns(1), 14_285_715);
        assert_eq!(sh.tolerance_ns(), 42_857_142);
        let b = SeatBucket::new();
        let now = 10_000 * MS;
        assert_eq!(b.take(&sh, 2, now, 0), Ok(0), "2.99 tokens left is 0 whole");
        assert!(b.take(&sh, 2, now, 0).is_err());
        assert!(b.full_at(now + 2 * sh.emission_ns(1)));
    }
}
