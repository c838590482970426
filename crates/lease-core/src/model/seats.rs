//! The seats of a rule's local share (see [`crate::local`]), as the store keeps them: one
//! key per rule, `lh:{RULE}:seats`, a hash of agent → the end of its tenure (server µs),
//! plus the last server time seen (`ts`, so a clock stepping back ends no tenure early
//! and starts none late, I5). `lh_seat` in `leasehold.lua` is its twin.

use std::collections::BTreeMap;

use super::AgentId;
use crate::local::SeatReply;

/// The longest tenure an agent may ask for: a typo guard.
pub const MAX_SEAT_TTL_US: u64 = 3_600_000_000;

/// The most seats a rule may have (`local_agents`).
pub const MAX_SEATS: u64 = 4096;

/// A rule's seats: who holds one, until when (server µs).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Seats {
    holders: BTreeMap<AgentId, u64>,
    last_us: u64,
}

impl Seats {
    /// No seat held.
    pub fn new() -> Self {
        Self::default()
    }

    /// `agent` claims or renews one of `seats` seats for `ttl_us` at server time `now_us`:
    /// tenures that ended are dropped first; a live record is extended (`renewed`), a new
    /// one made while fewer than `seats` are live, and otherwise the claim is refused
    /// until the soonest tenure ends.
    pub fn claim(&mut self, agent: AgentId, seats: u64, ttl_us: u64, now_us: u64) -> SeatReply {
        let now = now_us.max(self.last_us);
        self.last_us = now;
        self.holders.retain(|_, until| *until > now);
        let renewed = self.holders.contains_key(&agent);
        if renewed || (self.holders.len() as u64) < seats {
            self.holders.insert(agent, now + ttl_us);
            return SeatReply::Held { ttl_us, renewed };
        }
        let soonest = self.holders.values().min().copied().unwrap_or(now + 1);
        SeatReply::Full {
            retry_us: (soonest - now).max(1),
        }
    }

    /// `agent` gives its seat up at server time `now_us` (it stops, or no longer needs
    /// it): its record goes at once, with every tenure that ended.
    pub fn leave(&mut self, agent: AgentId, now_us: u64) {
        let now = now_us.max(self.last_us);
        self.last_us = now;
        self.holders.retain(|a, until| *until > now && *a != agent);
    }

    /// The records kept, agent and end of tenure (server µs), and the last server time:
    /// what `lh_seat` stores.
    pub fn stored(&self) -> (Vec<(AgentId, u64)>, u64) {
        (
            self.holders.iter().map(|(a, u)| (*a, *u)).collect(),
            self.last_us,
        )
    }

    /// Whether nothing is held past `now_us` (the key may go).
    pub fn idle(&self, now_us: u64) -> bool {
        self.holders
            .values()
            .all(|&u| u <= now_us.max(self.last_us))
    }

    /// Live records at `now_us`.
    pub fn held(&self, now_us: u64) -> usize {
        let now = now_us.max(self.last_us);
        self.holders.values().filter(|&&u| u > now).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn at_most_n_records_live_and_a_freed_seat_goes_to_the_next_claim() {
        let mut s = Seats::new();
        let (a, b, c) = (AgentId(1), AgentId(2), AgentId(3));
        let held = |renewed| SeatReply::Held {
            ttl_us: 100,
            renewed,
        };
        assert_eq!(s.claim(a, 2, 100, 1_000), held(false));
        assert_eq!(s.claim(b, 2, 100, 1_010), held(false));
        assert_eq!(s.claim(c, 2, 100, 1_020), SeatReply::Full { retry_us: 80 });
        assert_eq!(s.claim(a, 2, 100, 1_050), held(true));
        // b's tenure ended at 1 110: c gets the seat, b's next claim is refused.
        assert_eq!(s.claim(c, 2, 100, 1_110), held(false));
        assert_eq!(s.claim(b, 2, 100, 1_111), SeatReply::Full { retry_us: 39 });
        // A clock stepping back ends nothing early.
        assert_eq!(s.held(900), 2);
        s.leave(a, 1_115);
        assert_eq!(s.claim(b, 2, 100, 1_120), held(false));
        assert!(!s.idle(1_200));
        assert!(s.idle(1_300));
    }
}
