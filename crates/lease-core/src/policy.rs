//! The agent's per-key policy as a state machine: what an agent measures, asks the store
//! for, and does with the answer, with the clock as a parameter.
//!
//! `gateway-agent` drives one [`KeyPolicy`] per key under the key's I/O lock (locks,
//! clock, store calls and the background loop are its business); the fleet tests drive
//! hundreds of them against the reference model on a virtual clock. Nothing else holds a
//! copy of this policy.
//!
//! The whole policy, in order of a key's life:
//! - **cold**: every decision is one exact call; a key whose local rate passes
//!   `hot_above_per_sec` (more when its calls carry other keys: [`promote_above`]), or
//!   that other agents lease already, is promoted and leases from then on
//!   ([`KeyPolicy::exact_done`]);
//! - **demand**: measured at acquires as what the lease spent plus what was denied, over
//!   at least 5 ms ([`KeyPolicy::acquire`]); reported to the store as an average over
//!   about a second;
//! - **sizing**: a lease covers `horizon` of the agent's demand times the share of it the
//!   store granted (see [`crate::sizing`]); under the low-water mark (half the lease, or
//!   two round trips of demand on a dry bucket) the agent prefetches;
//! - **denial cache**: a refused caller denies locally until the time the store named;
//!   for a second after an acquire got less than it asked (the bucket dry), a caller the
//!   lease cannot cover is denied at once while a prefetch refills it, and never waits
//!   for the store ([`KeyPolicy::deny_while_refilling_until`]);
//! - **sweep**: idle leases go back and their keys demote; leases larger than the share
//!   justifies go back; live leases close to expiry renew ([`KeyPolicy::sweep`]);
//! - **emergency**: with the store unreachable, a `local_emergency` rule admits at the
//!   agent's last granted share of the rate ([`emergency_limit`]).

use std::time::Duration;

use crate::cell::{Cell, Refill};
use crate::lease::LocalLease;
use crate::model::Reply;
use crate::rate::Rate;
use crate::rule::{Leasing, Rule};
use crate::sizing::{self, LeaseRequest, Reclaim};

/// Demand is measured over at least this long, so a measurement is never a burst of
/// queued callers divided by a few microseconds.
const MEASURE_MIN_NS: u64 = 5_000_000;

/// What a store call costs Redis for itself, and for each key an exact batch carries, in
/// one unit: `scripts/lua-cost` counts about 84 000 instructions a call of
/// `lh_exact_batch` and 31 000 a key (2.7 : 1).
const CALL_COST: u64 = 27;
const KEY_COST: u64 = 10;

/// The tokens a second (here, this second) above which a cold key leases, when its exact
/// decisions ride in store calls of `keys` keys: `hot_above` for a key alone in its calls,
/// up to 3.7x that as calls fill. A lease pays when it carries the store work of enough
/// exact decisions; in a batch of 14 keys an exact decision costs Redis a third of what
/// a call of its own does, so a lease must carry three times as many (zipf-store, two
/// paired runs against the fixed 20/s: 16% fewer store calls, Redis CPU a decision 5-11%
/// lower, p99 20-27% lower; long-tail-store the same within the noise). A key a gateway
/// decides alone (a fleet's one tenant) still leases from `hot_above`.
pub fn promote_above(hot_above: u64, keys: u64) -> u64 {
    let keys = keys.max(1);
    let x = u128::from(hot_above) * u128::from(CALL_COST + KEY_COST) * u128::from(keys)
        / u128::from(CALL_COST + KEY_COST * keys);
    u64::try_from(x).unwrap_or(u64::MAX)
}

/// How long a short grant (the bucket dry) makes callers that find the lease empty
/// denied at once rather than wait for the store ([`KeyPolicy::deny_while_refilling_until`]):
/// about the time demand is averaged over, so an agent with a small share, whose acquires
/// are far apart, keeps it from one to the next.
const DRY_FOR_NS: u64 = 1_000_000_000;

/// The agent's tuning that the policy reads (a subset of the agent's configuration).
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct PolicyConfig {
    /// A lease covers about this much of the key's local demand.
    pub horizon: Duration,
    /// A lease stops being spent this long before the store would let it expire (capped
    /// at a quarter of the lease lifetime).
    pub margin: Duration,
    /// A lease unspent for this long is returned (capped at `idle_after`).
    pub return_after: Duration,
    /// A leased key with no activity for this long returns its lease and turns cold
    /// (capped at half the lease lifetime).
    pub idle_after: Duration,
    /// A cold key (auto leasing) becomes leased above this many tokens per second, when
    /// its exact calls carry it alone ([`promote_above`]).
    pub hot_above_per_sec: u64,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        Self {
            horizon: sizing::DEFAULT_HORIZON,
            margin: Duration::from_millis(50),
            return_after: Duration::from_millis(500),
            idle_after: Duration::from_secs(2),
            hot_above_per_sec: 20,
        }
    }
}

/// The arguments of one acquire.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AcquireArgs {
    /// What the lease holds (state-based report).
    pub held: u64,
    /// Tokens wanted.
    pub want: u64,
    /// The least grant worth having.
    pub min: u64,
    /// Demand reported, thousandths of a token per second.
    pub demand: u64,
}

/// What the agent does with an acquire's reply.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Granted {
    /// Prefetch when the lease falls below this.
    pub low_water: u64,
    /// Deny callers locally until then (a refused caller).
    pub deny_until_ns: Option<u64>,
    /// Do not prefetch before then (a refused prefetch).
    pub prefetch_after_ns: Option<u64>,
}

/// What the sweep does with a leased key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SweepAction {
    /// Nothing.
    Keep,
    /// The key went idle: it turns cold (auto leasing) and returns its lease, withdrawing
    /// its demand.
    Idle,
    /// Return the lease now (see [`Reclaim`]).
    Reclaim(Reclaim),
    /// The lease is live and close to its deadline: acquire again.
    Renew,
}

/// One key's policy state. Everything but the lease itself, which the hot path spends
/// from without a lock.
#[derive(Clone, Debug, Default)]
pub struct KeyPolicy {
    last_want: u64,
    /// When an acquire last got less than it asked (agent clock; 0: never).
    dry_at_ns: u64,
    /// When the last non-empty grant was installed (agent clock).
    granted_at_ns: u64,
    /// Demand for sizing: the measured rate, smoothed over two measurements.
    demand_milli: u64,
    /// Demand reported to the store, thousandths of a token per second.
    reported_milli: f64,
    /// How long the reported demand has been measured (capped at a second).
    measured_ns: u64,
    /// The proportional share the store last reported, millionths (0: none yet).
    scale_ppm: u64,
    /// The demand measured at the last acquire reached the rule's rate
    /// ([`sizing::over_rate`]).
    over_rate: bool,
    /// When demand was last measured (agent clock; 0: never), and the offered tokens
    /// (spent from the lease plus denied) counted then.
    measured_at_ns: u64,
    offered_seen: u64,
    cold_window_ns: u64,
    cold_tokens: u64,
    seen_held: u64,
    seen_denied: u64,
    seen_at_ns: u64,
    /// Running totals the coordinator's accounting reads.
    granted_total: u64,
    unspent_total: u64,
    exact_total: u64,
    emergency_total: u64,
    calls_total: u64,
}

impl KeyPolicy {
    /// A key first seen at `now_ns`.
    pub fn new(now_ns: u64) -> Self {
        Self {
            seen_at_ns: now_ns,
            ..Self::default()
        }
    }

    /// Prepares an acquire sent at `sent_ns` for `lease` (what it holds is declared; what
    /// its deadline took is forfeited), on a key with `denied_total` tokens denied so far,
    /// for a caller that needs `needed` tokens now (0: a prefetch).
    pub fn acquire(
        &mut self,
        rule: &Rule,
        cfg: &PolicyConfig,
        sent_ns: u64,
        lease: &LocalLease,
        denied_total: u64,
        needed: u64,
    ) -> AcquireArgs {
        let (held, forfeited) = lease.declare_counting(sent_ns);
        self.unspent_total += forfeited;
        // Offered demand: what the lease spent and what was denied, measured over at
        // least MEASURE_MIN_NS since the last measurement (not since the last grant: a
        // grant spent at once by queued callers is followed by an acquire in the same
        // instant, and that demand must still be seen).
        let offered = self.lease_spent(held) + denied_total;
        if self.measured_at_ns == 0 {
            (self.measured_at_ns, self.offered_seen) = (sent_ns.max(1), offered);
        } else if sent_ns >= self.measured_at_ns + MEASURE_MIN_NS {
            let dt = sent_ns - self.measured_at_ns;
            let consumed = offered.saturating_sub(self.offered_seen);
            let rate = u128::from(consumed) * 1_000_000_000_000 / u128::from(dt);
            let rate = u64::try_from(rate).unwrap_or(u64::MAX);
            // Sizing follows the recent rate: a lease drained fast means the next one
            // must be larger.
            self.demand_milli = if self.demand_milli == 0 {
                rate
            } else {
                self.demand_milli / 2 + rate / 2
            };
            // What is reported (shares, emergency limits) is a time-weighted average
            // over about a second: a burst spent in microseconds barely moves it.
            (self.reported_milli, self.measured_ns) =
                sizing::report_demand(self.reported_milli, rate, dt, self.measured_ns);
            (self.measured_at_ns, self.offered_seen) = (sent_ns, offered);
        }
        self.over_rate = sizing::over_rate(rule, self.demand_milli);
        let r: LeaseRequest = sizing::size_lease(
            rule,
            self.demand_milli,
            self.scale_ppm,
            cfg.horizon,
            needed,
            self.last_want,
            held == 0 && sent_ns.saturating_sub(self.granted_at_ns) < cfg.horizon.as_nanos() as u64,
        );
        self.last_want = r.want;
        AcquireArgs {
            held,
            want: r.want,
            min: r.min,
            demand: self.reported().min(crate::model::MAX_HELD),
        }
    }

    /// Takes in the reply to an acquire sent at `sent_ns` for `needed` tokens, read at
    /// `now_ns`, and installs its grant in `lease`, with a deadline measured from the
    /// moment the acquire was sent (I4). `ending`: the reply comes from a split part
    /// whose term is ending (it leased nothing, and the lease keeps its deadline, which
    /// ends before the part's records do).
    #[allow(clippy::too_many_arguments)] // one call per acquire, all of it needed
    pub fn granted(
        &mut self,
        rule: &Rule,
        cfg: &PolicyConfig,
        cell: &Cell,
        refill: &Refill,
        sent_ns: u64,
        now_ns: u64,
        needed: u64,
        reply: &Reply,
        ending: bool,
    ) -> Granted {
        let lease = &cell.lease;
        if !ending {
            let ttl_ns = reply.ttl_us * 1000;
            let margin = (cfg.margin.as_nanos() as u64).min(ttl_ns / 4);
            lease.grant(reply.granted, sent_ns + ttl_ns - margin);
        }
        let held_after = lease.held();
        self.granted_total += reply.granted;
        // Less than asked from a bucket that still leases: it is dry. (A bucket that moved
        // or is ending leases nothing now; its callers go elsewhere.)
        let short = !ending && !reply.moved && reply.granted < self.last_want;
        if ending || reply.moved {
            self.dry_at_ns = 0;
        } else if short {
            self.dry_at_ns = now_ns;
        }
        if reply.granted > 0 {
            self.granted_at_ns = now_ns;
        }
        if reply.scale_ppm != 0 {
            self.scale_ppm = reply.scale_ppm;
        }
        self.seen_held = held_after;
        self.seen_at_ns = now_ns;
        let mut g = Granted {
            low_water: self.low_water(now_ns, now_ns.saturating_sub(sent_ns), needed),
            deny_until_ns: None,
            prefetch_after_ns: None,
        };
        if reply.granted == 0 && !ending {
            // A refused caller denies until the store's time; a refused prefetch waited
            // for a batch (see `sizing::size_lease`), callers need less and try for
            // themselves when the lease runs dry.
            let until = now_ns + reply.retry_us.max(1) * 1000;
            if needed > 0 {
                g.deny_until_ns = Some(until);
            } else {
                g.prefetch_after_ns = Some(until);
            }
        }
        if short && self.contended() {
            // A dry, contended key gives this agent its share and no more, and the
            // store's time for a refused acquire is the earlier of the agent's turn and
            // the moment the bucket reaches its plenty level, which every agent of the
            // key races for: prefetching at that time, most acquires were refused (on
            // one key of B = r/10 with 8 agents flat out, 83% of them, each bringing
            // about one token). The next prefetch waits until the share has brought a
            // quarter of the lease (see `pace_ns`).
            let until = now_ns + self.pace_ns(rule, cfg);
            g.prefetch_after_ns = Some(g.prefetch_after_ns.map_or(until, |u| u.max(until)));
        }
        cell.set_low_water(g.low_water);
        if let Some(until) = g.deny_until_ns {
            cell.deny(until, needed);
        } else if reply.granted > 0 {
            cell.clear_denial();
        }
        refill.granted(self, g.prefetch_after_ns);
        g
    }

    /// How long this agent's share takes to bring a quarter of its last lease, at most
    /// `horizon` and the time the rule's rate takes to bring B/2 (tokens a stale share
    /// leaves unclaimed are taken before the bucket fills). Half the lease (the least a
    /// contended acquire takes, see [`sizing::size_lease`]) would save more calls, but
    /// the agents then claim their credit in larger, rarer steps, and the virtual fleet
    /// matrix measured shares up to 10.4% off (8 agents, 3x r, Zipf) instead of 0.7%.
    fn pace_ns(&self, rule: &Rule, cfg: &PolicyConfig) -> u64 {
        let half_b = rule.capacity().get() as f64 / 2.0 / rule.rate().per_sec_f64() * 1e9;
        let cap = (cfg.horizon.as_nanos() as f64).min(half_b);
        let tokens = (self.last_want / 4).max(1) as f64;
        let pace = match self.share_milli() {
            0 => cap,
            share => (tokens * 1e12 / share as f64).min(cap),
        };
        pace as u64
    }

    /// Counts an exact decision of `cost` taken at `now_ns` (`admitted` or not), in a
    /// store call of `call_keys` keys, whose reply said whether other agents lease the key
    /// (`leased_elsewhere`); returns true when the key becomes hot here (auto leasing): its
    /// local rate passed the threshold ([`promote_above`]), or the fleet leases it already
    /// (a popular tenant spread over many gateways is hot even where each sees a few
    /// requests a second).
    #[allow(clippy::too_many_arguments)] // one call per exact decision, all of it needed
    pub fn exact_done(
        &mut self,
        rule: &Rule,
        cfg: &PolicyConfig,
        now_ns: u64,
        cost: u64,
        admitted: bool,
        call_keys: u64,
        leased_elsewhere: bool,
    ) -> bool {
        if admitted {
            self.exact_total += cost;
        }
        if now_ns.saturating_sub(self.cold_window_ns) >= 1_000_000_000 {
            self.cold_window_ns = now_ns;
            self.cold_tokens = 0;
        }
        self.cold_tokens += cost;
        let fast = self.cold_tokens > promote_above(cfg.hot_above_per_sec, call_keys);
        if rule.leasing() != Leasing::Auto || !(fast || leased_elsewhere) {
            return false;
        }
        // Sizing: the demand seen cold over at least a second, so a lease starts small
        // and grows with what is measured. Reported (shares, and with them whether the
        // key is contended): the rate over the time it was seen in (at least
        // MEASURE_MIN_NS), weighing as little as that time against the measurements to
        // come, so the store sees a key's demand from its first acquires, not a second or
        // two later.
        let seen_ns = now_ns - self.cold_window_ns;
        let elapsed_ms = seen_ns.max(1_000_000_000) / 1_000_000;
        self.demand_milli = self.cold_tokens * 1_000_000 / elapsed_ms;
        let seen_ns = seen_ns.clamp(MEASURE_MIN_NS, 1_000_000_000);
        self.reported_milli = self.cold_tokens as f64 * 1e12 / seen_ns as f64;
        self.measured_ns = seen_ns;
        true
    }

    /// Counts a store call.
    pub fn called(&mut self) {
        self.calls_total += 1;
    }

    /// The key's calls go to another bucket now (a split's part, or back): slow start
    /// begins again there.
    pub fn moved(&mut self) {
        self.last_want = 0;
        self.dry_at_ns = 0;
    }

    /// The lease gave back `taken` tokens (returned or forfeited); `withdraw` also clears
    /// the reported demand. Returns whether the reported demand was non-zero (so a
    /// release must tell the store even with nothing to return).
    pub fn released(&mut self, taken: u64, withdraw: bool) -> bool {
        self.unspent_total += taken;
        let had = self.reported_milli > 0.0;
        if withdraw && had {
            self.reported_milli = 0.0;
            self.measured_ns = 0;
            self.demand_milli = 0;
        }
        withdraw && had
    }

    /// Counts an admission made without the store (emergency or fail-open), so the
    /// coordinator's accounting sees an outage's admissions.
    pub fn admitted_without_store(&mut self, cost: u64) {
        self.emergency_total += cost;
    }

    /// The sweep's decision for a leased key with `lease`, `denied_total` tokens denied
    /// so far, last sent to the store at `last_io_ns`.
    pub fn sweep(
        &mut self,
        rule: &Rule,
        cfg: &PolicyConfig,
        now_ns: u64,
        lease: &LocalLease,
        denied_total: u64,
        last_io_ns: u64,
    ) -> SweepAction {
        let (held, deadline_ns) = (lease.held(), lease.deadline_ns());
        // Activity: spending from the lease, or being denied.
        if held != self.seen_held || denied_total != self.seen_denied {
            self.seen_held = held;
            self.seen_denied = denied_total;
            self.seen_at_ns = now_ns;
        }
        let ttl_ns = rule.lease_ttl().as_nanos() as u64;
        let idle_after = (cfg.idle_after.as_nanos() as u64).min(ttl_ns / 2);
        let quiet = now_ns.saturating_sub(self.seen_at_ns);
        if quiet >= idle_after && now_ns.saturating_sub(last_io_ns) >= idle_after {
            return SweepAction::Idle;
        }
        let return_after = (cfg.return_after.as_nanos() as u64).min(idle_after);
        let fair = self
            .contended()
            .then(|| sizing::lease_request(rule, self.share_milli(), cfg.horizon, 0).want);
        match sizing::reclaim(held, self.reported(), quiet, return_after, fair) {
            Reclaim::Keep => {
                if held > 0 && deadline_ns > now_ns && deadline_ns - now_ns < ttl_ns / 4 {
                    SweepAction::Renew
                } else {
                    SweepAction::Keep
                }
            }
            r => SweepAction::Reclaim(r),
        }
    }

    /// Until when a caller that finds the lease empty is denied at once while a prefetch
    /// refills it, rather than waiting for a store call of its own (agent clock; 0: not
    /// at all): for `DRY_FOR_NS` after an acquire got less than it asked (the bucket
    /// dry), on a key the store says is contended (the demand its agents report exceeds
    /// the rate) or whose demand here alone reaches the rate. The agent's callers then
    /// want more than the bucket gives it, so one denied now instead of admitted a round
    /// trip later changes nothing in what it admits (the tokens the prefetch brings go to
    /// the next callers), and no decision waits for the store. Dry alone is not enough:
    /// under the limit a small B is dry whenever the fleet's leases hold most of it, and
    /// there a caller admitted a round trip later is one the limit allows. Reported
    /// demand lags what is offered (about a second after promotion): until the store sees
    /// the contention, callers wait.
    pub fn deny_while_refilling_until(&self) -> u64 {
        if self.dry_at_ns == 0 || !(self.contended() || self.over_rate) {
            return 0;
        }
        self.dry_at_ns + DRY_FOR_NS
    }

    /// Prefetch when the lease falls below this, for a caller that needed `needed`, the
    /// last acquire having taken `rtt_ns`. Half the lease as a rule, so the prefetch
    /// lands before the lease runs out. On a dry, contended bucket (see
    /// [`Self::deny_while_refilling_until`]) what the agent holds is taken from a bucket
    /// other agents are waiting on: there it prefetches only when what is left covers
    /// less than two round trips of its demand. A caller that finds the lease short
    /// meanwhile is denied, which costs nothing, as the agent wants more than it gets;
    /// the whole fleet then holds about two round trips of the rate instead of half its
    /// leases more.
    fn low_water(&self, now_ns: u64, rtt_ns: u64, needed: u64) -> u64 {
        let half = self.last_want / 2;
        let dry = now_ns < self.deny_while_refilling_until();
        let water = if dry {
            let spent = u128::from(self.demand_milli) * u128::from(rtt_ns.max(1)) * 2;
            u64::try_from(spent.div_ceil(1_000_000_000_000))
                .unwrap_or(u64::MAX)
                .min(half)
        } else {
            half
        };
        water.max(needed).max(1)
    }

    /// True when the store last said the key is contended (shares below one).
    pub fn contended(&self) -> bool {
        self.scale_ppm != 0 && self.scale_ppm < 1_000_000
    }

    /// The demand reported to the store, thousandths of a token per second.
    pub fn reported(&self) -> u64 {
        self.reported_milli as u64
    }

    /// This agent's share of the key: its reported demand times the store's last
    /// proportional scale, thousandths of a token per second.
    pub fn share_milli(&self) -> u64 {
        sizing::scaled(self.reported(), self.scale_ppm)
    }

    /// Tokens spent from the lease so far, given what it holds now.
    fn lease_spent(&self, held: u64) -> u64 {
        self.granted_total.saturating_sub(self.unspent_total + held)
    }

    /// Running totals for the coordinator's report.
    pub fn totals(&self, held: u64) -> Totals {
        Totals {
            admitted: self.lease_spent(held) + self.exact_total + self.emergency_total,
            calls: self.calls_total,
            demand_milli: self.reported(),
        }
    }
}

/// The local limit a `local_emergency` rule applies while the store is unreachable, for
/// an agent whose last granted share of the key was `share_milli` (thousandths of a token
/// per second; see [`KeyPolicy::share_milli`]): the share, never above the rule's rate,
/// with a burst of the same fraction of B. Summed over the fleet that is about r and B,
/// so an outage admits about what one bucket would. An agent that never had a share (the
/// key was cold here) uses the rate above which it would have leased, `hot_above_per_sec`.
/// The emergency bucket starts empty: what the agent's lease still holds is spent first.
pub fn emergency_limit(rule: &Rule, cfg: &PolicyConfig, share_milli: u64) -> (Rate, u64) {
    let rule_rate = rule.rate();
    let milli = if share_milli == 0 {
        cfg.hot_above_per_sec.saturating_mul(1000).max(1)
    } else {
        share_milli
    };
    let per_1000s = std::num::NonZeroU64::new(milli).unwrap_or(std::num::NonZeroU64::MIN);
    let rate = match Rate::new(per_1000s, Duration::from_secs(1000)) {
        Ok(r) if r.per_sec_f64() < rule_rate.per_sec_f64() => r,
        _ => rule_rate,
    };
    let fraction = rate.per_sec_f64() / rule_rate.per_sec_f64();
    let cap =
        ((rule.capacity().get() as f64 * fraction).ceil() as u64).clamp(1, rule.capacity().get());
    (rate, cap)
}

/// What an agent reports of a key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Totals {
    /// Tokens admitted against the bucket so far: spent from leases, exact admissions,
    /// and admissions made while the store was unreachable.
    pub admitted: u64,
    /// Store calls made for the key.
    pub calls: u64,
    /// Reported demand, thousandths of a token per second.
    pub demand_milli: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One acquire for a caller needing a token at `at_ns`, answered 1 µs later with
    /// `granted` tokens, or all it asked for when `None` (a refusal waits 5 ms).
    fn acquire_answered(
        p: &mut KeyPolicy,
        rule: &Rule,
        cell: &Cell,
        at_ns: u64,
        granted: Option<u64>,
        scale_ppm: u64,
    ) {
        let lease = &cell.lease;
        let cfg = PolicyConfig::default();
        let want = p.acquire(rule, &cfg, at_ns, lease, 0, 1).want;
        let granted = granted.unwrap_or(want);
        let reply = Reply {
            granted,
            ttl_us: 2_000_000,
            retry_us: if granted == 0 { 5_000 } else { 0 },
            scale_ppm,
            ..Reply::default()
        };
        p.granted(
            rule,
            &cfg,
            cell,
            &Refill::new(),
            at_ns,
            at_ns + 1_000,
            1,
            &reply,
            false,
        );
    }

    /// The decision (1 token) at which a cold key used 1 000 times a second turns hot,
    /// its exact calls carrying `call_keys` keys.
    fn promoted_at(call_keys: u64) -> Option<u64> {
        let rule = Rule::new("r", 1000, "1000/s").unwrap();
        let cfg = PolicyConfig::default();
        let mut p = KeyPolicy::new(1);
        (1..=1000).find(|&i| p.exact_done(&rule, &cfg, i * 1_000_000, 1, true, call_keys, false))
    }

    #[test]
    fn a_key_in_full_batches_leases_later_than_a_key_alone_in_its_calls() {
        // hot_above_per_sec 20: alone, past 20 tokens in its second.
        assert_eq!(promote_above(20, 1), 20);
        assert_eq!(promote_above(20, 0), 20);
        assert_eq!(promoted_at(1), Some(21));
        // 14 keys a call: an exact decision costs the store (27 + 10) / (27 / 14 + 10) =
        // 3.1x less, so a lease must be worth 3.1x more decisions.
        assert_eq!(promote_above(20, 14), 62);
        assert_eq!(promoted_at(14), Some(63));
        // No more than (27 + 10) / 10 = 3.7x however full, and no overflow.
        assert_eq!(promote_above(20, 1_000_000), 73);
        assert_eq!(promote_above(u64::MAX, 128), u64::MAX);
        // Other agents leasing it promotes it at once, whatever the calls carry.
        let rule = Rule::new("r", 1000, "1000/s").unwrap();
        let mut p = KeyPolicy::new(1);
        assert!(p.exact_done(&rule, &PolicyConfig::default(), 1, 1, true, 128, true));
    }

    #[test]
    fn a_short_grant_on_a_contended_key_paces_the_next_prefetch() {
        let rule = Rule::new("r", 1000, "100/s").unwrap();
        let cfg = PolicyConfig::default();
        let cell = Cell::new();
        let lease = &cell.lease;
        let mut p = KeyPolicy::new(1);
        let answer = |p: &mut KeyPolicy, at: u64, granted: u64, scale_ppm: u64| {
            // 1 000 tokens a second offered, all denied here.
            let want = p.acquire(&rule, &cfg, at, lease, at / 1_000_000, 0).want;
            assert!(at < 1_000_000_000 || want > 1, "demand measured");
            let reply = Reply {
                granted: granted.min(want),
                ttl_us: 2_000_000,
                retry_us: if granted == 0 { 1_000 } else { 0 },
                scale_ppm,
                ..Reply::default()
            };
            p.granted(
                &rule,
                &cfg,
                &cell,
                &Refill::new(),
                at,
                at + 1_000,
                0,
                &reply,
                false,
            )
        };
        answer(&mut p, 1_000, 100, 1_000_000);
        let g = answer(&mut p, 1_000_000_000, u64::MAX, 1_000_000);
        assert_eq!(g.prefetch_after_ns, None, "a full grant");
        // Short and not contended: the store's time alone (none for a grant).
        let g = answer(&mut p, 1_100_000_000, 1, 1_000_000);
        assert_eq!(g.prefetch_after_ns, None, "short, not contended");
        // Short and contended: the next prefetch waits for a quarter of the lease at
        // the agent's share, at most a horizon.
        let now = 1_200_001_000;
        let g = answer(&mut p, 1_200_000_000, 1, 100_000);
        let after = g.prefetch_after_ns.expect("paced");
        assert!(
            after > now && after <= now + cfg.horizon.as_nanos() as u64,
            "{after}"
        );
        // Refused and contended: the later of the store's time and the pace.
        let g = answer(&mut p, 1_300_000_000, 0, 100_000);
        let after = g.prefetch_after_ns.expect("paced");
        assert!(after > 1_300_001_000 + 1_000_000, "{after}");
    }

    #[test]
    fn a_short_grant_denies_callers_at_once_for_a_while() {
        let rule = Rule::new("r", 1000, "100/s").unwrap();
        let lease = Cell::new();
        let mut p = KeyPolicy::new(1);
        assert_eq!(p.deny_while_refilling_until(), 0, "nothing asked yet");
        // Granted what it asked: the bucket is not dry.
        let contended = 500_000;
        acquire_answered(&mut p, &rule, &lease, 1_000, None, contended);
        assert_eq!(p.deny_while_refilling_until(), 0, "a full grant");
        // Refused under the limit (the store's shares at one): callers wait, as the
        // tokens may be in other agents' leases.
        acquire_answered(&mut p, &rule, &lease, 5_000_000, Some(0), 1_000_000);
        assert_eq!(p.deny_while_refilling_until(), 0, "dry, not contended");
        // Refused, contended: callers are denied at once for DRY_FOR_NS from the reply.
        acquire_answered(&mut p, &rule, &lease, 10_000_000, Some(0), contended);
        assert_eq!(p.deny_while_refilling_until(), 10_001_000 + DRY_FOR_NS);
        // A later full grant leaves the window where the last short one put it.
        acquire_answered(&mut p, &rule, &lease, 20_000_000, None, contended);
        assert_eq!(p.deny_while_refilling_until(), 10_001_000 + DRY_FOR_NS);
        // A bucket that moved (a split's parent) leases nothing: no window.
        let moved = Reply {
            moved: true,
            ..Reply::default()
        };
        p.granted(
            &rule,
            &PolicyConfig::default(),
            &lease,
            &Refill::new(),
            30_000_000,
            30_001_000,
            1,
            &moved,
            false,
        );
        assert_eq!(p.deny_while_refilling_until(), 0, "moved");
    }

    #[test]
    fn on_a_dry_bucket_the_prefetch_waits_for_two_round_trips_of_demand() {
        let mut p = KeyPolicy {
            last_want: 40,
            demand_milli: 100_000, // 100 tokens/s
            ..KeyPolicy::default()
        };
        let ms = 1_000_000;
        // A bucket with tokens: half the lease, or what the caller needs.
        assert_eq!(p.low_water(5 * ms, ms, 1), 20);
        assert_eq!(p.low_water(5 * ms, ms, 30), 30);
        // Dry but not contended (the tokens may be in other agents' leases): half.
        p.dry_at_ns = 5 * ms;
        assert_eq!(p.low_water(5 * ms, ms, 1), 20);
        // Dry and contended (or the agent alone over the rate): two round trips of demand,
        // at least one token, at most half the lease.
        p.over_rate = true;
        assert_eq!(p.low_water(5 * ms, ms, 1), 1, "alone over the rate");
        p.over_rate = false;
        p.scale_ppm = 500_000;
        assert_eq!(p.low_water(5 * ms, ms, 1), 1, "0.2 tokens, rounded up");
        assert_eq!(p.low_water(5 * ms, 50 * ms, 1), 10);
        assert_eq!(p.low_water(5 * ms, 500 * ms, 1), 20);
        assert_eq!(p.low_water(5 * ms, ms, 7), 7);
        // The window past: half again.
        assert_eq!(p.low_water(5 * ms + DRY_FOR_NS, ms, 1), 20);
    }
}
