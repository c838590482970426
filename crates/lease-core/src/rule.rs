//! Rules: what a bucket admits (capacity B, refill rate r), how it is leased, and what an
//! agent does when the global store cannot be reached.
//!
//! A [`Rule`] can only be built valid: [`RuleSpec`] is the raw form read from a config
//! file, and [`Rule::from_spec`] turns it into a rule or an error that names the field and
//! the value at fault.

use std::collections::BTreeMap;
use std::fmt;
use std::num::NonZeroU64;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::local::LocalShare;
use crate::rate::{MAX_EXACT, MAX_PERIOD_US, Rate, RateError, parse_duration};

/// The largest `capacity * period_us + tokens` of a rule: half of [`MAX_EXACT`], so that a
/// server time (about 2^51 µs since 1970) plus a bucket's time to refill stays exact too.
pub const MAX_BUCKET_UNITS: u64 = 1 << 52;

/// A validated rule name: 1 to 64 characters of `A-Z a-z 0-9 . _ -`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RuleName(String);

impl RuleName {
    /// Validates `name`.
    pub fn new(name: &str) -> Result<Self, RuleError> {
        let ok = !name.is_empty()
            && name.len() <= 64
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
        if ok {
            Ok(Self(name.to_owned()))
        } else {
            Err(RuleError::Name {
                name: name.chars().take(80).collect(),
            })
        }
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for RuleName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(&self.0)
    }
}

/// How refill accounts for leased tokens.
///
/// Deliberately exhaustive, like [`Leasing`] and [`FailurePolicy`]: a new variant changes
/// what every agent and store must do, and each `match` on it must be revisited (a
/// compile error, not a wildcard arm).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Refill stops at `B - outstanding`: admitted tokens in any window W are at most
    /// `B + r * W`, across any number of agents (invariant I1). The default.
    Strict,
    /// Refill ignores leases; grants stop when `outstanding` reaches `max_outstanding`,
    /// which bounds the overshoot: admitted in W is at most `B + max_outstanding + r * W`.
    Relaxed {
        /// The cap on tokens leased and not yet reported.
        max_outstanding: NonZeroU64,
    },
}

/// Whether an agent leases tokens for a key or asks the store on every decision.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Leasing {
    /// Per-request calls while a key is cold; leases once its local rate passes the
    /// agent's threshold; back to per-request when it idles. The default.
    Auto,
    /// Always lease.
    Lease,
    /// Never lease: one exact call per decision.
    Exact,
    /// Lease a share of the rate and a burst for a term (see [`crate::rate_lease`]): one
    /// store call per term, or per change of demand, whatever the key's volume. For a key
    /// shared by many agents (hundreds of gateways on one tenant).
    Rate,
}

/// What an agent decides while the global store is unreachable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailurePolicy {
    /// Admit: favours availability.
    FailOpen,
    /// Refuse with 503: protects the budget.
    FailClosed,
    /// Admit up to a local limit per agent. `None` derives it from the agent's last granted
    /// share of the rule.
    LocalEmergency {
        /// The local rate, when configured.
        rate: Option<Rate>,
    },
}

/// Why a rule was refused. Every variant names the rule, the field and the value.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RuleError {
    /// A rule name with characters outside `A-Z a-z 0-9 . _ -`, empty, or over 64 bytes.
    #[error("rule name {name:?} must be 1-64 characters of A-Z a-z 0-9 . _ -")]
    Name {
        /// The name given (first 80 characters).
        name: String,
    },
    /// A field that must be positive was zero.
    #[error("rule {rule}: {field} must be at least 1 (got 0)")]
    Zero {
        /// The rule.
        rule: String,
        /// The field.
        field: &'static str,
    },
    /// The refill rate could not be used.
    #[error("rule {rule}: {field}: {source}")]
    Rate {
        /// The rule.
        rule: String,
        /// The field: `rate`, or `emergency_rate`.
        field: &'static str,
        /// What is wrong with it.
        source: RateError,
    },
    /// A duration field could not be parsed or is out of range.
    #[error("rule {rule}: {field} = {value:?}: {why}")]
    Duration {
        /// The rule.
        rule: String,
        /// The field.
        field: &'static str,
        /// The text given.
        value: String,
        /// What is wrong with it.
        why: String,
    },
    /// A field is out of its range.
    #[error("rule {rule}: {field} = {value}: {why}")]
    Range {
        /// The rule.
        rule: String,
        /// The field.
        field: &'static str,
        /// The value given.
        value: u64,
        /// The accepted range.
        why: String,
    },
    /// A field given where another field makes it meaningless.
    #[error("rule {rule}: {field} = {value:?}: {why}")]
    Conflict {
        /// The rule.
        rule: String,
        /// The field.
        field: &'static str,
        /// The text given.
        value: String,
        /// Why it does not apply.
        why: &'static str,
    },
    /// A field holds a word that is not one of its choices.
    #[error("rule {rule}: {field} = {value:?}: expected one of {choices}")]
    Choice {
        /// The rule.
        rule: String,
        /// The field.
        field: &'static str,
        /// The text given.
        value: String,
        /// The accepted words.
        choices: &'static str,
    },
}

/// A rule as written in a config file. All durations are text (`"250ms"`, `"5s"`).
///
/// Fields may be added: build one with [`RuleSpec::new`] and set the optional fields.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct RuleSpec {
    /// Burst capacity B, in tokens.
    pub capacity: u64,
    /// Refill rate, `N/PERIOD` (`"100/s"`).
    pub rate: String,
    /// Smallest lease an agent asks for (default 1).
    pub lease_min: Option<u64>,
    /// Largest lease an agent asks for (default B/8, at least 1).
    pub lease_max: Option<u64>,
    /// Lease lifetime (default `"5s"`).
    pub lease_ttl: Option<String>,
    /// How long the store keeps an agent's record after its lease expires (default `"1s"`).
    pub grace: Option<String>,
    /// `"strict"` (default) or `"relaxed"`.
    pub mode: Option<String>,
    /// With `mode = "relaxed"`: the cap on outstanding leased tokens (default B/4).
    pub max_outstanding: Option<u64>,
    /// `"fail_open"`, `"fail_closed"` (default) or `"local_emergency"`.
    pub on_failure: Option<String>,
    /// With `on_failure = "local_emergency"`: the local rate (default: derived).
    pub emergency_rate: Option<String>,
    /// How long a decision may wait for the store (default `"50ms"`).
    pub timeout: Option<String>,
    /// `"auto"` (default), `"lease"`, `"exact"` or `"rate"`.
    pub leasing: Option<String>,
    /// With `leasing = "rate"`: how long a rate lease runs at most (default `"8s"`); it takes
    /// `lease_ttl`'s place.
    pub term: Option<String>,
    /// Wait for this many replicas to acknowledge each call that grants tokens (Redis
    /// `WAIT`) before spending them; a grant not acknowledged in time counts as unknown
    /// (the failure policy decides). Default 0: no wait.
    pub replicas: Option<u64>,
    /// With `replicas`: how long to wait for them (default `"5ms"`, below `timeout`).
    pub replica_timeout: Option<String>,
    /// Decide, count and report, but never enforce: every denial is admitted and counted
    /// as `shadow_denied` (default false).
    pub shadow: Option<bool>,
    /// In a deployment in regions (each region with its own store): `"global"`, one
    /// worldwide bucket whose budget the regions lease (strict across regions), or
    /// `"region"`, an independent bucket per region sized by `weights`. Unset: one bucket
    /// per store, as without regions.
    pub scope: Option<String>,
    /// With `scope = "global"`: what a region cut off from the global store admits once
    /// its term is over (a rate such as `"10/s"`; default nothing, strict).
    pub partition_floor: Option<String>,
    /// With `scope = "region"`: each region's weight; region `name` gets
    /// `weights[name] / sum(weights)` of the capacity and the rate.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub weights: BTreeMap<String, u64>,
    /// The percentage of each key's budget (capacity and rate) that agents spend
    /// locally, without the store, split in `local_agents` equal seats (see
    /// [`crate::local`]). Unset: none, every token goes through the store.
    pub local_percent: Option<u64>,
    /// With `local_percent`: how many agents hold a seat at a time (each gets
    /// `local_percent / local_agents` of every key; agents beyond that many use the store
    /// alone).
    pub local_agents: Option<u64>,
    /// Per-subject settings: `overrides."tenant-42"` for one subject, or
    /// `overrides."sha256:<64 hex digits>"` for the subject with that SHA-256, so secrets
    /// need not sit in config. Unset fields inherit from the rule.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub overrides: BTreeMap<String, OverrideSpec>,
}

/// The settings of one subject under a rule: any rule field but the name; unset fields
/// inherit from the rule.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct OverrideSpec {
    /// Burst capacity B.
    pub capacity: Option<u64>,
    /// Refill rate.
    pub rate: Option<String>,
    /// See [`RuleSpec::lease_min`].
    pub lease_min: Option<u64>,
    /// See [`RuleSpec::lease_max`].
    pub lease_max: Option<u64>,
    /// See [`RuleSpec::lease_ttl`].
    pub lease_ttl: Option<String>,
    /// See [`RuleSpec::grace`].
    pub grace: Option<String>,
    /// See [`RuleSpec::mode`].
    pub mode: Option<String>,
    /// See [`RuleSpec::max_outstanding`].
    pub max_outstanding: Option<u64>,
    /// See [`RuleSpec::on_failure`].
    pub on_failure: Option<String>,
    /// See [`RuleSpec::emergency_rate`].
    pub emergency_rate: Option<String>,
    /// See [`RuleSpec::timeout`].
    pub timeout: Option<String>,
    /// See [`RuleSpec::leasing`].
    pub leasing: Option<String>,
    /// See [`RuleSpec::term`].
    pub term: Option<String>,
    /// See [`RuleSpec::replicas`].
    pub replicas: Option<u64>,
    /// See [`RuleSpec::replica_timeout`].
    pub replica_timeout: Option<String>,
    /// See [`RuleSpec::shadow`].
    pub shadow: Option<bool>,
}

impl OverrideSpec {
    /// The rule's spec with this override's fields in place of the rule's (no overrides
    /// of its own).
    pub fn apply(&self, base: &RuleSpec) -> RuleSpec {
        fn pick<T: Clone>(o: &Option<T>, b: &Option<T>) -> Option<T> {
            o.clone().or_else(|| b.clone())
        }
        let capacity = self.capacity.unwrap_or(base.capacity);
        // Lease bounds inherited from a rule with a larger capacity shrink to fit this
        // one's; bounds the override sets itself are validated as they are.
        // An override that leases by rate inherits no lease bounds (a rate lease's burst
        // follows demand).
        let rated = self.leasing.as_deref() == Some("rate");
        let (lease_max, lease_min) = if rated {
            (self.lease_max, self.lease_min)
        } else {
            let max = self.lease_max.or(base.lease_max.map(|m| m.min(capacity)));
            let min = (self.lease_min).or(base.lease_min.map(|m| m.min(max.unwrap_or(capacity))));
            (max, min)
        };
        RuleSpec {
            capacity,
            rate: self.rate.clone().unwrap_or_else(|| base.rate.clone()),
            lease_min,
            lease_max,
            // A term belongs to rate leases and a lease ttl to token leases: an override
            // that switches between them does not inherit the other's.
            lease_ttl: if self.leasing.as_deref() == Some("rate") {
                self.lease_ttl.clone()
            } else {
                pick(&self.lease_ttl, &base.lease_ttl)
            },
            grace: pick(&self.grace, &base.grace),
            mode: pick(&self.mode, &base.mode),
            max_outstanding: pick(&self.max_outstanding, &base.max_outstanding),
            on_failure: pick(&self.on_failure, &base.on_failure),
            emergency_rate: pick(&self.emergency_rate, &base.emergency_rate),
            timeout: pick(&self.timeout, &base.timeout),
            leasing: pick(&self.leasing, &base.leasing),
            term: match self.leasing.as_deref() {
                Some(l) if l != "rate" => self.term.clone(),
                _ => pick(&self.term, &base.term),
            },
            replicas: pick(&self.replicas, &base.replicas),
            replica_timeout: pick(&self.replica_timeout, &base.replica_timeout),
            shadow: pick(&self.shadow, &base.shadow),
            scope: base.scope.clone(),
            partition_floor: base.partition_floor.clone(),
            local_percent: base.local_percent,
            local_agents: base.local_agents,
            weights: base.weights.clone(),
            overrides: BTreeMap::new(),
        }
    }
}

impl RuleSpec {
    /// A spec with capacity B and rate r (`"100/s"`), every optional field unset.
    pub fn new(capacity: u64, rate: impl Into<String>) -> Self {
        Self {
            capacity,
            rate: rate.into(),
            ..Self::default()
        }
    }
}

/// Replication a rule asks of each grant (`replicas` in its spec).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Replication {
    /// How many replicas must acknowledge the write.
    pub replicas: u32,
    /// How long to wait for them.
    pub timeout: Duration,
}

/// A validated rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rule {
    name: RuleName,
    capacity: NonZeroU64,
    rate: Rate,
    lease_min: NonZeroU64,
    lease_max: NonZeroU64,
    lease_ttl: Duration,
    grace: Duration,
    mode: Mode,
    failure: FailurePolicy,
    timeout: Duration,
    leasing: Leasing,
    replication: Option<Replication>,
    shadow: bool,
    scope: Scope,
    region_fed: Option<RegionParams>,
    /// One agent's seat of the local share, and the global part's rate (`r * (B - N * s)
    /// / B`), both worked out once, when the rule is validated.
    local: Option<(LocalShare, Rate)>,
}

/// Where a rule's bucket lives in a deployment in regions (`scope` in its spec).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Scope {
    /// One bucket per store: what a deployment without regions has.
    #[default]
    Single,
    /// One worldwide bucket in the home store; each region's agents use the region's
    /// bucket, fed by its broker (see [`crate::model::region`]).
    Global {
        /// What a region admits past its term: `None`, nothing.
        floor: Option<Rate>,
    },
    /// An independent bucket per region with `weight / sum` of B and r: no calls across
    /// regions, no coordination.
    Region {
        /// Region name to weight.
        weights: BTreeMap<String, u64>,
    },
}

/// The longest region name.
pub const MAX_REGION_NAME: usize = 64;

/// Whether `name` can name a region: 1 to [`MAX_REGION_NAME`] of `[A-Za-z0-9._-]`.
pub fn valid_region_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_REGION_NAME
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// The parameters of a rule that the global bucket needs, as integers; what the Lua
/// functions receive as arguments on every call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BucketParams {
    /// Capacity B.
    pub capacity: u64,
    /// Refill rate.
    pub rate: Rate,
    /// Lease lifetime, µs.
    pub lease_ttl_us: u64,
    /// Record grace after lease expiry, µs.
    pub grace_us: u64,
    /// How refill accounts for leased tokens.
    pub mode: Mode,
    /// Set when the bucket is one part of a split bucket (see [`crate::model::Split`]).
    pub part: Option<PartSeed>,
    /// Set when the bucket is a region's share of a global bucket (see
    /// [`crate::model::region`]): fed by its broker's deposits, never refilled at the rule's
    /// rate.
    pub region: Option<RegionParams>,
}

/// What a region's bucket of a global rule needs besides the rule: the rate it may admit
/// at, on its own, once its term is over and no deposit renewed it (`partition_floor`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RegionParams {
    /// The floor's rate. `None`: nothing (strict).
    pub floor: Option<Rate>,
    /// The floor's burst: a second of it, at least one token (0 without a floor).
    pub floor_burst: u64,
}

impl RegionParams {
    /// A region's bucket with `floor` (`None`: strict, nothing past the term).
    pub fn new(floor: Option<Rate>) -> Self {
        let floor_burst = floor.map_or(0, |f| {
            let per_sec = u128::from(f.tokens()) * 1_000_000 / u128::from(f.period_us());
            u64::try_from(per_sec).unwrap_or(u64::MAX).max(1)
        });
        Self { floor, floor_burst }
    }
}

/// What a part of a split bucket starts from, carried by every call to it so the part
/// needs nothing from its parent: its share of the parent's tokens, and a reservation of
/// its share of the parent's outstanding tokens until the parent's last lease ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PartSeed {
    /// The split this part belongs to (its start, server µs; never 0).
    pub gen_us: u64,
    /// The end of the split's term as the caller knows it; the part serves until then.
    pub until_us: u64,
    /// The part's share of the parent's tokens at the split.
    pub tokens: u64,
    /// The part's share of the parent's outstanding tokens at the split.
    pub outstanding: u64,
    /// When the parent's last lease record drops.
    pub drop_us: u64,
}

/// The most of a budget a local share may take: the store keeps at least a tenth.
const MAX_LOCAL_PERCENT: u64 = 90;
/// More seats than fleets have gateways: a typo, refused.
const MAX_LOCAL_AGENTS: u64 = 4096;

fn gcd128(mut a: u128, mut b: u128) -> u128 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a.max(1)
}

const MAX_LEASE_TTL: Duration = Duration::from_secs(3600);
/// The shortest term of a rate lease.
const MIN_TERM: Duration = Duration::from_millis(100);
const MAX_TIMEOUT: Duration = Duration::from_secs(60);
/// More replicas than any deployment has: a typo, refused.
const MAX_REPLICAS: u64 = 16;

impl Rule {
    /// A strict rule with capacity B and rate r, default lease bounds and policy.
    pub fn new(name: &str, capacity: u64, rate: &str) -> Result<Self, RuleError> {
        Self::from_spec(
            name,
            &RuleSpec {
                capacity,
                rate: rate.to_owned(),
                ..RuleSpec::default()
            },
        )
    }

    /// Validates a rule read from configuration (its overrides are validated with
    /// [`Rule::for_override`]).
    pub fn from_spec(name: &str, spec: &RuleSpec) -> Result<Self, RuleError> {
        let name = RuleName::new(name)?;
        let label = name.as_str().to_owned();
        Self::build(name, &label, spec)
    }

    /// Validates the override for `subject` (as written in the file) of the rule `name`
    /// with spec `base`: errors name the rule, the override and the field.
    pub fn for_override(
        name: &str,
        base: &RuleSpec,
        subject: &str,
        o: &OverrideSpec,
    ) -> Result<Self, RuleError> {
        let name = RuleName::new(name)?;
        let shown: String = subject.chars().take(80).collect();
        let label = format!("{name} override {shown:?}");
        Self::build(name, &label, &o.apply(base))
    }

    fn build(name: RuleName, label: &str, spec: &RuleSpec) -> Result<Self, RuleError> {
        let rule = || label.to_owned();
        let capacity = NonZeroU64::new(spec.capacity).ok_or_else(|| RuleError::Zero {
            rule: rule(),
            field: "capacity",
        })?;
        let rate: Rate = spec.rate.parse().map_err(|source| RuleError::Rate {
            field: "rate",
            rule: rule(),
            source,
        })?;
        // Keeps every product of the bucket arithmetic exact in Lua doubles: a rate whose
        // lowest terms are too fine for the capacity (86 401/day at B = 86 401: a period of
        // 86 400 s in µs) runs at the nearest rate below it that fits.
        let Some(rate) = rate.within_units(capacity.get(), MAX_BUCKET_UNITS) else {
            return Err(RuleError::Range {
                rule: rule(),
                field: "capacity",
                value: capacity.get(),
                why: format!(
                    "at most {} at rate {rate} (capacity x its refill period of {} µs must \
                     stay below 2^52, for exact arithmetic in the store)",
                    (MAX_BUCKET_UNITS - rate.tokens().min(MAX_BUCKET_UNITS)) / rate.period_us(),
                    rate.period_us(),
                ),
            });
        };
        let range = |field, value: u64, why: String| RuleError::Range {
            rule: rule(),
            field,
            value,
            why,
        };
        let lease_min = spec.lease_min.unwrap_or(1);
        let lease_max = spec
            .lease_max
            .unwrap_or((capacity.get() / 8).max(1).max(lease_min));
        if lease_max > capacity.get() {
            return Err(range(
                "lease_max",
                lease_max,
                format!("must be at most the capacity {capacity}"),
            ));
        }
        let lease_max = NonZeroU64::new(lease_max).ok_or_else(|| RuleError::Zero {
            rule: rule(),
            field: "lease_max",
        })?;
        let lease_min = NonZeroU64::new(lease_min).ok_or_else(|| RuleError::Zero {
            rule: rule(),
            field: "lease_min",
        })?;
        if lease_min > lease_max {
            return Err(range(
                "lease_min",
                lease_min.get(),
                format!("must be at most lease_max {lease_max}"),
            ));
        }
        let dur = |field: &'static str, text: &Option<String>, default: Duration, max: Duration| {
            let Some(text) = text else {
                return Ok(default);
            };
            let err = |why: String| RuleError::Duration {
                rule: rule(),
                field,
                value: text.clone(),
                why,
            };
            let d = parse_duration(text).map_err(|e| {
                // humantime's own example ("8sec") is not the spelling the docs use.
                let e = e.to_string();
                let e = e.split(", for example").next().unwrap_or(&e);
                err(format!("not a duration ({e}): write it as 4s, 500ms or 2m"))
            })?;
            // A term has its own least (why: below); one message for both ends.
            let min = if field == "term" {
                MIN_TERM
            } else {
                Duration::from_millis(1)
            };
            if d < min || d > max {
                let why = if field == "term" && d < min {
                    ": a rate lease is renewed at three quarters of its term, and a shorter \
                     one calls the store more often than leases of tokens do"
                } else if field == "term" {
                    ": a longer one would hold a crashed gateway's share that long"
                } else {
                    ""
                };
                return Err(err(format!(
                    "must be between {} and {}{why}",
                    humantime::format_duration(min),
                    humantime::format_duration(max)
                )));
            }
            Ok(d)
        };
        let lease_ttl = dur(
            "lease_ttl",
            &spec.lease_ttl,
            Duration::from_secs(5),
            MAX_LEASE_TTL,
        )?;
        let grace = dur("grace", &spec.grace, Duration::from_secs(1), MAX_LEASE_TTL)?;
        let timeout = dur(
            "timeout",
            &spec.timeout,
            Duration::from_millis(50),
            MAX_TIMEOUT,
        )?;
        let choice = |field, value: &str, choices| RuleError::Choice {
            rule: rule(),
            field,
            value: value.to_owned(),
            choices,
        };
        let mode = match spec.mode.as_deref().unwrap_or("strict") {
            "strict" => {
                if let Some(v) = spec.max_outstanding {
                    return Err(range(
                        "max_outstanding",
                        v,
                        "only applies with mode = \"relaxed\"".into(),
                    ));
                }
                Mode::Strict
            }
            "relaxed" => {
                let v = spec.max_outstanding.unwrap_or((capacity.get() / 4).max(1));
                if v > MAX_EXACT / 2 {
                    return Err(range("max_outstanding", v, "must stay below 2^52".into()));
                }
                Mode::Relaxed {
                    max_outstanding: NonZeroU64::new(v).ok_or_else(|| RuleError::Zero {
                        rule: rule(),
                        field: "max_outstanding",
                    })?,
                }
            }
            other => return Err(choice("mode", other, "strict, relaxed")),
        };
        let failure = match spec.on_failure.as_deref().unwrap_or("fail_closed") {
            "fail_open" => FailurePolicy::FailOpen,
            "fail_closed" => FailurePolicy::FailClosed,
            "local_emergency" => FailurePolicy::LocalEmergency {
                rate: spec
                    .emergency_rate
                    .as_deref()
                    .map(str::parse)
                    .transpose()
                    .map_err(|source| RuleError::Rate {
                        rule: rule(),
                        field: "emergency_rate",
                        source,
                    })?,
            },
            other => {
                return Err(choice(
                    "on_failure",
                    other,
                    "fail_open, fail_closed, local_emergency",
                ));
            }
        };
        let leasing = match spec.leasing.as_deref().unwrap_or("auto") {
            "auto" => Leasing::Auto,
            "lease" => Leasing::Lease,
            "exact" => Leasing::Exact,
            "rate" => Leasing::Rate,
            other => return Err(choice("leasing", other, "auto, lease, exact, rate")),
        };
        let conflict = |field, value: String, why| RuleError::Conflict {
            rule: rule(),
            field,
            value,
            why,
        };
        let lease_ttl = if leasing == Leasing::Rate {
            if let Some(t) = &spec.lease_ttl {
                return Err(conflict(
                    "lease_ttl",
                    t.clone(),
                    "a rate lease runs for its term: set term instead",
                ));
            }
            for (field, v) in [("lease_min", spec.lease_min), ("lease_max", spec.lease_max)] {
                if let Some(v) = v {
                    return Err(conflict(
                        field,
                        v.to_string(),
                        "a rate lease's burst follows the agent's demand: lease_min and \
                         lease_max apply to leasing = \"lease\" or \"auto\" only",
                    ));
                }
            }
            if let Mode::Relaxed { .. } = mode {
                return Err(conflict(
                    "mode",
                    "relaxed".into(),
                    "rate leases count their bursts as outstanding: strict mode only",
                ));
            }
            let (n, per) = (u128::from(rate.tokens()), u128::from(rate.period_us()));
            if u128::from(capacity.get()) * per * 1000 + n * 1000 > u128::from(MAX_EXACT) {
                // (B × period_us + tokens) × 1000 within MAX_EXACT: model::rate_scale.
                let most = (u128::from(MAX_EXACT) / 1000).saturating_sub(n) / per.max(1);
                return Err(range(
                    "capacity",
                    capacity.get(),
                    format!(
                        "with leasing = \"rate\" and rate {rate}, at most {most} (the \
                         store counts a share of the rate to a thousandth of a token per \
                         {per} µs, exactly); lower the capacity, or use leasing = \"lease\""
                    ),
                ));
            }
            dur("term", &spec.term, Duration::from_secs(8), MAX_LEASE_TTL)?
        } else {
            if let Some(t) = &spec.term {
                return Err(conflict(
                    "term",
                    t.clone(),
                    "applies only with leasing = \"rate\"",
                ));
            }
            lease_ttl
        };
        if spec.emergency_rate.is_some() && !matches!(failure, FailurePolicy::LocalEmergency { .. })
        {
            return Err(RuleError::Conflict {
                rule: rule(),
                field: "emergency_rate",
                value: spec.emergency_rate.clone().unwrap_or_default(),
                why: "applies only with on_failure = \"local_emergency\"",
            });
        }
        let replication = match spec.replicas {
            None | Some(0) => {
                if let Some(t) = &spec.replica_timeout {
                    return Err(RuleError::Conflict {
                        rule: rule(),
                        field: "replica_timeout",
                        value: t.clone(),
                        why: "applies only with replicas = 1 or more",
                    });
                }
                None
            }
            Some(n) if n > MAX_REPLICAS => {
                return Err(range(
                    "replicas",
                    n,
                    format!("must be at most {MAX_REPLICAS}"),
                ));
            }
            Some(n) => {
                let t = dur(
                    "replica_timeout",
                    &spec.replica_timeout,
                    Duration::from_millis(5).min(timeout / 2),
                    MAX_TIMEOUT,
                )?;
                if t >= timeout {
                    return Err(RuleError::Duration {
                        rule: rule(),
                        field: "replica_timeout",
                        value: spec.replica_timeout.clone().unwrap_or_default(),
                        why: format!(
                            "must be shorter than the rule's timeout ({})",
                            humantime::format_duration(timeout)
                        ),
                    });
                }
                Some(Replication {
                    replicas: n as u32,
                    timeout: t,
                })
            }
        };
        let scope = Self::scope_of(label, spec, rate)?;
        let local = Self::local_of(label, spec, capacity, rate, &scope)?;
        if leasing == Leasing::Rate {
            if let Scope::Global { .. } = scope {
                return Err(conflict(
                    "scope",
                    "global".into(),
                    "a region's bucket is fed by its broker's deposits, not leased by rate: \
                     drop scope (one store) or use leasing = \"auto\" or \"lease\"",
                ));
            }
            if let Some(p) = spec.local_percent {
                return Err(conflict(
                    "local_percent",
                    p.to_string(),
                    "a rate lease is already spent locally: no local share with it",
                ));
            }
        }
        Ok(Self {
            scope,
            local,
            region_fed: None,
            replication,
            shadow: spec.shadow.unwrap_or(false),
            name,
            capacity,
            rate,
            lease_min,
            lease_max,
            lease_ttl,
            grace,
            mode,
            failure,
            timeout,
            leasing,
        })
    }

    /// The seat of a rule's local share and the global part's rate, validated (see
    /// [`crate::local`]).
    fn local_of(
        label: &str,
        spec: &RuleSpec,
        capacity: NonZeroU64,
        rate: Rate,
        scope: &Scope,
    ) -> Result<Option<(LocalShare, Rate)>, RuleError> {
        let range = |field, value: u64, why: String| RuleError::Range {
            rule: label.to_owned(),
            field,
            value,
            why,
        };
        let (percent, agents) = match (spec.local_percent, spec.local_agents) {
            (None, None) => return Ok(None),
            (Some(p), Some(n)) => (p, n),
            (Some(p), None) => {
                return Err(range("local_percent", p, "needs local_agents".into()));
            }
            (None, Some(n)) => {
                return Err(range("local_agents", n, "needs local_percent".into()));
            }
        };
        if !(1..=MAX_LOCAL_PERCENT).contains(&percent) {
            return Err(range(
                "local_percent",
                percent,
                format!("must be 1 to {MAX_LOCAL_PERCENT}"),
            ));
        }
        if !(1..=MAX_LOCAL_AGENTS).contains(&agents) {
            return Err(range(
                "local_agents",
                agents,
                format!("must be 1 to {MAX_LOCAL_AGENTS}"),
            ));
        }
        if !matches!(scope, Scope::Single) {
            return Err(RuleError::Conflict {
                rule: label.to_owned(),
                field: "local_percent",
                value: percent.to_string(),
                why: "does not combine with scope (regions share the budget already)",
            });
        }
        let b = capacity.get();
        let seat = u128::from(b) * u128::from(percent) / 100 / u128::from(agents);
        let Some(seat) = u64::try_from(seat).ok().and_then(NonZeroU64::new) else {
            return Err(range(
                "local_agents",
                agents,
                format!(
                    "{percent}% of capacity {b} over {agents} agents leaves each less than one token; raise local_percent or the capacity, or lower local_agents"
                ),
            ));
        };
        let part = |tokens: u64| {
            // r * tokens / B, in lowest terms.
            let num = u128::from(rate.tokens()) * u128::from(tokens);
            let den = u128::from(rate.period_us()) * u128::from(b);
            let g = gcd128(num, den);
            let (num, den) = (num / g, den / g);
            let ok = u64::try_from(num).ok().and_then(NonZeroU64::new);
            let per = u64::try_from(den).ok().filter(|&d| d <= MAX_PERIOD_US);
            let r = match (ok, per) {
                (Some(n), Some(d)) => Rate::new(n, Duration::from_micros(d)).ok(),
                _ => None,
            };
            r.filter(|r| r.fits_units(tokens, MAX_BUCKET_UNITS))
        };
        let (Some(seat_rate), Some(global_rate)) =
            (part(seat.get()), part(b - seat.get() * agents))
        else {
            return Err(range(
                "local_percent",
                percent,
                format!(
                    "a seat's share of rate {rate} (capacity {b}) is too fine to represent; use a shorter rate period"
                ),
            ));
        };
        let share = LocalShare {
            agents: agents as u32,
            percent: percent as u8,
            capacity: seat,
            rate: seat_rate,
        };
        Ok(Some((share, global_rate)))
    }

    /// One agent's seat of the rule's local share, if it has one.
    pub fn local(&self) -> Option<LocalShare> {
        self.local.map(|(share, _)| share)
    }

    /// The rule as the store keeps it: without a local share, the rule itself; with one,
    /// what the seats leave, `B - N * s` tokens at `r * (B - N * s) / B`, lease bounds
    /// within it (see [`crate::local`]).
    pub fn global_part(&self) -> Rule {
        let Some((l, rate)) = self.local else {
            return self.clone();
        };
        let left = self.capacity.get() - l.capacity.get() * u64::from(l.agents);
        // `local_of` keeps at least a tenth of B in the global part.
        let capacity = NonZeroU64::new(left).unwrap_or(NonZeroU64::MIN);
        let lease_max = self.lease_max.min(capacity);
        Rule {
            capacity,
            rate,
            lease_max,
            lease_min: self.lease_min.min(lease_max),
            local: None,
            ..self.clone()
        }
    }

    fn scope_of(label: &str, spec: &RuleSpec, rate: Rate) -> Result<Scope, RuleError> {
        let conflict = |field, value: String, why| RuleError::Conflict {
            rule: label.to_owned(),
            field,
            value,
            why,
        };
        let scope = spec.scope.as_deref();
        if let Some(f) = &spec.partition_floor
            && scope != Some("global")
        {
            return Err(conflict(
                "partition_floor",
                f.clone(),
                "applies only with scope = \"global\"",
            ));
        }
        if !spec.weights.is_empty() && scope != Some("region") {
            return Err(conflict(
                "weights",
                format!("{:?}", spec.weights),
                "applies only with scope = \"region\"",
            ));
        }
        match scope {
            None => Ok(Scope::Single),
            Some("global") => {
                let floor = spec
                    .partition_floor
                    .as_deref()
                    .map(str::parse::<Rate>)
                    .transpose()
                    .map_err(|source| RuleError::Rate {
                        rule: label.to_owned(),
                        field: "partition_floor",
                        source,
                    })?;
                if let Some(f) = floor
                    && u128::from(f.tokens()) * u128::from(rate.period_us())
                        > u128::from(rate.tokens()) * u128::from(f.period_us())
                {
                    return Err(conflict(
                        "partition_floor",
                        spec.partition_floor.clone().unwrap_or_default(),
                        "must not exceed the rule's rate",
                    ));
                }
                Ok(Scope::Global { floor })
            }
            Some("region") => {
                if spec.weights.is_empty() {
                    return Err(conflict(
                        "scope",
                        "region".into(),
                        "needs weights, e.g. weights = { eu = 2, us = 1 }",
                    ));
                }
                for (name, w) in &spec.weights {
                    if !valid_region_name(name) || *w == 0 || *w > 1_000_000 {
                        return Err(RuleError::Range {
                            rule: label.to_owned(),
                            field: "weights",
                            value: *w,
                            why: format!(
                                "region {name:?}: names are 1 to {MAX_REGION_NAME} of [A-Za-z0-9._-], weights 1 to 1000000"
                            ),
                        });
                    }
                }
                Ok(Scope::Region {
                    weights: spec.weights.clone(),
                })
            }
            Some(other) => Err(RuleError::Choice {
                rule: label.to_owned(),
                field: "scope",
                value: other.to_owned(),
                choices: "global, region",
            }),
        }
    }

    /// Where the rule's bucket lives in a deployment in regions.
    pub fn scope(&self) -> &Scope {
        &self.scope
    }

    /// The rule as agents of `region` use it (`None`: no regions, the rule itself). Scope
    /// global: the same rule on the region's bucket of each key (its bucket parameters
    /// carry the floor; see [`Rule::region_fed`]). Scope region: the region's share of the
    /// capacity and the rate, lease bounds within it. An error names what does not fit: a
    /// region the rule gives no weight, or a share too small or too fine to represent.
    pub fn in_region(&self, region: Option<&str>) -> Result<Rule, String> {
        let Some(region) = region else {
            return Ok(self.clone());
        };
        let name = &self.name;
        match &self.scope {
            Scope::Single => Ok(self.clone()),
            Scope::Global { floor } => Ok(Rule {
                region_fed: Some(RegionParams::new(*floor)),
                ..self.clone()
            }),
            Scope::Region { weights } => {
                let w = *weights.get(region).ok_or_else(|| {
                    format!("rule {name}: scope = \"region\" gives region {region:?} no weight")
                })?;
                let total: u64 = weights.values().sum();
                let capacity = u64::try_from(
                    u128::from(self.capacity.get()) * u128::from(w) / u128::from(total),
                )
                .ok()
                .and_then(NonZeroU64::new);
                let tokens = NonZeroU64::new(self.rate.tokens().saturating_mul(w));
                let period = self.rate.period_us().checked_mul(total);
                let rate = match (tokens, period) {
                    (Some(t), Some(per)) => Rate::new(t, Duration::from_micros(per)).ok(),
                    _ => None,
                };
                let (Some(capacity), Some(rate)) = (capacity, rate) else {
                    return Err(format!(
                        "rule {name}: region {region:?}'s share ({w} of {total}) of capacity {} and rate {:.3}/s is too small to represent",
                        self.capacity,
                        self.rate.per_sec_f64()
                    ));
                };
                if !rate.fits_units(capacity.get(), MAX_BUCKET_UNITS) {
                    return Err(format!(
                        "rule {name}: region {region:?}'s share needs a shorter rate period"
                    ));
                }
                let lease_max = self.lease_max.min(capacity);
                Ok(Rule {
                    capacity,
                    rate,
                    lease_max,
                    lease_min: self.lease_min.min(lease_max),
                    ..self.clone()
                })
            }
        }
    }

    /// Set on a rule of global scope as a region uses it ([`Rule::in_region`]): its keys
    /// are the regions' buckets ([`crate::BucketKey::region_of`]), with these parameters.
    pub fn region_fed(&self) -> Option<RegionParams> {
        self.region_fed
    }

    /// The rule's name.
    pub fn name(&self) -> &RuleName {
        &self.name
    }
    /// Capacity B.
    pub fn capacity(&self) -> NonZeroU64 {
        self.capacity
    }
    /// Refill rate r.
    pub fn rate(&self) -> Rate {
        self.rate
    }
    /// Smallest lease asked for.
    pub fn lease_min(&self) -> NonZeroU64 {
        self.lease_min
    }
    /// Largest lease asked for.
    pub fn lease_max(&self) -> NonZeroU64 {
        self.lease_max
    }
    /// Lease lifetime.
    pub fn lease_ttl(&self) -> Duration {
        self.lease_ttl
    }
    /// How long the store remembers an agent after its lease expired.
    pub fn grace(&self) -> Duration {
        self.grace
    }
    /// Strict or relaxed refill.
    pub fn mode(&self) -> Mode {
        self.mode
    }
    /// What to do when the store is unreachable.
    pub fn failure_policy(&self) -> FailurePolicy {
        self.failure
    }
    /// How long a decision may wait for the store.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }
    /// Lease or per-request calls.
    pub fn leasing(&self) -> Leasing {
        self.leasing
    }
    /// The replication each grant waits for, if the rule asks for any.
    pub fn replication(&self) -> Option<Replication> {
        self.replication
    }

    /// Decisions are counted but never enforced.
    pub fn shadow(&self) -> bool {
        self.shadow
    }

    /// The integers the global bucket works with (with a local share, its global part's:
    /// see [`Rule::global_part`]).
    pub fn bucket_params(&self) -> BucketParams {
        if self.local.is_some() {
            return self.global_part().bucket_params();
        }
        BucketParams {
            capacity: self.capacity.get(),
            rate: self.rate,
            lease_ttl_us: self.lease_ttl.as_micros() as u64,
            grace_us: self.grace.as_micros() as u64,
            mode: self.mode,
            part: None,
            region: self.region_fed,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(capacity: u64, rate: &str) -> RuleSpec {
        RuleSpec {
            capacity,
            rate: rate.into(),
            ..RuleSpec::default()
        }
    }

    #[test]
    fn defaults_are_strict_and_fail_closed() {
        let r = Rule::new("api.write", 100, "10/s").unwrap();
        assert_eq!(r.mode(), Mode::Strict);
        assert_eq!(r.failure_policy(), FailurePolicy::FailClosed);
        assert_eq!(r.lease_max().get(), 12);
        assert_eq!(r.bucket_params().mode, Mode::Strict);
    }

    /// envoyproxy/ratelimit's `requests_per_unit: 86401, unit: day` (capacity 86 401, a
    /// rate whose lowest terms need the day in µs) loads, a hair under the rate asked.
    #[test]
    fn a_day_limit_that_does_not_divide_the_day_loads_a_hair_under() {
        for (n, per) in [
            (86_401u64, "86400s"),
            (100_001, "2592000s"),
            (1_234_567, "86400s"),
        ] {
            let r = Rule::from_spec("a", &spec(n, &format!("{n}/{per}"))).unwrap();
            let asked: Rate = format!("{n}/{per}").parse().unwrap();
            let (got, want) = (r.rate().per_sec_f64(), asked.per_sec_f64());
            assert!(
                got <= want && got > want * 0.999,
                "{n}/{per}: {got} against {want}"
            );
            assert!(
                u128::from(n) * u128::from(r.rate().period_us()) + u128::from(r.rate().tokens())
                    <= u128::from(MAX_BUCKET_UNITS)
            );
        }
    }

    #[test]
    fn errors_name_the_field_and_value() {
        let mut s = spec(10, "1/s");
        s.emergency_rate = Some("5/s".into());
        let e = Rule::from_spec("a", &s).unwrap_err().to_string();
        assert_eq!(
            e,
            "rule a: emergency_rate = \"5/s\": applies only with on_failure = \"local_emergency\""
        );
        let mut s = spec(10, "1/s");
        s.on_failure = Some("local_emergency".into());
        s.emergency_rate = Some("fast".into());
        let e = Rule::from_spec("a", &s).unwrap_err().to_string();
        assert!(e.starts_with("rule a: emergency_rate: "), "{e}");
        let e = Rule::from_spec("a", &spec(0, "1/s"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("capacity") && e.contains("rule a"), "{e}");
        let e = Rule::from_spec("a", &spec(10, "0/s"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("rate"), "{e}");
        let e = Rule::from_spec("a b", &spec(10, "1/s"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("\"a b\""), "{e}");
        let mut s = spec(10, "1/s");
        s.lease_max = Some(11);
        let e = Rule::from_spec("a", &s).unwrap_err().to_string();
        assert!(e.contains("lease_max = 11"), "{e}");
        let mut s = spec(10, "1/s");
        s.lease_ttl = Some("forever".into());
        let e = Rule::from_spec("a", &s).unwrap_err().to_string();
        assert!(e.contains("lease_ttl") && e.contains("forever"), "{e}");
        let mut s = spec(10, "1/s");
        s.on_failure = Some("shrug".into());
        let e = Rule::from_spec("a", &s).unwrap_err().to_string();
        assert!(e.contains("on_failure") && e.contains("fail_open"), "{e}");
        // 1 token a day with a billion capacity overflows Lua's exact integers.
        let e = Rule::from_spec("a", &spec(1_000_000_000, "1/1d"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("2^52"), "{e}");
    }

    #[test]
    fn relaxed_mode_carries_its_cap() {
        let mut s = spec(100, "10/s");
        s.mode = Some("relaxed".into());
        s.max_outstanding = Some(30);
        let r = Rule::from_spec("a", &s).unwrap();
        assert_eq!(
            r.bucket_params().mode,
            Mode::Relaxed {
                max_outstanding: NonZeroU64::new(30).unwrap()
            }
        );
        let mut s = spec(100, "10/s");
        s.max_outstanding = Some(30);
        assert!(Rule::from_spec("a", &s).is_err());
    }

    #[test]
    fn replicas_wait_within_the_timeout() {
        assert_eq!(Rule::new("a", 10, "1/s").unwrap().replication(), None);
        let mut s = spec(10, "1/s");
        s.replicas = Some(1);
        let r = Rule::from_spec("a", &s).unwrap().replication().unwrap();
        assert_eq!((r.replicas, r.timeout), (1, Duration::from_millis(5)));
        s.replica_timeout = Some("50ms".into());
        let e = Rule::from_spec("a", &s).unwrap_err().to_string();
        assert!(
            e.contains("replica_timeout") && e.contains("shorter than the rule's timeout (50ms)"),
            "{e}"
        );
        s.replicas = Some(17);
        let e = Rule::from_spec("a", &s).unwrap_err().to_string();
        assert!(e.contains("replicas = 17"), "{e}");
        s.replicas = None;
        let e = Rule::from_spec("a", &s).unwrap_err().to_string();
        assert!(
            e.contains("replica_timeout") && e.contains("replicas = 1 or more"),
            "{e}"
        );
    }

    #[test]
    fn a_capacity_past_exact_arithmetic_is_refused_with_the_largest_allowed() {
        let spec = RuleSpec::new(9_007_199_254_740_992, "20000/s");
        let e = Rule::from_spec("a", &spec).unwrap_err().to_string();
        assert!(e.contains("at most 90071992547409 at rate 20000/s"), "{e}");
        let ok = RuleSpec::new(90_071_992_547_409, "20000/s");
        assert!(Rule::from_spec("a", &ok).is_ok());
        let over = RuleSpec::new(90_071_992_547_410, "20000/s");
        assert!(Rule::from_spec("a", &over).is_err());
    }

    #[test]
    fn rate_leasing_takes_a_term_and_refuses_what_it_cannot_keep() {
        let mut r = spec(20_000, "20000/s");
        r.leasing = Some("rate".into());
        let rule = Rule::from_spec("r", &r).unwrap();
        assert_eq!(rule.leasing(), Leasing::Rate);
        assert_eq!(rule.lease_ttl(), Duration::from_secs(8), "the default term");
        r.term = Some("2s".into());
        assert_eq!(
            Rule::from_spec("r", &r)
                .unwrap()
                .bucket_params()
                .lease_ttl_us,
            2_000_000
        );
        let refused = |s: &RuleSpec, want: &str| {
            let e = Rule::from_spec("r", s).unwrap_err().to_string();
            assert!(e.contains(want), "{e}");
        };
        let mut t = r.clone();
        t.lease_ttl = Some("5s".into());
        refused(&t, "set term instead");
        let mut t = r.clone();
        t.lease_max = Some(100);
        refused(&t, "lease_max apply to leasing");
        let mut t = r.clone();
        t.mode = Some("relaxed".into());
        refused(&t, "strict mode only");
        let mut t = r.clone();
        // The same message whatever side of the least, or zero.
        for short in ["50ms", "0s"] {
            t.term = Some(short.into());
            refused(&t, "must be between 100ms and 1h: a rate lease is renewed");
        }
        t.term = Some("2h".into());
        refused(&t, "must be between 100ms and 1h: a longer one would hold");
        t.term = Some("abc".into());
        refused(&t, "write it as 4s, 500ms or 2m");
        // humantime's own example spelling ("8sec") is left out.
        t.term = Some("8".into());
        refused(&t, "not a duration (time unit needed): write it as 4s");
        let mut t = r.clone();
        t.local_percent = Some(50);
        t.local_agents = Some(4);
        refused(&t, "local_percent");
        let mut t = spec(10, "1/s");
        t.term = Some("4s".into());
        refused(&t, "applies only with leasing = \"rate\"");
        // A bucket whose refill at part of its rate cannot stay exact in Redis.
        let mut t = spec(10_000, "1/h");
        t.leasing = Some("rate".into());
        refused(&t, "at most 2501");
        // An override that leases tokens does not inherit the rule's term, and one that
        // leases by rate does not inherit its lease ttl.
        let o = OverrideSpec {
            leasing: Some("lease".into()),
            ..OverrideSpec::default()
        };
        let leased = Rule::from_spec("o", &o.apply(&r)).unwrap();
        assert_eq!(leased.leasing(), Leasing::Lease);
        let mut lease = spec(100, "10/s");
        lease.lease_ttl = Some("2s".into());
        lease.lease_max = Some(50);
        lease.lease_min = Some(5);
        let o = OverrideSpec {
            leasing: Some("rate".into()),
            ..OverrideSpec::default()
        };
        let rated = Rule::from_spec("o", &o.apply(&lease)).unwrap();
        assert_eq!(rated.leasing(), Leasing::Rate);
    }

    #[test]
    fn scopes_for_regions_are_validated_and_mapped() {
        // No scope: every region sees the rule as it is.
        let plain = Rule::from_spec("a", &spec(100, "10/s")).unwrap();
        assert_eq!(plain.in_region(Some("eu")).unwrap(), plain);
        // Global: the region's bucket, with its floor.
        let mut g = spec(100, "10/s");
        g.scope = Some("global".into());
        g.partition_floor = Some("2/s".into());
        let r = Rule::from_spec("g", &g)
            .unwrap()
            .in_region(Some("eu"))
            .unwrap();
        let p = r.bucket_params();
        let floor = p.region.and_then(|x| x.floor).unwrap();
        assert_eq!(
            (floor.tokens(), floor.period_us(), p.capacity),
            (1, 500_000, 100)
        );
        assert!(
            Rule::from_spec("g", &g)
                .unwrap()
                .in_region(None)
                .unwrap()
                .region_fed()
                .is_none()
        );
        // Region: the region's share, lease bounds within it.
        let mut w = spec(90, "30/s");
        w.scope = Some("region".into());
        w.weights = [("eu".to_owned(), 2), ("us".to_owned(), 1)].into();
        let rule = Rule::from_spec("w", &w).unwrap();
        let eu = rule.in_region(Some("eu")).unwrap();
        assert_eq!(eu.capacity().get(), 60);
        assert!((eu.rate().per_sec_f64() - 20.0).abs() < 1e-9);
        assert!(eu.lease_max().get() <= 60 && eu.region_fed().is_none());
        let e = rule.in_region(Some("ap")).unwrap_err();
        assert!(e.contains("\"ap\"") && e.contains("no weight"), "{e}");
        // Fields that do not fit the scope, and scopes that miss what they need.
        let refused = |s: RuleSpec, want: &str| {
            let e = Rule::from_spec("x", &s).unwrap_err().to_string();
            assert!(e.contains(want), "{e}");
        };
        let mut f = spec(10, "1/s");
        f.partition_floor = Some("1/s".into());
        refused(f, "partition_floor");
        let mut f = spec(10, "1/s");
        f.scope = Some("global".into());
        f.partition_floor = Some("5/s".into());
        refused(f, "must not exceed the rule's rate");
        let mut f = spec(10, "1/s");
        f.scope = Some("region".into());
        refused(f, "needs weights");
        let mut f = spec(10, "1/s");
        f.weights = [("eu".to_owned(), 1)].into();
        refused(f, "weights");
        let mut f = spec(10, "1/s");
        f.scope = Some("planet".into());
        refused(f, "global, region");
        let mut f = spec(10, "1/s");
        f.scope = Some("region".into());
        f.weights = [("e u".to_owned(), 1)].into();
        refused(f, "region \"e u\"");
    }
}
