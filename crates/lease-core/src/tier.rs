//! A tier: one rate lease held by an intermediary (a `leasehold serve` instance) and
//! handed on to its clients as token buckets they enforce themselves — Envoy's rate limit
//! quota filter (RLQS): an assignment is `max_tokens`, a fill rate and a time to live; a
//! client's bucket starts full when the assignment is new, and keeps its tokens when an
//! assignment of the same strategy extends it. Sans-io: the server sends the [`Op`] this
//! gives, hands back the reply, and pushes the assignments it returns.
//!
//! **The bound.** To the store a tier is one agent of a rate lease (see
//! [`crate::rate_lease`]): a burst `b` and a share `q` until its deadline. What its clients
//! can admit is kept within what such an agent can: the tokens in hand — the tier's
//! reserve `R` plus every client's bucket (at most its `max_tokens`) — never exceed `b`,
//! and the rates handed out never exceed `q`:
//! - a new bucket starts full: its `max_tokens` come out of `R`;
//! - `R` refills at `q` less the committed rates (a client's committed rate is the larger
//!   of its assignment's and, until that one's end, the one it replaced: the client may not
//!   have applied the new one yet), and never past `b` less the committed buckets;
//! - an assignment ends before the tier's deadline, and at most [`OVERHANG_NS`] after its
//!   next renewal; a renewal may come back with a smaller share (the store sizes it, and
//!   moves it to other agents), and until the assignments are replaced or end their rates
//!   above it are paid from `R`. So before it hands out an assignment the tier keeps in `R`
//!   what the committed rates can spend past the next renewal, were the share to drop to
//!   nothing: `Σ rate × (end − next renewal)`.
//!
//! A client's assignment runs from its receipt: the bound holds while a push takes at most
//! [`PUSH_MARGIN_NS`] (assignments are accounted as ending that much later), and clocks
//! run at the same rate within [`crate::rate_lease::RATE_MARGIN_PPM`]. A client that
//! keeps an expired assignment (Envoy's `reuse_last_assignment`) is outside the bound.
//!
//! **Sizing.** The tier reports the sum of its clients' demands (smoothed over their
//! reports, a significant rise counting at once), or the rates it has committed if more,
//! and renews at a third of its term; the store sizes its share as any agent's. The share
//! is divided by demand, no client's part more than the store's headroom over its demand;
//! while `R` holds less than the share's overhang a thirty-second of the share refills
//! it. A client's bucket holds half a second of its rate while the burst has room (down
//! to 50 ms). An assignment is extended unchanged while its rate is within a third over
//! or a quarter under the client's part (a new one costs a bucket, and reports are
//! noisy), and replaced otherwise; the replacements of a fall share what `R` can fund
//! (smaller buckets rather than none for some), and increases wait for rate that no
//! commitment holds.
//!
//! On the virtual clock (`tests/tier.rs`: clients as Envoy's filter, Poisson arrivals,
//! pushes up to the margin late): 64 clients on one tier at 1.2x r use 0.97 of r with
//! 7.5 store calls a second; three tiers 0.97; a tier killed mid-run, its clients moving
//! to another, 0.97; with a taker emptying the level beside them, every window within
//! `B + r·W`.

use std::collections::BTreeMap;

use crate::model::{Op, RATE_HEADROOM, Reply, rate_scale};
use crate::rate_lease::{RATE_MARGIN_PPM, RateGrant};
use crate::rule::BucketParams;

/// The longest a push to a client may take for the bound to hold (ns).
pub const PUSH_MARGIN_NS: u64 = 50_000_000;

/// The longest an assignment runs past the tier's next renewal (ns).
pub const OVERHANG_NS: u64 = 200_000_000;

/// A client's bucket holds this long of its rate (ns), one token at least, while the
/// tier's burst has room for it beside the overhang; as little as [`MIN_BUCKET_NS`].
const BUCKET_NS: u64 = 500_000_000;

/// The least a client's bucket holds of its rate (ns).
const MIN_BUCKET_NS: u64 = 50_000_000;

/// The fewest tokens a client's bucket holds: a bucket of one token refills only between
/// requests, and a client a little faster than its rate got 60% of it.
const MIN_BUCKET: u64 = 2;

/// A tier renews its lease this far into its term (per mille): its assignments must end
/// before the term does, and a renewal refreshes them.
const RENEW_PERMILLE: u64 = 333;

/// The agent's margin on its deadline (ns), as for a rate lease.
const DEADLINE_MARGIN_NS: u64 = 50_000_000;

/// A client's demand, smoothed over its reports: how much less an older report weighs
/// (per mille).
const DEMAND_WEIGHT: u64 = 250;

/// A client's last report counts alone when this much over its smoothed demand, and by
/// more than four standard deviations of Poisson arrivals: a rise, not noise (the larger
/// of the two: noise upwards moved the parts, and replacing buckets cost the rate).
const RISE: f64 = 1.25;

/// A report counts as covering this long at least (ns): Envoy's shortest reporting
/// interval.
const MIN_REPORT_NS: u64 = 100_000_000;

/// A client's demand is known once its reports cover this long (ns); until then it counts
/// as wanting at least an equal part of the key's rate. Its first report comes with its
/// first request and covers nothing: sized on it, a new bucket got a few requests a
/// second for its first reporting interval, and refused the rest under `DENY_ALL`.
const KNOWN_AFTER_NS: f64 = 1e9;

/// The reserve is topped up to this much of the share beyond the overhang (ns): held at
/// the overhang exactly, a share a little smaller at a renewal left it short, and no
/// assignment could be extended (0.8x r: a quarter of the rate refused for a second).
const RESERVE_SPARE_NS: u64 = 100_000_000;

/// An assignment is extended while its rate is at least this much of the client's part
/// (and at most a third over it): a new one costs a bucket, and reports are noisy. (At
/// three quarters, a client whose demand rose ran a quarter under what it was due.)
const KEEP_UNDER: f64 = 0.75;

/// A tier's first call waits this long after its first client (ns).
const GATHER_NS: u64 = 20_000_000;

/// A client's token bucket, as the server sends it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Strategy {
    /// The bucket's capacity; a new bucket starts full.
    pub max_tokens: u64,
    /// Tokens added every `fill_interval_ns`.
    pub tokens_per_fill: u32,
    /// The fill interval (ns).
    pub fill_interval_ns: u64,
}

impl Strategy {
    /// Tokens a second it fills.
    pub fn rate(&self) -> f64 {
        f64::from(self.tokens_per_fill) * 1e9 / self.fill_interval_ns as f64
    }

    /// The strategy that fills at most `per_sec` tokens a second, with a bucket of
    /// `bucket_ns` of it ([`MIN_BUCKET`] tokens at least); `None` under one token a
    /// minute.
    fn at_most(per_sec: f64, bucket_ns: u64) -> Option<Self> {
        if per_sec < 1.0 / 60.0 {
            return None;
        }
        // A few tokens per fill above 1 000/s, so the interval stays a millisecond or more.
        let tokens_per_fill = (per_sec / 1_000.0).floor().clamp(1.0, f64::from(u32::MAX)) as u32;
        let fill_interval_ns = (f64::from(tokens_per_fill) * 1e9 / per_sec).ceil() as u64;
        let mut s = Self {
            max_tokens: 1,
            tokens_per_fill,
            fill_interval_ns,
        };
        s.max_tokens = ((s.rate() * bucket_ns as f64 / 1e9).floor() as u64).max(MIN_BUCKET);
        Some(s)
    }
}

/// How a client's assignment changes at a renewal, in the order they are made.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Step {
    Down,
    Keep,
    /// A client with nothing running.
    Start,
    Up,
}

/// What to push to a client.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Assignment {
    /// The client.
    pub client: u64,
    /// Its bucket.
    pub strategy: Strategy,
    /// Its time to live, from the push (ns).
    pub ttl_ns: u64,
    /// Whether it replaces the client's bucket (a new one, full) rather than extending it.
    pub new: bool,
}

#[derive(Clone, Copy, Debug)]
struct Given {
    strategy: Strategy,
    /// When it ends, as accounted (tier clock, ns): its time to live from the push plus
    /// [`PUSH_MARGIN_NS`].
    until_ns: u64,
}

#[derive(Clone, Debug, Default)]
struct Client {
    /// Requests reported and the time their reports cover, older reports weighing less:
    /// its demand is one over the other ([`Client::demand`]).
    requests: f64,
    covered_ns: f64,
    /// The last report: requests, and the seconds it covers if at least
    /// [`MIN_REPORT_NS`]. A rise counts at once ([`RISE`]; smoothed, a client three times
    /// busier was held to its old part for seconds).
    last: (f64, f64),
    /// Its assignments that may still run, the last pushed last: a client applies one at a
    /// time, but which of them it holds is not known.
    given: Vec<Given>,
    /// The client went away: it gets nothing more; its assignments count until they end.
    gone: bool,
}

impl Client {
    /// Its demand, tokens a second.
    fn demand(&self) -> f64 {
        if self.covered_ns > 0.0 {
            let smoothed = self.requests * 1e9 / self.covered_ns;
            let (n, secs) = self.last;
            let expected = smoothed * secs;
            if secs > 0.0 && n > expected * RISE && n > expected + 4.0 * expected.sqrt() {
                n / secs
            } else {
                smoothed
            }
        } else {
            0.0
        }
    }

    /// The last assignment pushed, if a push sent at `now_ns` surely reaches the client
    /// while it still runs (an extension of one that ended would be a new bucket).
    fn current(&self, now_ns: u64) -> Option<Strategy> {
        self.given
            .last()
            .filter(|g| g.until_ns > now_ns + 2 * PUSH_MARGIN_NS)
            .map(|g| g.strategy)
    }

    /// Its committed rate and bucket at `now_ns`: the largest of its assignments that may
    /// still run.
    fn committed(&self, now_ns: u64) -> (f64, u64) {
        self.given
            .iter()
            .filter(|g| g.until_ns > now_ns)
            .fold((0.0, 0), |(r, m), g| {
                (r.max(g.strategy.rate()), m.max(g.strategy.max_tokens))
            })
    }

    /// The most its assignments can spend after `at_ns` (tokens): at each moment, at the
    /// largest rate of those still running. (The largest rate until the latest end read
    /// a replaced assignment's rate as running as long as its replacement: the reserve
    /// looked short, and half the extensions after a fall in demand were refused.)
    fn spend_after(&self, at_ns: u64) -> f64 {
        let mut spend = 0.0;
        let mut from = at_ns;
        let mut ends: Vec<u64> = self.given.iter().map(|g| g.until_ns).collect();
        ends.sort_unstable();
        for end in ends {
            if end <= from {
                continue;
            }
            let rate = (self.given.iter())
                .filter(|g| g.until_ns >= end)
                .map(|g| g.strategy.rate())
                .fold(0.0, f64::max);
            spend += rate * (end - from) as f64 / 1e9;
            from = end;
        }
        spend
    }
}

/// One key's lease as a tier holds it (see the module).
#[derive(Clone, Debug, Default)]
pub struct Tier {
    /// The share, tokens a second (less the clock margin).
    share: f64,
    burst: u64,
    deadline_ns: u64,
    renew_at_ns: u64,
    inflight: Option<(u64, u64)>,
    /// Tokens in hand outside the clients' buckets.
    reserve: f64,
    reserve_at_ns: u64,
    clients: BTreeMap<u64, Client>,
    /// The key's rate shared equally by the live clients (tokens a second): what a client
    /// whose reports do not yet cover [`KNOWN_AFTER_NS`] counts as wanting at least.
    fair: f64,
}

impl Tier {
    /// A tier with no lease and no clients.
    pub fn new() -> Self {
        Self::default()
    }

    /// Takes a client's report: `allowed` and `denied` requests over `elapsed_ns` (the
    /// first report of a client subscribes it). Its demand is the requests over the time
    /// its reports cover, the older ones weighing less ([`DEMAND_WEIGHT`]), a report
    /// covering at least [`MIN_REPORT_NS`]: a first report sent with a bucket's first
    /// request covers microseconds, and one request in them is no rate.
    pub fn report(&mut self, client: u64, allowed: u64, denied: u64, elapsed_ns: u64, now_ns: u64) {
        // A tier with no lease calls a little after its first client: clients that start
        // together subscribe within it, and the first split sees them all (sized on one,
        // a first client's bucket held the whole rate, and the others waited for it).
        if self.renew_at_ns == 0 && self.inflight.is_none() && self.burst == 0 {
            self.renew_at_ns = now_ns + GATHER_NS;
        }
        let c = self.clients.entry(client).or_default();
        c.gone = false;
        let keep = 1.0 - DEMAND_WEIGHT as f64 / 1_000.0;
        c.requests = c.requests * keep + (allowed + denied) as f64;
        c.covered_ns = c.covered_ns * keep + elapsed_ns as f64;
        c.last = if elapsed_ns >= MIN_REPORT_NS {
            ((allowed + denied) as f64, elapsed_ns as f64 / 1e9)
        } else {
            (0.0, 0.0)
        };
    }

    /// The client went away (its stream ended): its assignments count until they end.
    pub fn gone(&mut self, client: u64) {
        if let Some(c) = self.clients.get_mut(&client) {
            c.gone = true;
            c.requests = 0.0;
            c.covered_ns = 0.0;
        }
    }

    /// Whether no client holds anything at `now_ns`: none is known but those gone whose
    /// assignments have all ended (forgotten here).
    pub fn idle(&mut self, now_ns: u64) -> bool {
        self.settle(now_ns);
        self.clients.is_empty()
    }

    /// Tokens in hand outside the clients' buckets (never below 0 while the bound holds).
    pub fn reserve(&self) -> f64 {
        self.reserve
    }

    /// A client's demand as the tier sizes its part: reported, or while too little is
    /// reported, at least an equal part of the key's rate.
    fn demand_of(&self, c: &Client) -> f64 {
        if c.gone {
            0.0
        } else if c.covered_ns < KNOWN_AFTER_NS {
            let reported = if c.covered_ns >= MIN_REPORT_NS as f64 {
                c.demand()
            } else {
                0.0
            };
            reported.max(self.fair)
        } else {
            c.demand()
        }
    }

    /// The sum of the clients' demands, thousandths of a token a second.
    pub fn demand_milli(&self) -> u64 {
        let d: f64 = self.clients.values().map(|c| self.demand_of(c)).sum();
        (d * 1_000.0) as u64
    }

    /// Whether to call the store at `now_ns`: no call in flight, a client with demand,
    /// and the lease due for renewal (or none yet).
    pub fn due(&self, now_ns: u64) -> bool {
        self.inflight.is_none()
            && self
                .clients
                .values()
                .any(|c| !c.gone && (c.demand() > 0.0 || c.covered_ns < KNOWN_AFTER_NS))
            && now_ns >= self.renew_at_ns
    }

    /// When the lease is next due (tier clock, ns).
    pub fn renew_at_ns(&self) -> u64 {
        self.renew_at_ns
    }

    /// The committed rates and buckets at `now_ns`.
    fn committed(&self, now_ns: u64) -> (f64, u64) {
        self.clients.values().fold((0.0, 0), |(r, m), c| {
            let (cr, cm) = c.committed(now_ns);
            (r + cr, m + cm)
        })
    }

    /// What the reserve must hold at `now_ns` for the bound to hold whatever the next
    /// renewal brings: the committed rates above the share until the renewal, and all of
    /// them past it, until they end.
    fn needed(&self, now_ns: u64) -> f64 {
        let mut over = 0.0;
        let mut past = 0.0;
        for c in self.clients.values() {
            over += c.committed(now_ns).0;
            past += c.spend_after(self.renew_at_ns.max(now_ns));
        }
        let to_renewal = self.renew_at_ns.saturating_sub(now_ns) as f64 / 1e9;
        (over - self.share).max(0.0) * to_renewal + past
    }

    /// Brings the reserve to `now_ns`: it refills at the share less the committed rates
    /// (while no call is in flight, before the deadline), up to the burst less the
    /// committed buckets; committed rates above the share drain it.
    fn settle(&mut self, now_ns: u64) {
        if now_ns <= self.reserve_at_ns {
            return;
        }
        // Piece by piece between the ends of assignments: the committed rates fall as
        // they end.
        let until = now_ns.min(self.deadline_ns);
        let mut ends: Vec<u64> = (self.clients.values())
            .flat_map(|c| c.given.iter().map(|g| g.until_ns))
            .filter(|&u| u > self.reserve_at_ns && u < until)
            .collect();
        ends.sort_unstable();
        ends.push(until);
        let mut at = self.reserve_at_ns;
        for end in ends {
            if end <= at {
                continue;
            }
            let (rate, buckets) = self.committed(at);
            let spare = self.share - rate;
            if spare < 0.0 || self.inflight.is_none() {
                self.reserve += spare * (end - at) as f64 / 1e9;
            }
            self.reserve = self.reserve.min(self.burst.saturating_sub(buckets) as f64);
            at = end;
        }
        let (_, buckets) = self.committed(now_ns);
        self.reserve = self.reserve.min(self.burst.saturating_sub(buckets) as f64);
        self.reserve_at_ns = now_ns;
        for c in self.clients.values_mut() {
            c.given.retain(|g| g.until_ns > now_ns);
        }
        self.clients.retain(|_, c| !c.gone || !c.given.is_empty());
    }

    /// The call to send at `now_ns`: the burst held (declared full: the clients' buckets
    /// are not known; shrunk towards what is wanted), the burst wanted (what the reserve
    /// should hold plus the clients' buckets: 0.8 s of demand, two tokens a client at
    /// least), and the clients' demand.
    pub fn call(&mut self, p: &BucketParams, now_ns: u64) -> Op {
        self.settle(now_ns);
        let live = self.clients.values().filter(|c| !c.gone).count() as u64;
        self.fair = p.rate.per_sec_f64() / live.max(1) as f64;
        // It asks for the rates it has committed while they run, if more than its clients
        // want: a share sized on a fall in demand came back below the assignments still
        // running, they drained the reserve, and their replacements and extensions were
        // refused (0.3x r: a tenth of the rate admitted for a quarter second). Its parts
        // are sized on demand ([`Tier::assign`]), so the commitments follow it down.
        let (committed, _) = self.committed(now_ns);
        let demand = self.demand_milli().max((committed * 1_000.0) as u64);
        // The burst is sized on the rate the tier may hand out: the demand, but no more
        // than its share grows at a renewal once it has one. (Sized on the demand, three
        // tiers whose clients were not known yet each asked for 0.8 s of the key's whole
        // rate: the first one's burst held most of B, and the others got no burst, so no
        // share, for a second.)
        let mut basis = demand as f64 / 1e3;
        if self.share > 0.0 {
            basis = basis.min(self.share * RATE_HEADROOM);
        }
        let overhang = basis * OVERHANG_NS as f64 / 1e9;
        let want = ((basis * (BUCKET_NS + OVERHANG_NS + RESERVE_SPARE_NS) as f64 / 1e9)
            .max(overhang + (MIN_BUCKET * live) as f64)
            .ceil() as u64)
            .clamp(1, p.capacity);
        // A burst larger than wanted shrinks to it, but never below what may be in hand:
        // the reserve and the committed buckets (the reserve past it is dropped).
        let (_, buckets) = self.committed(now_ns);
        let floor = self.reserve.max(0.0).ceil() as u64 + buckets;
        let held = self.burst.min(want.max(floor));
        if held < self.burst {
            self.reserve = self.reserve.min(held.saturating_sub(buckets) as f64);
            self.burst = held;
        }
        self.inflight = Some((now_ns, held));
        Op::Rate {
            held,
            want: want.max(held),
            tokens: held,
            demand,
        }
    }

    /// The assignment just made for `client` did not go out (its stream is gone or full):
    /// it is not counted as running, so the client's next one is a new bucket (what it
    /// cost stays spent).
    pub fn undelivered(&mut self, client: u64) {
        if let Some(c) = self.clients.get_mut(&client) {
            c.given.pop();
        }
    }

    /// Once no client holds anything (every assignment ended) and no call is in flight:
    /// the release of the lease, giving back the reserve, so other agents get the share at
    /// once rather than when the record drops. The tier starts over after it.
    pub fn release(&mut self, now_ns: u64) -> Option<Op> {
        self.settle(now_ns);
        if self.inflight.is_some() || !self.clients.is_empty() || self.burst == 0 {
            return None;
        }
        let returned = (self.reserve.max(0.0).floor() as u64).min(self.burst);
        *self = Self::default();
        Some(Op::Release { returned })
    }

    /// The call in flight got no reply: asked again at the next [`Tier::due`].
    pub fn failed(&mut self) {
        self.inflight = None;
    }

    /// The reply to the call in flight, read at `now_ns`: the new lease, and the
    /// assignments to push (extensions and new buckets).
    pub fn granted(&mut self, p: &BucketParams, reply: &Reply, now_ns: u64) -> Vec<Assignment> {
        let Some((sent_ns, held)) = self.inflight else {
            return Vec::new();
        };
        self.settle(now_ns);
        self.inflight = None;
        let g = RateGrant::of(reply, held);
        let unit = p.rate.period_us() as f64 * rate_scale(p).max(1) as f64 / 1e6;
        let share = g.share as f64 / unit * (1.0 - RATE_MARGIN_PPM as f64 / 1e6);
        // The rates committed above the new share since the store took the call drained
        // the reserve (counted from the call's sending, before the store took it).
        let (rate, _) = self.committed(now_ns);
        if rate > share {
            self.reserve -= (rate - share) * now_ns.saturating_sub(sent_ns) as f64 / 1e9;
        }
        self.share = share;
        self.burst = g.burst;
        self.reserve += g.paid as f64;
        let term_ns = g.ttl_us * 1_000;
        self.deadline_ns = sent_ns + term_ns - DEADLINE_MARGIN_NS.min(term_ns / 4);
        self.renew_at_ns = sent_ns + term_ns * RENEW_PERMILLE / 1_000;
        self.assign(now_ns)
    }

    fn assign(&mut self, now_ns: u64) -> Vec<Assignment> {
        let ends =
            (self.deadline_ns.saturating_sub(PUSH_MARGIN_NS)).min(self.renew_at_ns + OVERHANG_NS);
        let Some(ttl_ns) = ends
            .checked_sub(PUSH_MARGIN_NS)
            .and_then(|u| u.checked_sub(now_ns))
            .filter(|&t| t > 0)
        else {
            return Vec::new();
        };
        let demand: f64 = (self.clients.values())
            .filter(|c| !c.gone)
            .map(|c| self.demand_of(c))
            .sum();
        if demand <= 0.0 || self.share <= 0.0 {
            return Vec::new();
        }
        // A thirty-second of the share refills the reserve while it holds less than the
        // share's overhang past a renewal and a spare.
        let wanted = self.share * (OVERHANG_NS + RESERVE_SPARE_NS) as f64 / 1e9;
        let give = if self.reserve < wanted {
            self.share * (1.0 - 1.0 / 32.0)
        } else {
            self.share
        };
        // The buckets share what the burst holds beside the overhang.
        let room = self.burst as f64 - self.share * OVERHANG_NS as f64 / 1e9;
        let bucket_ns = ((room / self.share * 1e9) as u64).clamp(MIN_BUCKET_NS, BUCKET_NS);
        // Each client's part by demand. Its assignment is extended while within a third
        // over or a quarter under its part (a new one costs a bucket, and reports are
        // noisy), else replaced; then, while the assignments add up to more than the
        // share, the one furthest over its part is brought down to it. Decreases go
        // first, extensions next, increases last, each only while the reserve covers what
        // the commitments need (increases also only while the committed rates stay
        // within the share; a decrease's replaced assignment counts until it ends).
        let mut plan: Vec<(Step, u64, Strategy, f64)> = Vec::new();
        for (&id, c) in &self.clients {
            if c.gone {
                continue;
            }
            let wants = self.demand_of(c);
            let part = (give * wants / demand).min(wants * RATE_HEADROOM);
            let Some(fresh) = Strategy::at_most(part, bucket_ns) else {
                continue;
            };
            match c.current(now_ns) {
                Some(s) if s.rate() <= part * 4.0 / 3.0 && s.rate() >= part * KEEP_UNDER => {
                    plan.push((Step::Keep, id, s, part));
                }
                Some(s) if fresh.rate() < s.rate() => plan.push((Step::Down, id, fresh, part)),
                Some(_) => plan.push((Step::Up, id, fresh, part)),
                None => plan.push((Step::Start, id, fresh, part)),
            }
        }
        let mut total: f64 = plan.iter().map(|e| e.2.rate()).sum();
        while total > self.share {
            let Some(e) = plan
                .iter_mut()
                .filter(|e| e.0 == Step::Keep && e.2.rate() > e.3)
                .max_by(|a, b| (a.2.rate() / a.3).total_cmp(&(b.2.rate() / b.3)))
            else {
                break;
            };
            let Some(fresh) = Strategy::at_most(e.3, bucket_ns) else {
                break;
            };
            total -= e.2.rate() - fresh.rate();
            *e = (Step::Down, e.1, fresh, e.3);
        }
        plan.sort_by_key(|e| e.0);
        // New buckets come out of the reserve beside what the commitments need: when it
        // cannot give a full one to every replacement of a fall and every client with
        // nothing running, each of those gets the same fraction of its own (at least
        // MIN_BUCKET_NS of its rate). Given full, the first half of the clients whose part
        // fell got theirs and the others none (their assignments ran out: a quarter of the
        // rate refused for a second), and a tier whose burst was not paid started its
        // clients two or three a renewal. (Increases of running assignments wait for a
        // full bucket: scaled too, they held less than the reserve dropped.)
        for &(_, id, strategy, _) in &plan {
            if let Some(c) = self.clients.get_mut(&id) {
                c.given.push(Given {
                    strategy,
                    until_ns: ends,
                });
            }
        }
        let spare = self.reserve - self.needed(now_ns);
        for &(_, id, ..) in &plan {
            if let Some(c) = self.clients.get_mut(&id) {
                c.given.pop();
            }
        }
        // Starts share while most clients have nothing running (a tier starting, or
        // after its share fell): else one at a time, full (scaled in steady state too,
        // a bucket kept short overflowed between requests, and its client used less
        // than its rate).
        let starts = plan.iter().filter(|e| e.0 == Step::Start).count();
        let starting = starts * 2 > plan.len();
        let shared =
            |e: &(Step, u64, Strategy, f64)| e.0 == Step::Down || (starting && e.0 == Step::Start);
        let full: f64 = (plan.iter())
            .filter(|e| shared(e))
            .map(|e| e.2.max_tokens as f64)
            .sum();
        if full > spare {
            let scale = (spare / full).max(0.0);
            for e in plan.iter_mut().filter(|e| shared(e)) {
                // A start half its bucket at least.
                let least = if e.0 == Step::Start {
                    e.2.max_tokens / 2
                } else {
                    (e.2.rate() * MIN_BUCKET_NS as f64 / 1e9).ceil() as u64
                };
                e.2.max_tokens = ((e.2.max_tokens as f64 * scale).floor() as u64)
                    .max(least)
                    .max(MIN_BUCKET)
                    .min(e.2.max_tokens);
            }
        }
        let mut out = Vec::new();
        for (step, id, strategy, _) in plan {
            let (up, new) = (matches!(step, Step::Start | Step::Up), step != Step::Keep);
            let cost = if new { strategy.max_tokens as f64 } else { 0.0 };
            let Some(c) = self.clients.get_mut(&id) else {
                continue;
            };
            c.given.push(Given {
                strategy,
                until_ns: ends,
            });
            let (rate, _) = self.committed(now_ns);
            let fits = (!up || rate <= self.share) && self.reserve - cost >= self.needed(now_ns);
            if fits {
                self.reserve -= cost;
                out.push(Assignment {
                    client: id,
                    strategy,
                    ttl_ns,
                    new,
                });
            } else if let Some(c) = self.clients.get_mut(&id) {
                c.given.pop();
            }
        }
        out
    }
}
