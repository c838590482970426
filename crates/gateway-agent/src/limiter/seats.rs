//! Seats of a rule's local share: this agent's seat, the key's bucket of it, and giving
//! a seat back (see [`leasehold_core::local`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use leasehold_core::local::{LocalShare, SeatRefusal, Tenure};

use crate::counters::Counter;

use super::keys::KeyState;
use super::{Admission, Decision, Limiter};

/// A rule's local share as this agent holds it: the share it claims a seat of, and the
/// tenure the store confirmed (see [`leasehold_core::local`]).
pub(super) struct Seat {
    pub(super) share: LocalShare,
    pub(super) tenure: Tenure,
    /// When a decision of the rule last wanted the seat (agent clock, to about
    /// [`SEAT_WANTED_GRAIN_NS`]): an idle gateway gives its seat back.
    pub(super) wanted_ns: AtomicU64,
}

/// How stale [`Seat::wanted_ns`] may be: it is written at most once per this long, so
/// the threads deciding on a rule's keys do not all write one word.
pub(super) const SEAT_WANTED_GRAIN_NS: u64 = 50_000_000;

impl Seat {
    #[inline]
    pub(super) fn wanted(&self, now: u64) {
        if now.saturating_sub(self.wanted_ns.load(Ordering::Relaxed)) > SEAT_WANTED_GRAIN_NS {
            self.wanted_ns.store(now, Ordering::Relaxed);
        }
    }
}

/// How long the store keeps a seat's record after a claim; claims renew it every
/// [`SEAT_RENEW_EVERY`], so a seat survives two lost renewals, and an agent that stops
/// renewing frees it within this time.
pub(super) const SEAT_TTL_US: u64 = 3_000_000;

pub(super) const SEAT_RENEW_EVERY: Duration = Duration::from_secs(1);

/// Taken off a tenure's end, as off a lease's (clock rate error between agent and store).
pub(super) const SEAT_MARGIN_NS: u64 = 100_000_000;

impl Limiter {
    /// Takes `cost` from the key's bucket of this agent's seat, if its rule has a local
    /// share, the agent holds a seat now, and the bucket covers it. Otherwise how long
    /// until it would (`u64::MAX`: never, no seat).
    pub(super) fn spend_seat(&self, ks: &KeyState, cost: u64, now: u64) -> Result<Decision, u64> {
        Self::take_seat(ks, cost, now).map(|left| self.seat_admitted(ks, cost, left))
    }

    /// [`Limiter::spend_seat`] uncounted: the tokens the seat's bucket holds after.
    pub(super) fn take_seat(ks: &KeyState, cost: u64, now: u64) -> Result<u64, u64> {
        if ks.transient {
            // Its bucket would be forgotten with it: a new one starts full.
            return Err(u64::MAX);
        }
        let entry = ks.entry.load();
        let Some((share, seat)) = &entry.local else {
            return Err(u64::MAX);
        };
        seat.wanted(now);
        let since = seat.tenure.since(now).ok_or(u64::MAX)?;
        match ks.seat.take(share, cost, now, since) {
            Ok(left) => Ok(left),
            Err(SeatRefusal::Short { wait_ns }) => Err(wait_ns),
            Err(SeatRefusal::NoSeat) => Err(u64::MAX),
        }
    }

    /// Counts an admission of `cost` by the key's seat, which holds `left` after.
    pub(super) fn seat_admitted(&self, ks: &KeyState, cost: u64, left: u64) -> Decision {
        ks.counters.incr(Counter::AdmittedLocal);
        // A leasing key's report to the coordinator counts every admission; a cold
        // key's is not reported (its decisions are exact by construction).
        if ks.hot().leases() {
            ks.without_store.fetch_add(cost, Ordering::Relaxed);
        }
        Decision::Allowed {
            remaining: left,
            via: Admission::Local,
        }
    }

    /// Gives `cost` back to the key's seat bucket (another rule refused the request).
    pub(super) fn refund_seat(ks: &KeyState, cost: u64) {
        if let Some((share, _)) = &ks.entry.load().local {
            ks.seat.refund(share, cost);
        }
    }

    /// The seats of the rules in force with a local share (a snapshot, so no lock is held
    /// across store calls).
    pub(super) fn seats(&self) -> Vec<(Box<str>, Arc<Seat>)> {
        (self.inner.rules.load().seats.iter())
            .map(|(n, s)| (n.clone(), s.clone()))
            .collect()
    }

    /// Stops spending `seat` of the rule `name` and gives it back to the store, so
    /// another agent may take it (its tenure starts empty).
    pub(super) async fn give_seat_back(&self, name: &str, seat: &Seat) {
        seat.tenure.lost();
        let agents = u64::from(seat.share.agents);
        let left = (self.inner.store)
            .claim_seat(name, self.inner.agent, agents, SEAT_TTL_US, true)
            .await;
        if let Err(e) = left {
            tracing::debug!(rule = %name, error = %e, "giving a seat back failed");
        }
    }
}
