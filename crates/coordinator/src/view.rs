//! An operator's view of one bucket, from the fields of its Redis hash (see
//! `lua/leasehold.lua` and `leasehold_core::model` for what each field means).

use std::collections::{BTreeMap, HashMap};

use leasehold_core::key::BucketKey;
use leasehold_core::rule::Rule;
use leasehold_core::schema;
use serde::Serialize;

/// One agent's record in a bucket.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[non_exhaustive]
pub struct AgentView {
    /// The agent instance.
    pub id: String,
    /// Tokens it may hold (its last report plus what it was granted since).
    pub held: u64,
    /// Its last reported demand for this key, tokens per second.
    pub demand_per_sec: f64,
    /// Its fraction of the key's reported demand (live agents; equal when none reported).
    pub share: f64,
    /// With a rate lease: the rate it was granted, tokens per second (its `held` is then
    /// its burst).
    pub leased_per_sec: Option<f64>,
    /// True while the record counts (its lease or grace has not run out).
    pub live: bool,
    /// Milliseconds until the record stops counting (negative: already past).
    pub drops_in_ms: i64,
    /// Its last sequence number.
    pub seq: u64,
}

/// What a bucket holds.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[non_exhaustive]
pub struct KeyView {
    /// The Redis key.
    pub key: String,
    /// The rule.
    pub rule: String,
    /// Capacity B.
    pub capacity: u64,
    /// Refill rate r, tokens per second.
    pub rate_per_sec: f64,
    /// True when the key does not exist: the bucket is full and nobody holds a lease.
    pub absent: bool,
    /// Tokens in the bucket at its last update.
    pub tokens: u64,
    /// Tokens leased to agents and not reported spent or returned (with rate leases, their
    /// bursts too).
    pub outstanding: u64,
    /// The rate the rate leases hold, tokens per second: the bucket refills at the rest.
    pub rate_leased_per_sec: f64,
    /// How many agents hold a rate lease on the key.
    pub rate_leases: u64,
    /// Server time of the last update, µs.
    pub updated_us: u64,
    /// Milliseconds until Redis drops the key (when it would be full and leaseless).
    pub expires_in_ms: Option<i64>,
    /// The agents, by id.
    pub agents: Vec<AgentView>,
    /// The split in force, if any.
    pub split: Option<SplitView>,
    /// The coordinator's accounting of the key (admitted, calls, overshoot), when it has
    /// seen agents report it.
    pub accounting: Option<crate::accounting::KeyStats>,
}

/// A split as the admin endpoint shows it.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[non_exhaustive]
pub struct SplitView {
    /// Number of parts.
    pub parts: u64,
    /// The parts' keys.
    pub keys: Vec<String>,
    /// Milliseconds until the term ends unless extended.
    pub ends_in_ms: i64,
}

impl SplitView {
    /// The view of a split of `key` with `parts` and `salt` ending at `until_us`.
    pub fn new(key: &BucketKey, parts: u64, salt: u64, until_us: u64, now_us: u64) -> Self {
        Self {
            parts,
            keys: (0..parts)
                .map(|i| key.part_of(salt, i).as_str().to_owned())
                .collect(),
            ends_in_ms: (until_us as i64 - now_us as i64) / 1000,
        }
    }
}

/// A rate-lease share, counted in `1/unit` tokens per µs, in tokens per second.
fn per_sec(share: u64, unit: u64) -> f64 {
    if unit == 0 {
        0.0
    } else {
        share as f64 * 1e6 / unit as f64
    }
}

fn num(fields: &HashMap<String, String>, name: &str) -> u64 {
    fields.get(name).and_then(|v| v.parse().ok()).unwrap_or(0)
}

/// Builds the view of `key` under `rule` from its hash `fields`, its `pttl_ms` (-2 when
/// absent) and the server time `now_us`.
pub fn key_view(
    key: &BucketKey,
    rule: &Rule,
    fields: &HashMap<String, String>,
    pttl_ms: i64,
    now_us: u64,
) -> KeyView {
    // The bucket the store keeps: with a local share, the rule's global part.
    let rule = &rule.global_part();
    let mut agents: BTreeMap<&str, AgentView> = BTreeMap::new();
    for (name, value) in fields {
        let Some((id, field)) = name.split_once(':') else {
            continue;
        };
        let a = agents.entry(id).or_insert_with(|| AgentView {
            id: id.to_owned(),
            held: 0,
            demand_per_sec: 0.0,
            share: 0.0,
            leased_per_sec: None,
            live: false,
            drops_in_ms: 0,
            seq: 0,
        });
        let v: u64 = value.parse().unwrap_or(0);
        match field {
            "h" => a.held = v,
            "d" => a.demand_per_sec = v as f64 / 1000.0,
            "s" => a.seq = v,
            "q" => a.leased_per_sec = Some(per_sec(v, num(fields, schema::SHARE_UNIT))),
            "x" => {
                a.live = v > now_us;
                a.drops_in_ms = (v as i64 - now_us as i64) / 1000;
            }
            _ => {}
        }
    }
    let mut agents: Vec<AgentView> = agents.into_values().collect();
    let live = agents.iter().filter(|a| a.live).count();
    let demand: f64 = agents
        .iter()
        .filter(|a| a.live)
        .map(|a| a.demand_per_sec)
        .sum();
    for a in agents.iter_mut().filter(|a| a.live) {
        a.share = if demand > 0.0 {
            a.demand_per_sec / demand
        } else {
            1.0 / live as f64
        };
    }
    KeyView {
        key: key.as_str().to_owned(),
        rule: rule.name().as_str().to_owned(),
        capacity: rule.capacity().get(),
        rate_per_sec: rule.rate().per_sec_f64(),
        absent: fields.is_empty(),
        tokens: if fields.is_empty() {
            rule.capacity().get()
        } else {
            num(fields, schema::TOKENS)
        },
        outstanding: num(fields, schema::OUTSTANDING),
        rate_leased_per_sec: per_sec(num(fields, schema::SHARED), num(fields, schema::SHARE_UNIT)),
        rate_leases: num(fields, schema::SHARE_RECORDS),
        updated_us: num(fields, schema::UPDATED),
        expires_in_ms: (pttl_ms >= 0).then_some(pttl_ms),
        agents,
        split: leasehold_store::wire::decode_split(
            fields.get(schema::SPLIT).map(String::as_str),
            num(fields, schema::SPLIT_GEN),
        )
        .filter(|s| s.until_us > now_us)
        .map(|s| SplitView::new(key, s.parts, s.salt, s.until_us, now_us)),
        accounting: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use leasehold_core::rule::RuleName;

    #[test]
    fn shares_follow_reported_demand_among_live_agents() {
        let rule = Rule::new("api", 100, "10/s").unwrap();
        let key = BucketKey::new(&RuleName::new("api").unwrap(), "t").unwrap();
        let now = 1_000_000_000;
        let mut f = HashMap::new();
        for (k, v) in [
            ("tok", "40"),
            ("out", "30"),
            ("ts", "999000000"),
            ("00a:h", "10"),
            ("00a:d", "1000"),
            ("00a:x", "1002000000"),
            ("00b:h", "20"),
            ("00b:d", "3000"),
            ("00b:x", "1001000000"),
            ("00c:h", "0"),
            ("00c:d", "9000"),
            ("00c:x", "999999999"),
        ] {
            f.insert(k.to_owned(), v.to_owned());
        }
        let v = key_view(&key, &rule, &f, 1234, now);
        assert_eq!(
            (v.tokens, v.outstanding, v.expires_in_ms),
            (40, 30, Some(1234))
        );
        let share: Vec<f64> = v.agents.iter().map(|a| a.share).collect();
        assert_eq!(
            share,
            vec![0.25, 0.75, 0.0],
            "the dead agent's demand does not count"
        );
        assert!(!v.agents[2].live && v.agents[0].drops_in_ms == 2000);
        let empty = key_view(&key, &rule, &HashMap::new(), -2, now);
        assert!(empty.absent && empty.tokens == 100 && empty.expires_in_ms.is_none());
    }
}
