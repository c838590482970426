//! Rate leases: an agent is granted a share of a bucket's *rate*, and a burst, for a term,
//! and spends them locally (a token bucket per key); it calls the store once a term, or
//! when its demand changes, whatever its volume, instead of once per batch of tokens.
//! The store's side is [`crate::model`]'s `Op::Rate` (the Lua's twin); this module is the
//! agent's: its local bucket ([`LocalRate`]) and when it calls ([`RatePolicy`]).
//!
//! **The bound (I1 for rate leases).** The bucket refills at `r − S`, `S` the sum of the
//! live leases' shares (`1/scale`-ths of a token per rate period, so `S ≤ r` holds
//! exactly), up to `B` minus what is outstanding, each lease's burst counting as
//! outstanding (as leased tokens do). A burst grows only by tokens taken from the level;
//! the agent's local bucket holds at most its burst and refills at its share. So the tokens
//! that exist — the level plus every local bucket — never exceed `B`, and flow in at `r`
//! at most (`r − S` to the level, `q_i` to each local bucket): in any window `W` at most
//! `B + r·W` are admitted, by the rate leases and by everything else the level serves
//! (exact decisions, token leases) together. A share counts in `S` until its record drops
//! (the term and a grace after the grant), which the agent's own deadline precedes (as
//! I4: measured from the moment the request was sent, less a margin); a share given up
//! early (a release) is dropped at once, what the local bucket held coming back. The agent
//! spends its share a little slower than granted ([`RATE_MARGIN_PPM`]) so that its clock
//! running fast by as much cannot make it spend more than `q_i` by the store's clock.
//!
//! A local bucket holds at most its burst, so a share comes with a burst of one token at
//! least: when the level is empty, a bucket of capacity 1 that starts empty and fills from
//! the share (the level's cap falls by it). The bursts never exceed `B`: at most `B`
//! agents hold a share of one key at once.
//!
//! **Shares.** Every record keeps the agent's demand (a rate lease's counts until its
//! record drops). A grant is the agent's demand with a quarter of headroom, or its
//! proportional part of `r` (`r · d / Σd`) when that is less — the parts of the live
//! demands never sum over `r`; never more
//! than the other live shares leave (the reply says so, and the agent asks again a window
//! later). A burst is at most its fair part of `B` (the agent's demand's part of the
//! demands, one token at least): one above it shrinks at the agent's next call, so agents
//! that came after the bursts filled `B` get one, and with it a share. It never shrinks
//! below what the agent may still hold (the whole tokens it declared, and a fraction: its
//! bucket refills nothing while the call is out), so what is outstanding still counts all
//! it can spend. An agent whose demand grows gets its part within one term: every other agent
//! renews within a term, to its own part of the new total.

use crate::cell::{Cell, Refill};
use crate::model::{Op, Reply, rate_scale};
use crate::rate::Rate;
use crate::rule::BucketParams;

/// Parts per million.
pub const PPM: u64 = 1_000_000;

/// The rate an agent spends below its share, parts per million: covers its clock running
/// faster than the store's by up to this much.
pub const RATE_MARGIN_PPM: u64 = 1_000;

/// What the store granted for a term: the reply to `Op::Rate`, read as what it carries.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RateGrant {
    /// The agent's share of the bucket's rate, `1/scale`-ths of a token per rate period
    /// ([`rate_scale`]).
    pub share: u64,
    /// Tokens the agent's local bucket may hold: what it may spend at once.
    pub burst: u64,
    /// Tokens of it this grant took from the level, which the agent adds to its local
    /// bucket (the rest fills from its share).
    pub paid: u64,
    /// The term, µs from the store's time of the grant.
    pub ttl_us: u64,
    /// The share is less than the agent's part because other agents' shares still hold
    /// the rest: asking again soon gets more, as they renew to their parts.
    pub limited: bool,
    /// Whole tokens the bucket's level held after the grant: what exact decisions, and
    /// this agent's local bucket when it runs dry, may still take.
    pub level: u64,
}

impl RateGrant {
    /// The grant a reply to a rate lease carries, for a request that declared `held`.
    pub fn of(reply: &Reply, held: u64) -> Self {
        let share = if reply.moved { 0 } else { reply.scale_ppm };
        Self {
            share,
            // Without a share the burst is what was declared.
            burst: if reply.burst == 0 { held } else { reply.burst },
            paid: reply.granted,
            ttl_us: reply.ttl_us,
            limited: reply.retry_us != 0,
            level: if reply.moved { 0 } else { reply.remaining },
        }
    }
}

/// An agent's side: a local bucket of its burst, refilled at its share (a little below:
/// [`RATE_MARGIN_PPM`]), spent until its deadline (agent clock, ns). Exact: the level is
/// counted in `1 / (period_us × 1000 × scale × PPM)` tokens ([`rate_scale`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LocalRate {
    units: u128,
    at_ns: u64,
    /// Units a nanosecond brings.
    per_ns: u128,
    /// Units a token is.
    unit: u128,
    burst: u64,
    deadline_ns: u64,
    /// The share refills the bucket: not while a call is in flight (the store may be
    /// lowering it), nor past the deadline.
    accrue: bool,
}

impl LocalRate {
    /// Before a call at `now_ns` that asks for a burst of `want`: the burst to declare
    /// (`held`). A burst larger than `want` shrinks to it (what it held above is dropped).
    /// Until the reply, the share refills nothing: the store may lower it as it receives
    /// the call, and the agent learns the new one only with the reply.
    pub fn renewing(&mut self, now_ns: u64, want: u64) -> u64 {
        self.settle(now_ns);
        self.accrue = false;
        self.burst = self.burst.min(want);
        self.units = self.units.min(u128::from(self.burst) * self.unit);
        self.burst
    }

    /// Installs `g`, the reply (received at `now_ns`, agent clock) to a request sent at
    /// `sent_ns`, for a bucket of rate `p.rate`: the share refills from now, the term runs
    /// from `sent_ns`, less `margin_ns`. What the local bucket holds carries over a
    /// renewal, plus what the store took from the level for it.
    pub fn grant(
        &mut self,
        p: &BucketParams,
        g: &RateGrant,
        sent_ns: u64,
        now_ns: u64,
        margin_ns: u64,
    ) {
        self.settle(now_ns);
        self.accrue = true;
        let unit = u128::from(p.rate.period_us().max(1))
            * 1_000
            * u128::from(rate_scale(p).max(1))
            * u128::from(PPM);
        // Rescaled when the rule's rate changed: what is held stays in tokens.
        if self.unit != 0 && self.unit != unit {
            self.units = self.units / self.unit * unit;
        }
        self.unit = unit;
        self.per_ns = u128::from(g.share) * u128::from(PPM - RATE_MARGIN_PPM);
        self.units = (self.units + u128::from(g.paid) * unit).min(u128::from(g.burst) * unit);
        self.burst = g.burst;
        self.deadline_ns = sent_ns + (g.ttl_us * 1_000).saturating_sub(margin_ns);
    }

    /// Stops spending (before giving the lease up, or when the store refused it); returns
    /// the whole tokens it held, which a release gives back.
    pub fn stop(&mut self, now_ns: u64) -> u64 {
        self.settle(now_ns);
        self.deadline_ns = 0;
        let whole = self.units.checked_div(self.unit).unwrap_or(0);
        self.units = 0;
        self.burst = 0;
        u64::try_from(whole).unwrap_or(u64::MAX)
    }

    /// Brings the local bucket to `now_ns` for an agent that keeps its whole tokens
    /// elsewhere (in its key's cell, spent by many threads): `unspent` of the tokens handed
    /// out at the last sync are still there; returns the whole tokens to hand out now (the
    /// fraction stays here). The share's accrual since then is counted only up to the room
    /// the bucket had at the last sync: a bucket that filled meanwhile and was spent after
    /// lost what it did not have room for, and this never gives more than it would.
    pub fn sync(&mut self, unspent: u64, now_ns: u64) -> u64 {
        if self.unit == 0 {
            return 0;
        }
        let before = self.units;
        let room = (u128::from(self.burst) * self.unit).saturating_sub(before);
        let until = now_ns.min(self.deadline_ns);
        let accrued = if self.accrue && until > self.at_ns {
            self.per_ns * u128::from(until - self.at_ns)
        } else {
            0
        };
        self.at_ns = self.at_ns.max(now_ns);
        let held = u128::from(unspent).min(before / self.unit) * self.unit;
        self.units = held + before % self.unit + accrued.min(room);
        self.whole()
    }

    /// Whole tokens in the local bucket.
    pub fn whole(&self) -> u64 {
        u64::try_from(self.units.checked_div(self.unit).unwrap_or(0)).unwrap_or(u64::MAX)
    }

    /// The deadline (agent clock, ns; 0: none).
    pub fn deadline_ns(&self) -> u64 {
        self.deadline_ns
    }

    /// Whether the grant still runs at `now_ns`.
    pub fn running(&self, now_ns: u64) -> bool {
        now_ns < self.deadline_ns
    }

    /// The burst: the local bucket's capacity.
    pub fn burst(&self) -> u64 {
        self.burst
    }

    fn settle(&mut self, now_ns: u64) {
        if now_ns <= self.at_ns {
            return;
        }
        let until = now_ns.min(self.deadline_ns);
        if self.accrue && until > self.at_ns {
            let dt = u128::from(until - self.at_ns);
            self.units = (self.units + self.per_ns * dt).min(u128::from(self.burst) * self.unit);
        }
        self.at_ns = now_ns;
    }

    /// Spends `cost` at `now_ns` if the grant covers it.
    pub fn try_spend(&mut self, cost: u64, now_ns: u64) -> bool {
        if now_ns >= self.deadline_ns {
            return false;
        }
        self.settle(now_ns);
        let need = u128::from(cost) * self.unit;
        if self.units < need {
            return false;
        }
        self.units -= need;
        true
    }
}

/// The short window an agent watches its demand over, and the least time between two of
/// its calls for a key (ns).
pub const DEMAND_WINDOW_NS: u64 = 100_000_000;

/// The slots of the short window.
const SLOTS: usize = 10;

/// Tokens the short window must see before its rate means anything (at 24 tokens a second
/// a window sees 2.4 on average, and doubling by chance half the time).
const SIGNIFICANT: u64 = 20;

/// Tokens a window must have been expected to see for seeing none to mean the demand
/// stopped (by chance, e^-9: once in 8 000 windows). A gateway the load moved away from
/// gives its share back a window later, not after the second or more its average since
/// the call takes to halve: with a thousand agents, a quarter of them busy and the load
/// moving every 8 s, the agents taking it over waited about a second for the shares
/// (utilisation 0.906 on the virtual clock); now about 0.2 s (0.979).
const QUIET: u64 = 9;

/// How long the first grant of a key runs before the agent calls again: long enough for
/// every agent of a fleet starting together to have reported its demand, so the ones
/// that got headroom before the others came give it back within the first term. (The
/// first call reports the demand the key's first decisions, exact ones, saw; the second
/// sees the fleet's.)
const FIRST_RENEWAL_NS: u64 = 3 * DEMAND_WINDOW_NS;

/// How long demand offered where none was reported is measured before a call reports it
/// (and a key's first call is made).
const NEW_DEMAND_NS: u64 = DEMAND_WINDOW_NS / 5;

/// The longest wait before a limited grant is asked again (ns): four windows. A fleet
/// starting together (its first demands measured while its load still arrives) holds
/// shares on stale demands for up to a term; agents backing off further than this were
/// refusing callers for a second and more after the room came back, and a fleet whose
/// grants were limited took longer to reach its steady (long) terms: at 1.2x r on the
/// virtual clock 1 000 agents called 157 times a second with waits up to 1.6 s, 112 with
/// this (169 and 144 with Poisson arrivals).
const LIMITED_BACKOFF_MAX: u64 = (DEMAND_WINDOW_NS / 4) << 4;

/// Calls that are followed by a renewal after [`FIRST_RENEWAL_NS`].
const FIRST_CALLS: u64 = 1;

/// How long after its call a lease of `ttl_us` is renewed: at three quarters of its term,
/// or a second before its end when that is later (terms over 4 s): a renewal has a second
/// to come back, and a thousand agents on 8 s terms call 143 times a second, not 167.
fn renew_after_ns(ttl_us: u64) -> u64 {
    let ttl_ns = ttl_us.saturating_mul(1_000);
    ttl_ns - (ttl_ns / 4).min(1_000_000_000)
}

/// An agent's renewal policy for one key. It reports the demand offered since its last
/// call (admitted or refused) — a term's worth of it, so a gateway seeing a few requests
/// a second reports its rate, not the noise of a tenth of a second — and calls the store
/// when the term is three quarters over (a second before its end for terms over 4 s:
/// `renew_after_ns`), or sooner (a window after its last call at the
/// earliest) when its demand doubled or halved since it last reported: over the last
/// window if that saw enough tokens to tell, else over a second or more since the last
/// call; or when its last grant was limited by other agents' shares, which they give up
/// as they renew (a quarter window later, backing off). Its calls follow changes of
/// demand, not its volume.
#[derive(Clone, Debug, Default)]
pub struct RatePolicy {
    /// Tokens offered per slot of the short window, and the slot of each (agent ns /
    /// slot).
    slots: [(u64, u64); SLOTS],
    /// Tokens offered since the last call.
    since_call: u64,
    reported_milli: u64,
    /// Grants limited by other agents' shares in a row (0: the last was not).
    limited: u32,
    last_call_ns: u64,
    renew_at_ns: u64,
    calls: u64,
    /// When demand was first offered since the policy began (agent ns; 0: not yet).
    first_offered_ns: u64,
    /// The bucket's whole rate, thousandths of a token per second (0: not known yet, before
    /// the first call): the most demand it reports or compares. Demand past the whole rate
    /// says nothing more about how to share it, and a flat-out caller's refusals (millions
    /// a second, swinging with how much CPU its tasks get) had every agent's report
    /// "double" or "halve" each window: calls each window, and shares and bursts (a part
    /// of `B` by demand) following the swings (8 agents flat out on 2 cores: 342-654 store
    /// calls in 4 s without it, 447-480 with it).
    cap_milli: u64,
}

fn changed(now: u64, reported: u64) -> bool {
    now > 2 * reported.max(1) || now * 2 < reported
}

impl RatePolicy {
    /// `tokens` offered at `now_ns` (admitted or not).
    pub fn offered(&mut self, now_ns: u64, tokens: u64) {
        let slot = now_ns / (DEMAND_WINDOW_NS / SLOTS as u64);
        let cell = &mut self.slots[(slot % SLOTS as u64) as usize];
        if cell.1 != slot {
            *cell = (0, slot);
        }
        cell.0 += tokens;
        self.since_call += tokens;
        if self.first_offered_ns == 0 {
            self.first_offered_ns = now_ns.max(1);
        }
    }

    /// Whether a key's first call is due at `now_ns`: it has seen demand to report (two
    /// tokens, over [`NEW_DEMAND_NS`] at least). Until then its decisions are exact: a
    /// call that reported no demand would get no share.
    pub fn first_due(&self, now_ns: u64) -> bool {
        self.first_offered_ns != 0
            && self.since_call >= 2
            && now_ns.saturating_sub(self.first_offered_ns) >= NEW_DEMAND_NS
    }

    /// Tokens offered over the last window.
    fn window_tokens(&self, now_ns: u64) -> u64 {
        let slot = now_ns / (DEMAND_WINDOW_NS / SLOTS as u64);
        (self.slots.iter())
            .filter(|(_, s)| slot.saturating_sub(*s) < SLOTS as u64)
            .map(|(n, _)| n)
            .sum()
    }

    /// `milli`, at most the bucket's whole rate (once known).
    fn capped(&self, milli: u64) -> u64 {
        if self.cap_milli == 0 {
            milli
        } else {
            milli.min(self.cap_milli)
        }
    }

    /// The demand offered over the last window, thousandths of a token per second, at most
    /// the bucket's rate.
    pub fn window_milli(&self, now_ns: u64) -> u64 {
        self.capped(self.window_tokens(now_ns).saturating_mul(1_000_000_000_000) / DEMAND_WINDOW_NS)
    }

    /// The demand offered since the last call, thousandths of a token per second; before
    /// the first, the last window's, or the average since the first token when the window
    /// saw nothing. At most the bucket's rate.
    pub fn demand_milli(&self, now_ns: u64) -> u64 {
        if self.calls == 0 {
            // Requests that come in bunches (four at once, five times a second) leave most
            // windows empty, and a first call that reported none got no share (its callers
            // then refused). (The average whenever it is more read a fleet starting
            // together high, and cost it a few tokens below the limit.)
            let window = self.window_milli(now_ns);
            if window > 0 {
                return window;
            }
            let since = now_ns
                .saturating_sub(self.first_offered_ns)
                .max(DEMAND_WINDOW_NS);
            let rate = u128::from(self.since_call) * 1_000_000_000_000 / u128::from(since);
            return self.capped(u64::try_from(rate).unwrap_or(u64::MAX));
        }
        let since = now_ns.saturating_sub(self.last_call_ns);
        let least = if self.reported_milli == 0 {
            NEW_DEMAND_NS
        } else {
            DEMAND_WINDOW_NS
        };
        if since < least {
            return self.window_milli(now_ns);
        }
        let rate = u128::from(self.since_call) * 1_000_000_000_000 / u128::from(since);
        self.capped(u64::try_from(rate).unwrap_or(u64::MAX))
    }

    /// The last window's rate doubled or halved since the report, with enough tokens in
    /// it, or expected by the report, to tell.
    fn window_changed(&self, now_ns: u64) -> bool {
        let expected =
            u128::from(self.reported_milli) * u128::from(DEMAND_WINDOW_NS) / 1_000_000_000_000;
        let tokens = self.window_tokens(now_ns);
        (tokens >= SIGNIFICANT
            || expected >= u128::from(SIGNIFICANT)
            || (tokens == 0 && expected >= u128::from(QUIET)))
            && changed(self.window_milli(now_ns), self.reported_milli)
    }

    /// Whether to call the store at `now_ns`.
    pub fn due(&self, now_ns: u64) -> bool {
        if now_ns >= self.renew_at_ns {
            return true;
        }
        let since = now_ns.saturating_sub(self.last_call_ns);
        // A limited grant is asked again a quarter window later, then twice as long after
        // each limited one in a row, up to [`LIMITED_BACKOFF_MAX`]: other agents give
        // their part up as they renew, some soon (their demand fell), some only at their
        // term.
        if self.limited > 0
            && since
                >= ((DEMAND_WINDOW_NS / 4) << (self.limited - 1).min(8)).min(LIMITED_BACKOFF_MAX)
        {
            return true;
        }
        // Demand seen where none was reported (the first call comes with the first
        // request, and gets no share): a few tokens are enough to ask for one; the early
        // renewals correct the rate they report.
        if self.reported_milli == 0 && since >= NEW_DEMAND_NS && self.since_call >= 2 {
            return true;
        }
        if since < DEMAND_WINDOW_NS {
            return false;
        }
        self.window_changed(now_ns)
            || (since >= 10 * DEMAND_WINDOW_NS
                && changed(self.demand_milli(now_ns), self.reported_milli))
    }

    /// Whether demand outgrew the share, a window after the call at the earliest: told
    /// over the last window when it saw enough tokens, else over a second or more since
    /// the call. A report that undercounted (a few requests a second counted over a few
    /// tenths, a gateway whose load was still arriving) would otherwise have the agent
    /// refuse callers for the rest of the term while the rate has room for them. A share
    /// at least the demand reported is outgrown by any demand above it; one contention
    /// trimmed (by an eighth at most: not limited) only by a demand half again the
    /// report, which the trim cannot explain; one cut further is not asked again for the
    /// same demand (a limited grant is asked again anyway, backing off).
    pub fn outgrown(&self, now_ns: u64, share_milli: u64) -> bool {
        let reported = self.reported_milli;
        let bar = if reported == 0 {
            return false;
        } else if share_milli >= reported {
            share_milli
        } else if share_milli >= reported - reported / 8 {
            reported.saturating_mul(3) / 2
        } else {
            return false;
        };
        let since = now_ns.saturating_sub(self.last_call_ns);
        if since < DEMAND_WINDOW_NS {
            return false;
        }
        (self.window_tokens(now_ns) >= SIGNIFICANT && self.window_milli(now_ns) > bar)
            || (since >= 10 * DEMAND_WINDOW_NS && self.demand_milli(now_ns) > bar)
    }

    /// Whether demand surged past the grant: since the call (20 ms ago or more), twice the
    /// tokens the burst and the share's accrual cover, and twice what the report said,
    /// and enough tokens to tell. A gateway whose load jumps (20 requests a second, then
    /// 175) would otherwise refuse most of its callers until its window saw 20 tokens or
    /// a second passed, far under the limit. A fleet over its rate does not surge: its
    /// reports already say its demand.
    pub fn surged(&self, now_ns: u64, share_milli: u64, burst: u64) -> bool {
        let since = now_ns.saturating_sub(self.last_call_ns);
        if self.reported_milli == 0 || since < NEW_DEMAND_NS || self.since_call < SIGNIFICANT {
            return false;
        }
        let per_s = |milli: u64| u128::from(milli) * u128::from(since) / 1_000_000_000_000;
        // What the bucket's whole rate brings at most counts (see `cap_milli`).
        let mut offered = u128::from(self.since_call);
        if self.cap_milli != 0 {
            offered = offered.min(per_s(self.cap_milli));
        }
        offered > 2 * (u128::from(burst) + per_s(share_milli))
            && offered > 2 * per_s(self.reported_milli)
    }

    /// A call sent at `now_ns` reports this demand: the last window's when it changed
    /// enough to tell, else what was offered since the last call.
    pub fn calling(&mut self, now_ns: u64) -> u64 {
        self.reported_milli = if self.reported_milli != 0 && self.window_changed(now_ns) {
            self.window_milli(now_ns)
        } else {
            self.demand_milli(now_ns)
        };
        self.last_call_ns = now_ns;
        self.since_call = 0;
        self.calls += 1;
        self.reported_milli
    }

    /// The reply to the call sent at `sent_ns` came.
    pub fn granted(&mut self, sent_ns: u64, g: &RateGrant) {
        self.limited = if g.limited { self.limited + 1 } else { 0 };
        self.renew_at_ns = if self.calls <= FIRST_CALLS {
            sent_ns + FIRST_RENEWAL_NS
        } else {
            sent_ns + renew_after_ns(g.ttl_us)
        };
    }
}

/// A key an agent leases by rate, as the agent holds it: its local bucket, its renewal
/// policy, and the key's [`Cell`], whose lease holds the bucket's whole tokens so the hot
/// path spends them as any lease (one atomic operation). Sans-io: the agent (and the
/// fleet harness) sends the [`Op`] it gives and hands back the reply.
#[derive(Clone, Debug, Default)]
pub struct RateKey {
    local: LocalRate,
    policy: RatePolicy,
    /// Whole tokens handed to the cell at the last sync.
    in_cell: u64,
    /// The cell's denied tokens counted at the last sync.
    denied_seen: u64,
    /// The call in flight: sent at (agent ns), the burst it declared.
    inflight: Option<(u64, u64)>,
    /// The last grant's share, thousandths of a token per second.
    share_milli: u64,
    /// When demand was last offered (agent ns).
    offered_at_ns: u64,
    /// Tokens spent from the cell in all, for the coordinator.
    spent_total: u64,
    /// The demand last reported, thousandths of a token per second.
    demand_milli: u64,
    /// A call was made since the last release: the store may hold a share for it.
    live: bool,
    /// The last grant answered a call that reported demand: a share of 0 then means the
    /// other agents hold the whole rate.
    informed: bool,
    /// Whole tokens the bucket's level held at the last grant.
    level: u64,
}

/// What a caller the cell does not cover gets ([`RateKey::uncovered`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Uncovered {
    /// One exact decision at the store.
    Exact,
    /// A call now (the lease renewed) that fills the local bucket from the level, then
    /// the cell again.
    Borrow,
    /// A denial, with the time the share takes to bring the cost (ns).
    Wait(u64),
}

impl RateKey {
    /// Brings the local bucket and the cell to `now_ns`: what the cell spent and denied
    /// since the last sync is the demand offered; what the share brought goes into the
    /// cell. Returns the tokens added to the cell.
    pub fn sync(&mut self, cell: &Cell, now_ns: u64) -> u64 {
        let unspent = cell.lease.take_all();
        let spent = self.in_cell.saturating_sub(unspent);
        let denied = cell.denied_tokens();
        let offered = spent + denied.saturating_sub(self.denied_seen);
        self.denied_seen = denied;
        self.spent_total += spent;
        if offered > 0 {
            self.policy.offered(now_ns, offered);
            self.offered_at_ns = now_ns;
        }
        let whole = self.local.sync(unspent, now_ns);
        cell.lease.grant(whole, self.local.deadline_ns());
        self.in_cell = whole;
        whole.saturating_sub(unspent)
    }

    /// `tokens` admitted at `now_ns` outside the cell (an exact decision while the key has
    /// no share): demand offered.
    pub fn offered(&mut self, now_ns: u64, tokens: u64) {
        self.policy.offered(now_ns, tokens);
        self.offered_at_ns = now_ns;
    }

    /// Whether to call the store at `now_ns`: no lease yet and demand seen to report
    /// ([`RatePolicy::first_due`]), or a lease the policy says to renew. (The agent sends
    /// one call at a time per key; a call whose reply never came counts as sent.)
    pub fn due(&self, now_ns: u64) -> bool {
        if self.live {
            self.policy.due(now_ns)
                || self.policy.outgrown(now_ns, self.share_milli)
                || self
                    .policy
                    .surged(now_ns, self.share_milli, self.local.burst())
        } else {
            self.policy.first_due(now_ns)
        }
    }

    /// Whether the store may hold a share for this key (a call since the last release).
    pub fn live(&self) -> bool {
        self.live
    }

    /// The call to send at `now_ns` (the cell synced first): the burst the cell's bucket
    /// holds room for, the burst wanted — half a second of demand, at least one token, at
    /// most `B`; one held already is kept until it is more than a second of demand — and the
    /// demand. A call before it whose reply never came is given up.
    ///
    /// The bursts are the fleet's share of `B`: a burst comes out of the level once (the
    /// level refills only at what the shares leave, nothing under contention), and then
    /// refills from the share; so a burst is kept through small changes of demand rather
    /// than given up and asked again from a level that may be empty.
    pub fn call(&mut self, cell: &Cell, p: &BucketParams, now_ns: u64) -> Op {
        self.sync(cell, now_ns);
        // At least 1: 0 would read as not known.
        self.policy.cap_milli = p.rate.milli_per_sec().max(1);
        let demand = self.policy.calling(now_ns);
        // Demand is in thousandths of a token per second.
        let half = (demand / 2_000).clamp(1, p.capacity);
        let burst = self.local.burst();
        let want = if burst <= 2 * half {
            burst.max(half)
        } else {
            half
        };
        let held = self.local.renewing(now_ns, want);
        // What the burst dropped leaves the cell too.
        let unspent = cell.lease.take_all();
        let whole = self.local.sync(unspent, now_ns);
        cell.lease.grant(whole, self.local.deadline_ns());
        self.in_cell = whole;
        self.inflight = Some((now_ns, held));
        self.demand_milli = demand;
        if !self.live {
            self.live = true;
            self.offered_at_ns = self.offered_at_ns.max(now_ns);
        }
        Op::Rate {
            held,
            want,
            tokens: whole.min(held),
            demand,
        }
    }

    /// The reply to the call in flight, read at `now_ns`: the grant installed (its term
    /// from the moment the call was sent, less `margin_ns`, at most a quarter of the term)
    /// and the cell stocked. The
    /// refill denial lasts the term: a caller the cell does not cover is refused with the
    /// time the share takes to bring what it lacks, not sent to the store.
    pub fn granted(
        &mut self,
        cell: &Cell,
        refill: &Refill,
        p: &BucketParams,
        reply: &Reply,
        now_ns: u64,
        margin_ns: u64,
    ) -> RateGrant {
        let Some((sent_ns, held)) = self.inflight.take() else {
            return RateGrant::default();
        };
        let g = RateGrant::of(reply, held);
        self.sync(cell, now_ns);
        let margin_ns = margin_ns.min(g.ttl_us * 250);
        self.local.grant(p, &g, sent_ns, now_ns, margin_ns);
        self.policy.granted(sent_ns, &g);
        // The tokens paid join what the cell holds (spent meanwhile or not), with the new
        // deadline.
        let whole = self.local.whole();
        cell.lease
            .grant(whole.saturating_sub(self.in_cell), self.local.deadline_ns());
        self.in_cell = whole;
        let unit = u128::from(p.rate.period_us()) * u128::from(rate_scale(p));
        self.share_milli = (u128::from(g.share) * 1_000_000_000 / unit.max(1)) as u64;
        // While the last call reported no demand (the first comes with the first request;
        // a later one when demand stopped) a caller the cell does not cover goes to the
        // store; else it waits for the share, or borrows (a share of 0 then means the
        // others hold the whole rate: exact calls would only be refused).
        self.informed = self.demand_milli > 0;
        self.level = g.level;
        let deny_until = if self.informed {
            self.local.deadline_ns()
        } else {
            0
        };
        refill.rate_granted(deny_until, self.share_milli);
        cell.set_low_water(1);
        cell.clear_denial();
        g
    }

    /// The call in flight got no reply: the share stays paused (the store may have
    /// lowered it) until a later call's reply; the stock is still spent until the
    /// deadline.
    pub fn failed(&mut self) {
        self.inflight = None;
    }

    /// Gives the lease up at `now_ns` (the key went idle, or the agent stops): the cell
    /// empties, and the tokens to return with the release (none past the deadline).
    pub fn release(&mut self, cell: &Cell, refill: &Refill, now_ns: u64) -> u64 {
        self.sync(cell, now_ns);
        let running = self.local.running(now_ns);
        cell.lease.take_all();
        self.in_cell = 0;
        let whole = self.local.stop(now_ns);
        refill.rate_granted(0, 0);
        *self = Self {
            spent_total: self.spent_total,
            denied_seen: self.denied_seen,
            ..Self::default()
        };
        if running { whole } else { 0 }
    }

    /// Whether a live lease had nothing offered for `idle_ns` at `now_ns`.
    pub fn idle(&self, now_ns: u64, idle_ns: u64) -> bool {
        self.live && self.inflight.is_none() && now_ns.saturating_sub(self.offered_at_ns) >= idle_ns
    }

    /// What a caller the cell does not cover gets once the key is synced (and renewed if
    /// a renewal was due):
    /// - one exact decision at the store while the key has no share and the last grant
    ///   answered a call that reported no demand (none yet, or the demand had stopped; an
    ///   exact admission is demand to [`RateKey::offered`]), or when the last grant left
    ///   the level `cost` and the burst is smaller than `cost`;
    /// - a renewal now (unless the caller `borrowed` already, or a call is in flight)
    ///   when the agent's part of the level the last grant left, in proportion to its
    ///   share of the rate, is `cost` at least ([`RateKey::level_part`]): it fills the
    ///   burst from the level and reports the demand as it is. A gateway whose own load
    ///   jumps is not refused while the bucket has the tokens (its share and burst were
    ///   sized by the demand before); a fleet over the rate leaves the level all but empty
    ///   and makes no such calls (a thousand agents would each call for the few tokens
    ///   the shares' rounding leaves there);
    /// - else a denial with the time the share takes to bring `cost` (a share of 0 after
    ///   such a grant means the other agents hold the whole rate: the rule's own time).
    pub fn uncovered(&self, refill: &Refill, cost: u64, rate: Rate, borrowed: bool) -> Uncovered {
        let share = refill.share_milli();
        if share == 0 && !self.informed {
            return Uncovered::Exact;
        }
        if self.level >= cost && cost > self.local.burst() {
            return Uncovered::Exact;
        }
        if !borrowed && self.inflight.is_none() && self.level_part(share, rate) >= cost {
            return Uncovered::Borrow;
        }
        Uncovered::Wait(if share == 0 {
            crate::cell::refill_ns(cost, rate)
        } else {
            (cost as f64 * 1e12 / share as f64) as u64
        })
    }

    /// Whether a caller the cell does not cover (the key synced) must wait for the share:
    /// the cell is empty, and the last grant left the level none of this agent's part
    /// (else the store path may borrow from it, [`RateKey::uncovered`]; the caller's cost
    /// is not known yet). With a call in flight, a caller that may borrow waits for it.
    pub fn must_wait(&self, cell: &Cell, refill: &Refill, rate: Rate) -> bool {
        cell.lease.held() == 0 && self.level_part(refill.share_milli(), rate) == 0
    }

    /// The agent's part of the level the last grant left: in the proportion of its share
    /// (`share_milli`) to the rule's `rate`, whole tokens.
    fn level_part(&self, share_milli: u64, rate: Rate) -> u64 {
        let rate_milli = rate.per_sec_f64() * 1000.0;
        (self.level as f64 * (share_milli as f64 / rate_milli).min(1.0)) as u64
    }

    /// How long the agent remembers an exact denial of its store's `wait_ns` before the
    /// key's first grant: until its first call may be due ([`RatePolicy::first_due`]),
    /// at most. Its callers meanwhile are refused without reaching the policy.
    pub fn first_denial_ns(wait_ns: u64) -> u64 {
        wait_ns.min(NEW_DEMAND_NS)
    }

    /// The last grant's share, thousandths of a token per second.
    pub fn share_milli(&self) -> u64 {
        self.share_milli
    }

    /// The burst: the cell's bucket's capacity.
    pub fn burst(&self) -> u64 {
        self.local.burst()
    }

    /// For the coordinator's report: tokens spent from the cell in all, and the demand
    /// last reported (thousandths of a token per second).
    pub fn totals(&self) -> (u64, u64) {
        (self.spent_total, self.demand_milli)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    fn grant(ttl_us: u64, limited: bool) -> RateGrant {
        RateGrant {
            share: 1_000_000,
            burst: 10,
            paid: 10,
            ttl_us,
            limited,
            level: 0,
        }
    }

    #[test]
    fn a_keys_first_call_waits_for_demand_to_report() {
        let mut p = RatePolicy::default();
        assert!(!p.first_due(0), "nothing offered");
        p.offered(1_000 * MS, 1);
        assert!(!p.first_due(1_030 * MS), "one token");
        p.offered(1_010 * MS, 1);
        assert!(!p.first_due(1_015 * MS), "two tokens, over 15 ms");
        assert!(p.first_due(1_020 * MS));
    }

    #[test]
    fn the_policy_calls_at_three_quarters_of_the_term_or_when_demand_changes() {
        let mut p = RatePolicy::default();
        // 10 tokens a slot of 10 ms: 1 000 tokens/s.
        for slot in 0..10 {
            p.offered(1_000 * MS + slot * 10 * MS, 10);
        }
        assert_eq!(p.demand_milli(1_095 * MS), 1_000_000);
        assert!(p.due(1_095 * MS), "never called");
        assert_eq!(p.calling(1_095 * MS), 1_000_000);
        let g = grant(4_000_000, false);
        p.granted(1_095 * MS, &g);
        // The first grant is renewed soon, once the fleet's demands are known.
        for at in (1_100..1_395).step_by(10) {
            p.offered(at * MS, 10);
            assert!(!p.due(at * MS), "at {at} ms");
        }
        assert!(p.due(1_395 * MS));
        p.calling(1_395 * MS);
        p.granted(1_395 * MS, &g);
        // Steady: not before three quarters of the term.
        for at in (1_400..4_395).step_by(10) {
            p.offered(at * MS, 10);
            assert!(!p.due(at * MS), "at {at} ms");
        }
        assert!(p.due(4_395 * MS));
        assert_eq!(p.calling(4_395 * MS), 1_000_000, "since the last call");
        p.granted(4_395 * MS, &g);
        // Demand doubling over a window that saw enough: due, but not within a window of
        // the last call.
        for at in (4_400..4_500).step_by(10) {
            p.offered(at * MS, 25);
        }
        assert!(!p.due(4_490 * MS), "a window since the last call");
        assert!(p.due(4_500 * MS), "2 500/s against 1 000 reported");
        assert_eq!(p.calling(4_500 * MS), 2_250_000, "the last window's");
        // A limited grant: asked again a quarter window later, then half a window.
        p.granted(4_500 * MS, &grant(4_000_000, true));
        p.offered(4_510 * MS, 25);
        assert!(!p.due(4_520 * MS));
        assert!(p.due(4_525 * MS));
        p.calling(4_525 * MS);
        p.granted(4_525 * MS, &grant(4_000_000, true));
        assert!(!p.due(4_570 * MS));
        assert!(p.due(4_575 * MS));
        // Limited again and again: the wait stops growing at four windows.
        let mut at = 4_575;
        for _ in 0..8 {
            p.calling(at * MS);
            p.granted(at * MS, &grant(4_000_000, true));
            at += LIMITED_BACKOFF_MAX / MS;
        }
        assert!(!p.due((at - LIMITED_BACKOFF_MAX / MS) * MS + LIMITED_BACKOFF_MAX - 1));
        assert!(p.due((at - LIMITED_BACKOFF_MAX / MS) * MS + LIMITED_BACKOFF_MAX));
    }

    /// A gateway that reported while its load was still arriving (10/s; it then gets 16/s),
    /// its share trimmed by contention a hair under the report: it asks again once demand
    /// is half again the report over a second, not at the end of its term. A share cut by
    /// more than an eighth (limited: asked again anyway) is not outgrown by the same
    /// demand; one at least the report is outgrown by any demand above it.
    #[test]
    fn a_trimmed_share_is_outgrown_by_half_again_the_report() {
        let start = |share_milli: u64| {
            let mut k = RateKey::default();
            // A token in each window: 10/s; the second call's grant runs for its term.
            k.policy.offered(850 * MS, 1);
            k.policy.calling(900 * MS);
            k.policy.granted(900 * MS, &grant(8_000_000, false));
            k.policy.offered(950 * MS, 1);
            k.policy.calling(1_000 * MS);
            k.policy.granted(1_000 * MS, &grant(8_000_000, false));
            k.live = true;
            k.share_milli = share_milli;
            k
        };
        assert_eq!(start(0).policy.reported_milli, 10_000);
        // 16 tokens a second, one every 62.5 ms.
        let offer = |k: &mut RateKey, until_ms: u64| {
            let mut at = 1_000 * MS;
            while at < until_ms * MS {
                at += 62_500_000;
                k.policy.offered(at, 1);
            }
        };
        let mut trimmed = start(9_900);
        offer(&mut trimmed, 1_900);
        assert!(!trimmed.due(1_900 * MS), "under a second since the call");
        offer(&mut trimmed, 2_100);
        assert!(
            trimmed.due(2_100 * MS),
            "16/s against 10/s reported, over a second"
        );
        let mut cut = start(8_000);
        offer(&mut cut, 3_000);
        assert!(
            !cut.due(3_000 * MS),
            "cut by a fifth: the same demand gets the same cut"
        );
        let mut whole = start(11_000);
        offer(&mut whole, 2_100);
        assert!(whole.due(2_100 * MS), "16/s against a share of 11/s");
        // Within half again the report (14/s) a trimmed share waits for its term.
        let mut steady = start(9_900);
        let mut at = 1_000 * MS;
        while at < 3_000 * MS {
            at += 71_428_571;
            steady.policy.offered(at, 1);
        }
        assert!(!steady.due(3_000 * MS));
    }

    /// A gateway the load moved away from: at 100/s a window expects 10 tokens, and one
    /// that sees none means the demand stopped; it asks again a window after its last
    /// token, reporting none. At 50/s (5 expected) an empty window happens by chance
    /// (e^-5), and the average since the call decides, a second on.
    #[test]
    fn demand_that_stops_is_reported_a_window_later() {
        let run = |per_ms: u64| {
            let mut p = RatePolicy::default();
            // Two calls: the second's grant runs for its term.
            for call in [1_000, 2_000] {
                for at in (call - 1_000..call).step_by(per_ms as usize) {
                    p.offered(at * MS, 1);
                }
                p.calling(call * MS);
                p.granted(call * MS, &grant(8_000_000, false));
            }
            for at in (2_000..3_000).step_by(per_ms as usize) {
                p.offered(at * MS, 1);
                assert!(!p.due(at * MS), "at {at} ms");
            }
            // Nothing from 3 s on.
            (3_000..4_000)
                .find(|&at| p.due(at * MS))
                .map(|at| (at, p.calling(at * MS)))
        };
        let (at, reported) = run(10).expect("due");
        assert!((3_080..=3_100).contains(&at), "due at {at} ms");
        assert_eq!(reported, 0);
        assert_eq!(run(20), None, "50/s: a window without tokens is noise");
    }

    /// A gateway alone on a key at 20 requests a second, then 175: it asks again within a
    /// quarter of a second, not once its window sees 20 tokens or a second passed. One
    /// whose demand stays far over its share (a fleet over the rate, reporting it) does
    /// not.
    #[test]
    fn a_surge_past_the_grant_asks_again_at_once() {
        let start = |reported_per_s: u64, share_milli: u64, burst: u64| {
            let mut k = RateKey::default();
            let every = 1_000 / reported_per_s;
            for at in (0..1_000).step_by(every as usize) {
                k.policy.offered(at * MS, 1);
            }
            k.policy.calling(1_000 * MS);
            k.policy.granted(1_000 * MS, &grant(8_000_000, false));
            for at in (1_000..2_000).step_by(every as usize) {
                k.policy.offered(at * MS, 1);
            }
            k.policy.calling(2_000 * MS);
            k.policy.granted(2_000 * MS, &grant(8_000_000, false));
            k.live = true;
            k.share_milli = share_milli;
            k.local.burst = burst;
            k
        };
        // 20/s reported, a share of 25/s and a burst of 10; then a request every 5.7 ms.
        let mut k = start(20, 25_000, 10);
        let mut at = 2_000 * MS;
        let due = loop {
            at += 5_700_000;
            k.policy.offered(at, 1);
            if k.due(at) {
                break at;
            }
            assert!(at < 3_000 * MS, "not due within a second");
        };
        let after_ms = (due - 2_000 * MS) / MS;
        assert!(
            (150..=250).contains(&after_ms),
            "due {after_ms} ms after the call"
        );
        assert_eq!(
            k.policy.calling(due) / 1_000,
            175,
            "the surge's rate reported"
        );
        // 500/s reported and offered against a share of 100/s: no surge.
        let mut over = start(500, 100_000, 50);
        for at in (2_000..2_900).step_by(2) {
            over.policy.offered(at * MS, 1);
            assert!(!over.policy.surged(at * MS, 100_000, 50), "at {at} ms");
        }
    }

    /// A caller the cell does not cover, once informed: a renewal that borrows from the
    /// level while the agent's part of it (in proportion to its share of the rate) covers
    /// the cost, once per caller; one exact call for a cost over the burst that the level
    /// holds; else a wait for the share. A fleet over the rate leaves the level all but
    /// empty: 15 tokens of 20 000/s for an agent with 20/s of it is no part at all.
    #[test]
    fn a_dry_cell_borrows_from_the_level_its_part_covers() {
        let rate: Rate = "20000/s".parse().unwrap();
        let refill = Refill::new();
        refill.rate_granted(u64::MAX, 20_000);
        let key = |level: u64| RateKey {
            informed: true,
            level,
            local: LocalRate {
                burst: 10,
                ..LocalRate::default()
            },
            ..RateKey::default()
        };
        let full = key(19_000);
        assert_eq!(full.uncovered(&refill, 1, rate, false), Uncovered::Borrow);
        let dry = Cell::new();
        assert!(!full.must_wait(&dry, &refill, rate));
        assert!(
            matches!(full.uncovered(&refill, 1, rate, true), Uncovered::Wait(_)),
            "one borrow per caller"
        );
        assert_eq!(full.uncovered(&refill, 11, rate, false), Uncovered::Exact);
        // 19 000 × 20/20 000: a part of 19 tokens.
        assert!(matches!(
            full.uncovered(&refill, 10, rate, false),
            Uncovered::Borrow
        ));
        let scraps = key(15);
        assert_eq!(
            scraps.uncovered(&refill, 1, rate, false),
            Uncovered::Wait(50_000_000),
            "a token of a 20/s share"
        );
        assert!(scraps.must_wait(&dry, &refill, rate));
        // Uninformed (no grant has answered a report of demand): exact.
        let new = RateKey::default();
        assert_eq!(
            new.uncovered(&Refill::new(), 1, rate, false),
            Uncovered::Exact
        );
    }

    /// Four requests at once, five times a second, on a new key: the first call reports
    /// about 20 a second, not the last window's none (which got the key no share, its
    /// first renewal then read a window of the bunch as 150 a second, and the next empty
    /// window as demand stopped: a few callers refused in a run now and then). After a
    /// call that reported no demand, a caller the cell does not cover is decided exactly.
    #[test]
    fn bunched_requests_on_a_new_key_report_their_rate() {
        let mut k = RateKey::default();
        k.policy.offered(0, 4);
        // The second bunch's first caller makes the key's first call.
        assert!(k.policy.first_due(200 * MS));
        let d = k.policy.calling(200 * MS);
        assert!((19_000..=21_000).contains(&d), "reported {d}");
        k.policy.granted(200 * MS, &grant(8_000_000, false));
        k.policy.offered(200 * MS, 3);
        // No call before the first renewal: no surge, and the empty windows between the
        // bunches are not demand stopping.
        for at in (210..500).step_by(10) {
            if at % 200 == 0 {
                k.policy.offered(at * MS, 4);
            }
            assert!(!k.policy.due(at * MS), "due at {at} ms");
        }
        assert!(k.policy.due(500 * MS), "the first renewal");
        // After a grant that answered a report of no demand, a caller the cell does not
        // cover is decided exactly, not refused for a share of 0.
        let rate: Rate = "20000/s".parse().unwrap();
        let refill = Refill::new();
        refill.rate_granted(0, 0);
        k.informed = false;
        assert_eq!(k.uncovered(&refill, 1, rate, false), Uncovered::Exact);
    }

    /// A few tokens a second: a window is noise (2 tokens, or 5), not a change; what was
    /// offered since the last call is the rate reported, and a change shows over a second.
    #[test]
    fn a_slow_key_reports_its_rate_not_a_window_of_noise() {
        let mut p = RatePolicy::default();
        // 20/s, in bunches of 5 every 250 ms.
        p.offered(0, 5);
        p.calling(100 * MS);
        p.granted(100 * MS, &grant(4_000_000, false));
        p.offered(250 * MS, 5);
        p.calling(400 * MS);
        p.granted(400 * MS, &grant(4_000_000, false));
        p.offered(500 * MS, 5);
        p.calling(700 * MS);
        p.granted(700 * MS, &grant(4_000_000, false));
        for at in (750..3_700).step_by(250) {
            p.offered(at * MS, 5);
            assert!(!p.due(at * MS), "at {at} ms");
        }
        let d = p.calling(3_700 * MS);
        assert!((18_000..=22_000).contains(&d), "{d}");
        p.granted(3_700 * MS, &grant(4_000_000, false));
        // 80/s: not significant in a window (8 tokens), seen after a second.
        for at in (3_710..4_700).step_by(100) {
            p.offered(at * MS, 8);
            assert!(!p.due(at * MS), "at {at} ms");
        }
        p.offered(4_710 * MS, 8);
        assert!(p.due(4_710 * MS));
    }
}
