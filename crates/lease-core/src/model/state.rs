//! What the Redis hash of a bucket holds, and the refill that brings it to the present
//! (the Lua's `fresh`, `seed_part` and `advance`).

use std::collections::BTreeMap;

use super::split::{PartTerm, RESERVATION, Split};
use super::{AgentId, DEMAND_TTL_US, Reply};
use crate::bucket::Level;
use crate::rate::MAX_EXACT;
use crate::rule::{BucketParams, Mode};

/// What the store remembers of one agent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AgentRecord {
    /// Tokens the agent may hold (an upper bound of its real count).
    pub held: u64,
    /// Server time after which the record no longer counts and is dropped.
    pub drop_us: u64,
    /// Last sequence number processed.
    pub seq: u64,
    /// Its reply, replayed to a retry.
    pub reply: Reply,
    /// Last reported demand, thousandths of a token per second.
    pub demand: u64,
    /// What it may still lease while the key is contended, thousandths of a token.
    pub credit_milli: u64,
    /// Its rate lease's share of the bucket's rate, `1/scale`-ths of a token per rate
    /// period ([`rate_scale`]; 0: none); `held` is then its local bucket's capacity, its
    /// burst.
    pub share: u64,
}

impl AgentRecord {
    /// Its rate lease's burst, as a reply says it: `held` while it has a share, else 0.
    pub fn burst(&self) -> u64 {
        if self.share > 0 { self.held } else { 0 }
    }
}

/// The state of a bucket key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BucketState {
    /// Tokens in the bucket.
    pub level: Level,
    /// The period the carry is counted in.
    pub period_us: u64,
    /// Last server time used.
    pub updated_us: u64,
    /// Sum of the agents' `held`.
    pub outstanding: u64,
    /// A time at or before the earliest record drop (0: no records; stored as is).
    pub next_drop_us: u64,
    /// A time at or after the latest record drop (0: no records yet; stored as is).
    pub last_drop_us: u64,
    /// Agent records.
    pub agents: BTreeMap<AgentId, AgentRecord>,
    /// Sum of the records' demand.
    pub demand_sum: u64,
    /// The earliest moment a record's demand goes stale (0: no demand; stored as is).
    pub next_stale_us: u64,
    /// The split in force, when this bucket is a split parent.
    pub split: Option<Split>,
    /// The start of the latest split, kept after it ends so the next one differs (0: never
    /// split).
    pub last_split_us: u64,
    /// The split this bucket is a part of, if it is one.
    pub part: Option<PartTerm>,
    /// Redis key expiry, ms (PEXPIREAT).
    pub expire_at_ms: u64,
    /// On a region's bucket: when the term its deposits serve ends (the region's server
    /// µs; 0: never fed). What is left at that moment is void (see [`super::region`]).
    pub term_until_us: u64,
    /// On a region's bucket: the last deposit applied (its grant's time on the global
    /// bucket, which only grows); a deposit not above it changes nothing.
    pub deposit_seq: u64,
    /// On a region's bucket: the rate the region gets, by its last deposit (thousandths
    /// of a token per second; 0: unknown), which its agents' shares divide.
    pub region_rate_milli: u64,
    /// The sum of the records' shares (rate leases), in `1/scale`-ths of a token per rate
    /// period ([`rate_scale`]): the bucket refills at what they leave.
    pub shared: u64,
    /// The records with a share (0: none; then `shared` is 0).
    pub share_records: u64,
    /// The unit the shares are counted in, `period_us × scale` (0 with no share). A rule
    /// whose change moves it leaves the shares of the old unit counting as the whole rate
    /// until their records drop: nothing refills the level meanwhile.
    pub share_unit: u64,
    /// Stored compact, as a string of `tok`, `car`, `ts`, `p` and the key's expiry
    /// instead of the hash (`leasehold_store::wire::compact_value`): made so by a batch of
    /// exact decisions for a new key and kept while only batches write the key (such a
    /// key has no records, demand or split); any other operation stores the hash.
    pub compact: bool,
}

/// What a bucket would hold at some time, without anything being sent to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct View {
    /// Tokens.
    pub level: Level,
    /// Outstanding tokens.
    pub outstanding: u64,
    /// Agent records still counting.
    pub agents: usize,
    /// The rate leases' shares still counting, `1/scale`-ths of a token per rate period.
    pub shared: u64,
}

/// The scale a bucket's rate-lease shares are counted in: they are `1/scale`-ths of a
/// token per rate period, the finest power of ten up to 10^9 for which the level's refill
/// at part of the rate stays exact (`(B × period_us + tokens) × scale` within
/// [`MAX_EXACT`]); 0 when not even 10^3 fits (such a rule is refused rate leases). At
/// 20 000/s (1 token per 50 µs) and B = 20 000, 10^9: a share of one agent in 1 000 is
/// counted to a millionth of itself.
pub fn rate_scale(p: &BucketParams) -> u64 {
    let x = p.capacity * p.rate.period_us() + p.rate.tokens();
    let mut scale = 1_000_000_000;
    while scale >= 1_000 {
        if x <= MAX_EXACT / scale {
            return scale;
        }
        scale /= 10;
    }
    0
}

/// The level refill may reach: `B - outstanding` in strict mode (I1), `B` in relaxed.
fn cap(p: &BucketParams, outstanding: u64) -> u64 {
    capped(p.capacity, p, outstanding)
}

/// `capacity` less what is outstanding in strict mode.
fn capped(capacity: u64, p: &BucketParams, outstanding: u64) -> u64 {
    match p.mode {
        Mode::Strict => capacity.saturating_sub(outstanding),
        Mode::Relaxed { .. } => capacity,
    }
}

/// The period a bucket's carry is counted in: its refill rate's (a region's floor's).
pub(super) fn carry_period(p: &BucketParams) -> u64 {
    match p.region.and_then(|r| r.floor) {
        Some(f) => f.period_us(),
        None => p.rate.period_us(),
    }
}

impl BucketState {
    /// Whether the hash holds nothing but a level: no record (none ever to drop), demand,
    /// share, split (nor ever one), part or region term. An exact batch stores such a
    /// bucket compact again (the Lua's `exact_one`).
    pub(super) fn only_a_level(&self) -> bool {
        self.agents.is_empty()
            && self.next_drop_us == 0
            && self.last_drop_us == 0
            && self.outstanding == 0
            && self.demand_sum == 0
            && self.next_stale_us == 0
            && self.split.is_none()
            && self.last_split_us == 0
            && self.part.is_none()
            && self.shared == 0
            && self.share_records == 0
            && self.share_unit == 0
            && self.term_until_us == 0
            && self.deposit_seq == 0
            && self.region_rate_milli == 0
    }

    /// A key that does not exist: a full bucket.
    /// A region's bucket starts empty: its tokens come from deposits.
    pub(super) fn fresh(p: &BucketParams, now_us: u64) -> Self {
        Self {
            level: if p.region.is_some() {
                Level::default()
            } else {
                Level::full(p.capacity)
            },
            period_us: carry_period(p),
            updated_us: now_us,
            outstanding: 0,
            next_drop_us: 0,
            last_drop_us: 0,
            agents: BTreeMap::new(),
            demand_sum: 0,
            next_stale_us: 0,
            split: None,
            last_split_us: 0,
            part: None,
            expire_at_ms: 0,
            term_until_us: 0,
            deposit_seq: 0,
            region_rate_milli: 0,
            shared: 0,
            share_records: 0,
            share_unit: 0,
            compact: false,
        }
    }

    /// A part's first call of a newer split starts it from its seed: its share of the
    /// parent's tokens, and a reservation of its share of the parent's outstanding tokens
    /// until they drop. Whatever an older split left is void (that split's term is over);
    /// later calls may carry a longer term.
    pub(super) fn seed_part(self, p: &BucketParams, now_us: u64) -> (Self, bool) {
        let Some(seed) = &p.part else {
            return (self, false);
        };
        let known = self.part.map_or(0, |t| t.gen_us);
        if known > seed.gen_us {
            return (self, false);
        }
        if known == seed.gen_us {
            let mut s = self;
            if let Some(t) = &mut s.part {
                t.until_us = t.until_us.max(seed.until_us);
            }
            return (s, false);
        }
        let mut s = Self::fresh(p, now_us);
        s.part = Some(PartTerm {
            gen_us: seed.gen_us,
            until_us: seed.until_us,
        });
        if seed.outstanding > 0 && seed.drop_us > now_us {
            s.outstanding = seed.outstanding;
            s.next_drop_us = seed.drop_us;
            s.last_drop_us = seed.drop_us;
            s.agents.insert(
                RESERVATION,
                AgentRecord {
                    held: seed.outstanding,
                    drop_us: seed.drop_us,
                    seq: 0,
                    reply: Reply::default(),
                    demand: 0,
                    credit_milli: 0,
                    share: 0,
                },
            );
        }
        s.level = Level {
            tokens: seed.tokens,
            carry: 0,
        };
        s.clamp(p);
        (s, true)
    }

    fn refill_to(&mut self, p: &BucketParams, t: u64) {
        let Some(region) = p.region else {
            let dt = t.saturating_sub(self.updated_us);
            let cap = cap(p, self.outstanding);
            self.level = if self.share_records > 0 {
                // Rate leases hold part of the rate: the bucket refills at the rest.
                let (scale, per) = (rate_scale(p), p.rate.period_us());
                let n = (p.rate.tokens() * scale).saturating_sub(self.shared);
                if scale == 0 {
                    self.level
                } else {
                    (self.level).refill_scaled(cap, n, per, scale, dt)
                }
            } else {
                self.level.refill(cap, p.rate, dt)
            };
            self.updated_us = self.updated_us.max(t);
            return;
        };
        // A region's bucket refills nothing during its term: deposits feed it.
        let term = self.term_until_us;
        if self.updated_us < term {
            if t < term {
                self.updated_us = t;
                return;
            }
            // The term is over: what is left of it is void.
            self.level = Level::default();
            self.updated_us = term;
        }
        if let Some(floor) = region.floor {
            let dt = t.saturating_sub(self.updated_us);
            let cap = capped(region.floor_burst, p, self.outstanding);
            self.level = self.level.refill(cap, floor, dt);
        }
        self.updated_us = self.updated_us.max(t);
    }

    /// Whether a region's bucket is within its term (brought up to date).
    pub(super) fn in_term(&self) -> bool {
        self.updated_us < self.term_until_us
    }

    /// Brings the level under its cap after `outstanding` grew (a region's bucket past its
    /// term: under its floor's burst).
    pub(super) fn clamp(&mut self, p: &BucketParams) {
        let cap = match p.region {
            Some(r) if !self.in_term() => capped(r.floor_burst, p, self.outstanding),
            _ => cap(p, self.outstanding),
        };
        if self.level.tokens >= cap {
            self.level = Level::full(cap);
        }
    }

    /// Microseconds until `k` tokens could be there, for a denial's retry time; never 0
    /// when they are not. A region's bucket within its term waits for its broker's next
    /// deposit ([`super::region::REGION_WAIT_US`]); past it, for its floor, but no longer.
    pub(super) fn wait_for(&self, p: &BucketParams, k: u64) -> u64 {
        let Some(region) = p.region else {
            if self.share_records == 0 {
                return self.level.time_until(k, p.rate);
            }
            // At the rate the leases leave; with none left, from the next record drop on
            // at the whole rate (a hint: a renewal may hold it longer).
            let (scale, per) = (rate_scale(p), p.rate.period_us());
            let n = (p.rate.tokens() * scale).saturating_sub(self.shared);
            let at = (scale != 0)
                .then(|| self.level.time_until_scaled(k, n, per, scale))
                .flatten();
            return match at {
                Some(us) => us,
                None => {
                    let drop = self.next_drop_us.saturating_sub(self.updated_us);
                    drop + self.level.time_until(k, p.rate)
                }
            };
        };
        let wait = super::region::REGION_WAIT_US;
        match region.floor {
            _ if self.level.tokens >= k => 0,
            Some(f) if !self.in_term() && k <= region.floor_burst => {
                self.level.time_until(k, f).min(wait)
            }
            _ => wait,
        }
    }

    /// Microseconds until the bucket would be back to what an absent key holds: full for a
    /// bucket; for a region's, its floor's burst, from empty if the term still runs (an
    /// absent region's bucket is empty, so expiring early only loses tokens, but the
    /// floor then starts again from the next call).
    pub(super) fn time_to_rest(&self, p: &BucketParams) -> u64 {
        match p.region {
            None => self.level.time_until(p.capacity, p.rate),
            Some(r) => r.floor.map_or(0, |f| {
                let from = if self.in_term() {
                    Level::default()
                } else {
                    self.level
                };
                from.time_until(r.floor_burst, f)
            }),
        }
    }

    /// A record's share no longer counts.
    pub(super) fn remove_share(&mut self, share: u64) {
        if share == 0 {
            return;
        }
        self.share_records -= 1;
        self.shared = self.shared.saturating_sub(share);
        if self.share_records == 0 {
            (self.shared, self.share_unit) = (0, 0);
        }
    }

    /// A record's share counts, in `p`'s unit.
    pub(super) fn add_share(&mut self, p: &BucketParams, share: u64) {
        if share == 0 {
            return;
        }
        self.share_records += 1;
        self.shared += share;
        self.share_unit = p.rate.period_us() * rate_scale(p);
    }

    /// Refill to `now`, dropping expired records at their drop times on the way, so the
    /// refill between two drops uses the cap in force then.
    pub(super) fn advance(&mut self, p: &BucketParams, now: u64) {
        // Shares counted in another unit (the rule changed): they hold the whole rate
        // until their records drop.
        if self.share_records > 0 {
            let (scale, per) = (rate_scale(p), p.rate.period_us());
            if per * scale != self.share_unit {
                self.shared = p.rate.tokens() * scale;
                self.share_unit = per * scale;
            }
        }
        if self.period_us != carry_period(p) {
            self.level.carry = 0;
            self.period_us = carry_period(p);
        }
        // A split parent refills nothing during the term: its rate belongs to the parts.
        if let Some(split) = self.split {
            if now < split.until_us {
                self.updated_us = now;
            } else {
                self.updated_us = self.updated_us.max(split.until_us);
                self.split = None;
            }
        }
        if self.next_stale_us != 0 && now >= self.next_stale_us {
            // Demand of agents silent for DEMAND_TTL stops counting in the shares.
            // A rate lease's demand counts until its record drops: the agent calls once a
            // term, and its share was sized by it.
            for r in self.agents.values_mut() {
                if r.demand > 0 && r.share == 0 && r.reply.now_us + DEMAND_TTL_US <= now {
                    self.demand_sum -= r.demand;
                    r.demand = 0;
                }
            }
            self.next_stale_us = self
                .agents
                .values()
                .filter(|r| r.demand > 0 && r.share == 0)
                .map(|r| r.reply.now_us + DEMAND_TTL_US)
                .min()
                .unwrap_or(0);
        }
        if self.next_drop_us != 0 && now >= self.next_drop_us {
            let mut expired: Vec<(u64, AgentId)> = self
                .agents
                .iter()
                .filter(|(_, r)| r.drop_us <= now)
                .map(|(id, r)| (r.drop_us, *id))
                .collect();
            expired.sort();
            for (at, id) in expired {
                self.refill_to(p, at);
                if let Some(r) = self.agents.remove(&id) {
                    self.outstanding -= r.held;
                    self.demand_sum -= r.demand;
                    self.remove_share(r.share);
                }
            }
            // Not within a quarter of the grace of this look (as the Lua): a key held by
            // many agents would otherwise read every record on most calls. A record
            // dropped late is dropped as of its own time, the level having refilled
            // meanwhile as if it still held its share and its tokens: lateness only
            // under-admits.
            self.next_drop_us = match self.agents.values().map(|r| r.drop_us).min() {
                Some(x) => x.max(now + p.grace_us / 4),
                None => 0,
            };
            self.last_drop_us = self.agents.values().map(|r| r.drop_us).max().unwrap_or(0);
        }
        self.refill_to(p, now);
    }

    /// The agent's record, unless it is past its drop time.
    pub(super) fn live(&self, agent: AgentId, now: u64) -> Option<&AgentRecord> {
        self.agents.get(&agent).filter(|r| r.drop_us > now)
    }

    /// Whether this bucket serves nothing now (Lua: `where`): a split parent, or a part
    /// whose term is over. Callers are told to ask the parent.
    pub(super) fn moved(&self, now: u64) -> bool {
        self.split.is_some() || self.part.is_some_and(|t| now >= t.until_us)
    }

    /// The lease a grant gets now: the rule's, ending with the part's term on a part.
    /// On a region's bucket within its term, ending with the term.
    pub(super) fn lease_ttl(&self, p: &BucketParams, now: u64) -> u64 {
        let end = match self.part {
            Some(t) => t.until_us,
            None if p.region.is_some() && self.in_term() => self.term_until_us,
            None => return p.lease_ttl_us,
        };
        p.lease_ttl_us.min(end.saturating_sub(now + p.grace_us))
    }
}
