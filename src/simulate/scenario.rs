//! Scenarios: the workload `leasehold simulate` runs, built in or read from a TOML file.
//! The format, every field and fault, and how the table reads: docs/scenarios.md.

use serde::{Deserialize, Serialize};

use std::time::Duration;

use leasehold::agent::LimiterConfig;
use leasehold::core::rate::parse_duration;
use leasehold::core::rule::{Rule, RuleSpec};

/// A workload.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Scenario {
    pub(crate) name: String,
    /// The store to use when `--store` is not given.
    #[serde(default)]
    pub(crate) store: Option<String>,
    #[serde(default = "default_agents")]
    pub(crate) agents: usize,
    #[serde(default = "one")]
    pub(crate) threads_per_agent: usize,
    #[serde(default = "default_costs")]
    pub(crate) costs: Vec<(u64, f64)>,
    pub(crate) rule: RuleSpec,
    pub(crate) keys: Keys,
    pub(crate) phases: Vec<Phase>,
    #[serde(default)]
    pub(crate) faults: Vec<Fault>,
    /// The coordinator's per-shard budget for one key, store calls per second.
    #[serde(default)]
    pub(crate) split_above: Option<f64>,
    /// Run across this many regions (see the module doc).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) regions: Option<usize>,
    /// The round trip between a region's broker and the global store.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) region_rtt: Option<String>,
    /// The agents' tuning where it differs from the defaults.
    #[serde(default, skip_serializing_if = "AgentTuning::is_default")]
    pub(crate) agent: AgentTuning,
    /// The `rlqs` system's serve instances (`--compare rlqs`): the agents are Envoy
    /// filters spread over them.
    #[serde(default = "one")]
    pub(crate) rlqs_servers: usize,
}

/// The agents' tuning (`[agent]`); what is absent keeps `LimiterConfig`'s default.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct AgentTuning {
    /// A cold key becomes leased above this many tokens per second at one agent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) hot_above_per_sec: Option<u64>,
    /// A lease covers about this much of the agent's demand on its key ("100ms").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) horizon: Option<String>,
}

impl AgentTuning {
    fn is_default(&self) -> bool {
        *self == Self::default()
    }

    /// `config` with this tuning applied, or what is wrong with it.
    pub(crate) fn apply(&self, mut config: LimiterConfig) -> Result<LimiterConfig, String> {
        if let Some(h) = self.hot_above_per_sec {
            if h > 1_000_000_000 {
                return Err(format!("agent.hot_above_per_sec = {h} must be at most 1e9"));
            }
            config.hot_above_per_sec = h;
        }
        if let Some(text) = &self.horizon {
            let d = parse_duration(text).map_err(|e| format!("agent.horizon = {text:?}: {e}"))?;
            if d < Duration::from_millis(1) || d > Duration::from_secs(60) {
                return Err(format!("agent.horizon = {text:?} must be 1ms..=60s"));
            }
            config.horizon = d;
        }
        Ok(config)
    }
}

/// Which keys requests go to.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Keys {
    pub(crate) count: u32,
    #[serde(default = "uniform")]
    pub(crate) distribution: String,
    #[serde(default = "default_zipf")]
    pub(crate) zipf_s: f64,
}

/// Offered load from `at` (a fraction of the run) on.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Phase {
    pub(crate) at: f64,
    #[serde(default)]
    pub(crate) offered: f64,
    /// Decisions/s of all the active agents together (instead of `offered`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) total: Option<f64>,
    pub(crate) active: Option<Vec<usize>>,
    /// How the active agents share `offered` times their number (see the module doc).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) skew: Option<String>,
    /// The skew's ranks move this many agents on.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub(crate) rotate: usize,
    /// Each agent's own offered rate, decisions/s (agents past the end: 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) rates: Option<Vec<f64>>,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

/// How a phase's load is split over the agents.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Skew {
    Even,
    Zipf(f64),
    One(f64),
}

impl Skew {
    fn parse(text: &str) -> Result<Self, String> {
        let bad =
            || format!("skew = {text:?}: \"even\", \"zipf:S\" (S > 0) or \"one:F\" (0 < F <= 1)");
        match text.split_once(':') {
            None if text == "even" => Ok(Skew::Even),
            Some(("zipf", v)) => match v.parse::<f64>() {
                Ok(s) if s > 0.0 && s.is_finite() => Ok(Skew::Zipf(s)),
                _ => Err(bad()),
            },
            Some(("one", v)) => match v.parse::<f64>() {
                Ok(f) if f > 0.0 && f <= 1.0 => Ok(Skew::One(f)),
                _ => Err(bad()),
            },
            _ => Err(bad()),
        }
    }

    /// The weight of rank `k` of `n` (weights sum to 1).
    fn weight(self, k: usize, n: usize) -> f64 {
        match self {
            Skew::Even => 1.0 / n as f64,
            Skew::Zipf(s) => {
                let sum: f64 = (0..n).map(|i| 1.0 / ((i + 1) as f64).powf(s)).sum();
                1.0 / ((k + 1) as f64).powf(s) / sum
            }
            Skew::One(_) if n == 1 => 1.0,
            Skew::One(f) if k == 0 => f,
            Skew::One(f) => (1.0 - f) / (n - 1) as f64,
        }
    }
}

/// What one agent sends in a phase.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Pace {
    /// Nothing.
    Idle,
    /// As fast as it can.
    Flat,
    /// This many decisions per second.
    Rate(f64),
}

impl Phase {
    /// The pace of `agent` of `agents` in this phase.
    pub(crate) fn pace(&self, agent: usize, agents: usize) -> Pace {
        if let Some(rates) = &self.rates {
            return match rates.get(agent) {
                Some(&r) if r > 0.0 => Pace::Rate(r),
                _ => Pace::Idle,
            };
        }
        let active: Vec<usize> = match &self.active {
            Some(a) => a.clone(),
            None => (0..agents).collect(),
        };
        let Some(pos) = active.iter().position(|&a| a == agent) else {
            return Pace::Idle;
        };
        let n = active.len();
        let offered = self.total.map_or(self.offered, |t| t / n as f64);
        if offered == 0.0 {
            return if self.total.is_some() {
                Pace::Idle
            } else {
                Pace::Flat
            };
        }
        let skew = self
            .skew
            .as_deref()
            .map_or(Ok(Skew::Even), Skew::parse)
            .unwrap_or(Skew::Even);
        let rank = (pos + n - self.rotate % n) % n;
        let rate = offered * n as f64 * skew.weight(rank, n);
        if rate > 0.0 {
            Pace::Rate(rate)
        } else {
            Pace::Idle
        }
    }
}

/// Something that goes wrong at `at` (a fraction of the run).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Fault {
    pub(crate) at: f64,
    pub(crate) action: String,
    pub(crate) agent: Option<usize>,
    /// The region a `partition-region` or `heal-region` fault acts on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) region: Option<usize>,
}

fn default_agents() -> usize {
    8
}
fn one() -> usize {
    1
}
fn default_costs() -> Vec<(u64, f64)> {
    vec![(1, 1.0)]
}
fn uniform() -> String {
    "uniform".into()
}
fn default_zipf() -> f64 {
    1.1
}

/// The names of the built-in scenarios.
pub(crate) const BUILT_IN: &[&str] = &[
    "steady",
    "burst",
    "hot-key",
    "zipf",
    "long-tail",
    "zipf-store",
    "long-tail-store",
    "shifting",
    "agent-crash",
    "redis-down",
    "failover",
    "failover-wait",
    "cluster",
    "hot-split",
    "fleet",
    "fleet-under",
    "regions",
    "region-partition",
];

/// Fault actions a scenario may use.
pub(crate) const FAULTS: &[&str] = &[
    "crash-agent",
    "leave-agent",
    "join-agent",
    "kill-store",
    "restore-store",
    "stall-replication",
    "promote-replica",
    "stop-coordinator",
    "start-coordinator",
    "partition-region",
    "heal-region",
];

fn rule(capacity: u64, rate: &str) -> RuleSpec {
    RuleSpec::new(capacity, rate)
}

/// `r` with half its budget in 8 gateways' seats (see `leasehold_core::local`).
fn local_share(mut r: RuleSpec) -> RuleSpec {
    r.local_percent = Some(50);
    r.local_agents = Some(8);
    r
}

/// The rule of the region scenarios: one worldwide bucket, leased, a 2 s term.
fn region_rule() -> RuleSpec {
    let mut r = rule(20_000, "20000/s");
    r.scope = Some("global".into());
    r.leasing = Some("lease".into());
    r.lease_ttl = Some("2s".into());
    r.grace = Some("200ms".into());
    r
}

/// A fault of the whole run (no agent, no region) at `at`.
fn fault(at: f64, action: &str) -> Fault {
    Fault {
        at,
        action: action.into(),
        agent: None,
        region: None,
    }
}

fn phase(at: f64, offered: f64, active: Option<Vec<usize>>) -> Phase {
    Phase {
        at,
        offered,
        active,
        total: None,
        skew: None,
        rotate: 0,
        rates: None,
    }
}

impl Scenario {
    /// A built-in scenario.
    pub(crate) fn built_in(name: &str) -> Result<Self, String> {
        let keys = |count, distribution: &str| Keys {
            count,
            distribution: distribution.into(),
            zipf_s: 1.1,
        };
        let base = |rule, keys, phases| Scenario {
            name: name.to_owned(),
            store: None,
            agents: 8,
            threads_per_agent: 1,
            costs: default_costs(),
            rule,
            keys,
            phases,
            faults: Vec::new(),
            split_above: None,
            regions: None,
            region_rtt: None,
            agent: AgentTuning::default(),
            rlqs_servers: 1,
        };
        Ok(match name {
            // Ten tenants, offered 1.6x their limit, evenly, all the time.
            "steady" => base(
                rule(1000, "2000/s"),
                keys(10, "uniform"),
                vec![phase(0.0, 4000.0, None)],
            ),
            // Quiet, then everyone as fast as they can for a fifth of the run, then quiet.
            "burst" => base(
                rule(5000, "10000/s"),
                keys(1, "uniform"),
                vec![
                    phase(0.0, 200.0, None),
                    phase(0.4, 0.0, None),
                    phase(0.6, 200.0, None),
                ],
            ),
            // One tenant hammered by every agent as fast as they can.
            "hot-key" => base(
                rule(100_000, "100000/s"),
                keys(1, "uniform"),
                vec![phase(0.0, 0.0, None)],
            ),
            // 100 000 tenants with Zipf demand; each gateway has 16 requests in flight. The
            // rule keeps half of each tenant's budget in the gateways' seats (a local
            // share over the 8 gateways): tenants' traffic is spread over the gateways.
            "zipf" => Scenario {
                threads_per_agent: 16,
                ..base(
                    local_share(rule(100, "1000/s")),
                    keys(100_000, "zipf"),
                    vec![phase(0.0, 0.0, None)],
                )
            },
            // A million tenants, most of them seen a few times: the cold path's scenario,
            // with the same local share.
            "long-tail" => Scenario {
                threads_per_agent: 16,
                ..base(
                    local_share(rule(100, "1000/s")),
                    Keys {
                        count: 1_000_000,
                        distribution: "zipf".into(),
                        zipf_s: 0.9,
                    },
                    vec![phase(0.0, 0.0, None)],
                )
            },
            // zipf and long-tail without a local share: every cold decision goes to the
            // store (in batches).
            "zipf-store" | "long-tail-store" => {
                let mut s = Self::built_in(name.trim_end_matches("-store"))?;
                s.rule = rule(100, "1000/s");
                s.name = name.to_owned();
                s
            }
            // Demand moves from half the agents to the other half and back.
            "shifting" => base(
                rule(10_000, "20000/s"),
                keys(1, "uniform"),
                vec![
                    phase(0.0, 0.0, Some(vec![0, 1, 2, 3])),
                    phase(1.0 / 3.0, 0.0, Some(vec![4, 5, 6, 7])),
                    phase(2.0 / 3.0, 0.0, Some(vec![0, 1, 2, 3])),
                ],
            ),
            // Like hot-key; agent 0 dies halfway, abandoning what it holds.
            "agent-crash" => {
                let mut s = base(
                    rule(100_000, "100000/s"),
                    keys(1, "uniform"),
                    vec![phase(0.0, 0.0, None)],
                );
                s.faults.push(Fault {
                    agent: Some(0),
                    ..fault(0.5, "crash-agent")
                });
                s
            }
            // Hot-key; the store is unreachable from 30% to 60% of the run.
            "redis-down" => {
                let mut s = base(
                    rule(100_000, "100000/s"),
                    keys(1, "uniform"),
                    vec![phase(0.0, 0.0, None)],
                );
                for (at, action) in [(0.3, "kill-store"), (0.6, "restore-store")] {
                    s.faults.push(fault(at, action));
                }
                s
            }
            // Hot-key on a primary with a replica; replication stalls at 45% and the
            // replica is promoted at 50%, losing what was granted in between (I8); the
            // old primary rejoins as its replica. `failover-wait` is the same with
            // `replicas = 1`: grants wait for the replica, so the stall costs
            // availability instead of overshoot.
            "failover" | "failover-wait" => {
                let mut spec = rule(100_000, "100000/s");
                if name == "failover-wait" {
                    // Generous for a 2-core machine whose cores the agents keep busy: the
                    // replica and the replication link wait for CPU, and a grant that
                    // misses its WAIT is refused.
                    spec.replicas = Some(1);
                    spec.replica_timeout = Some("50ms".into());
                    spec.timeout = Some("200ms".into());
                }
                let mut s = base(spec, keys(1, "uniform"), vec![phase(0.0, 0.0, None)]);
                s.store = Some("spawn-replica".into());
                for (at, action) in [(0.45, "stall-replication"), (0.5, "promote-replica")] {
                    s.faults.push(fault(at, action));
                }
                s
            }
            // 30 hot tenants over the 3 shards of a 6-node cluster.
            "cluster" => {
                let mut s = base(
                    rule(10_000, "20000/s"),
                    keys(30, "uniform"),
                    vec![phase(0.0, 0.0, None)],
                );
                s.store = Some("cluster-spawn".into());
                s
            }
            // One tenant on a 6-node cluster, leases capped at 20 tokens so its store calls
            // pass the coordinator's budget: the key is split over the three shards. The
            // coordinator stops at 60% and starts again at 80%.
            "hot-split" => {
                let mut spec = rule(100_000, "200000/s");
                spec.lease_max = Some(20);
                let mut s = base(spec, keys(1, "uniform"), vec![phase(0.0, 0.0, None)]);
                s.store = Some("cluster-spawn".into());
                s.split_above = Some(500.0);
                for (at, action) in [(0.6, "stop-coordinator"), (0.8, "start-coordinator")] {
                    s.faults.push(fault(at, action));
                }
                s
            }
            // One popular tenant served by 64 gateways, 1.3x its limit in total, Zipf
            // over the gateways, the heavy ones moving every quarter of the run.
            "fleet" => {
                let phases = (0..4)
                    .map(|k| Phase {
                        total: Some(20_000.0 * 1.3),
                        skew: Some("zipf:1.2".into()),
                        rotate: 16 * k,
                        ..phase(k as f64 / 4.0, 0.0, None)
                    })
                    .collect();
                let mut s = base(rule(20_000, "20000/s"), keys(1, "uniform"), phases);
                s.agents = 64;
                s
            }
            // The same tenant and fleet at 0.6x the limit: one bucket would deny nothing.
            "fleet-under" => {
                let phases = vec![Phase {
                    total: Some(20_000.0 * 0.6),
                    skew: Some("zipf:1.2".into()),
                    ..phase(0.0, 0.0, None)
                }];
                let mut s = base(rule(20_000, "20000/s"), keys(1, "uniform"), phases);
                s.agents = 64;
                s
            }
            // One worldwide tenant (scope global) served from three regions, 1.3x its
            // limit in all; 70% of the demand is in one region, and that region changes
            // every twelfth of the run (every 5 s in a 60 s run).
            "regions" => {
                let per_region = |lead: usize| -> Vec<f64> {
                    (0..9)
                        .map(|i| {
                            let w = if i % 3 == lead { 0.7 } else { 0.15 };
                            20_000.0 * 1.3 * w / 3.0
                        })
                        .collect()
                };
                let phases = (0..12)
                    .map(|k| Phase {
                        rates: Some(per_region(k % 3)),
                        ..phase(k as f64 / 12.0, 0.0, None)
                    })
                    .collect();
                let mut s = base(region_rule(), keys(1, "uniform"), phases);
                s.agents = 9;
                s.regions = Some(3);
                s
            }
            // The same tenant, demand even over three regions; region 0 is cut off from
            // the global store for 30% of the run.
            "region-partition" => {
                let phases = vec![Phase {
                    total: Some(20_000.0 * 1.3),
                    ..phase(0.0, 0.0, None)
                }];
                let mut s = base(region_rule(), keys(1, "uniform"), phases);
                s.agents = 9;
                s.regions = Some(3);
                for (at, action) in [(0.35, "partition-region"), (0.65, "heal-region")] {
                    s.faults.push(Fault {
                        region: Some(0),
                        ..fault(at, action)
                    });
                }
                s
            }
            other => {
                return Err(format!(
                    "unknown scenario {other:?}; built in: {}",
                    BUILT_IN.join(", ")
                ));
            }
        })
    }

    /// Reads a scenario file.
    pub(crate) fn from_file(path: &std::path::Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        toml::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// Checks everything a run needs, naming what is wrong.
    pub(crate) fn validate(&self) -> Result<Rule, String> {
        // The file's [rule] table, not the name the run gives it.
        let rule = Rule::from_spec("sim", &self.rule).map_err(|e| {
            let e = e.to_string();
            let e = e.strip_prefix("rule sim: ").unwrap_or(&e);
            format!("scenario {}: [rule] {e}", self.name)
        })?;
        let err = |what: String| Err(format!("scenario {}: {what}", self.name));
        if self.agents == 0 || self.agents > 1000 {
            return err(format!("agents = {} must be 1..=1000", self.agents));
        }
        if self.rlqs_servers == 0 || self.rlqs_servers > self.agents {
            return err(format!(
                "rlqs_servers = {} must be 1..=agents ({}): each serve instance needs a filter",
                self.rlqs_servers, self.agents
            ));
        }
        if self.threads_per_agent == 0 || self.threads_per_agent > 64 {
            return err(format!(
                "threads_per_agent = {} must be 1..=64",
                self.threads_per_agent
            ));
        }
        if self.keys.count == 0 || self.keys.count > 10_000_000 {
            return err(format!(
                "keys.count = {} must be 1..=10000000",
                self.keys.count
            ));
        }
        if !matches!(self.keys.distribution.as_str(), "uniform" | "zipf") {
            return err(format!(
                "keys.distribution = {:?}: uniform or zipf",
                self.keys.distribution
            ));
        }
        if self.keys.zipf_s <= 0.0 || !self.keys.zipf_s.is_finite() {
            return err(format!(
                "keys.zipf_s = {} must be positive",
                self.keys.zipf_s
            ));
        }
        if self.costs.is_empty()
            || self
                .costs
                .iter()
                .any(|&(c, w)| c == 0 || c > rule.capacity().get() || w <= 0.0)
        {
            return err(
                "costs must be [cost, weight] pairs with 1 <= cost <= capacity and weight > 0"
                    .into(),
            );
        }
        self.agent
            .apply(LimiterConfig::default())
            .map_err(|e| format!("scenario {}: {e}", self.name))?;
        if self.phases.is_empty() || self.phases[0].at != 0.0 {
            return err("the first phase must start at 0.0".into());
        }
        for p in &self.phases {
            if !(0.0..1.0).contains(&p.at) {
                return err(format!(
                    "phase at {}: at is a fraction of --duration, in [0, 1) (0.5: halfway \
                     through it, after the warm-up, which runs the first phase)",
                    p.at
                ));
            }
            if p.offered < 0.0 || !p.offered.is_finite() {
                return err(format!(
                    "phase at {}: offered = {} must be a number >= 0 (decisions/s per \
                     active agent)",
                    p.at, p.offered
                ));
            }
            if let Some(a) = &p.active
                && let Some(bad) = a.iter().find(|&&i| i >= self.agents)
            {
                return err(format!(
                    "phase at {}: active agent {bad} is not one of the {} agents (0..{})",
                    p.at, self.agents, self.agents
                ));
            }
            if let Some(skew) = &p.skew {
                Skew::parse(skew)
                    .map_err(|e| format!("scenario {}: phase at {}: {e}", self.name, p.at))?;
                if p.offered == 0.0 && p.total.is_none() {
                    return err(format!(
                        "phase at {}: skew splits `offered` or `total`: give one",
                        p.at
                    ));
                }
            }
            if let Some(t) = p.total {
                if !(t.is_finite() && t >= 0.0) {
                    return err(format!(
                        "phase at {}: total = {t} must be a number >= 0 (decisions/s of all \
                         the active agents)",
                        p.at
                    ));
                }
                if p.offered != 0.0 {
                    return err(format!(
                        "phase at {}: give total (decisions/s of all the active agents) or \
                         offered (per agent), not both",
                        p.at
                    ));
                }
            }
            if let Some(rates) = &p.rates
                && (rates.len() > self.agents
                    || rates.iter().any(|r| !(r.is_finite() && *r >= 0.0)))
            {
                return err(format!(
                    "phase at {}: rates must be at most {} numbers >= 0",
                    p.at, self.agents
                ));
            }
        }
        for f in &self.faults {
            if !FAULTS.contains(&f.action.as_str()) {
                return err(format!(
                    "fault {:?}: one of {}",
                    f.action,
                    FAULTS.join(", ")
                ));
            }
            if !(0.0..1.0).contains(&f.at) {
                return err(format!("fault at {}: at must be in [0, 1)", f.at));
            }
            if f.action.ends_with("-agent") && f.agent.is_none_or(|a| a >= self.agents) {
                return err(format!(
                    "fault {} at {}: needs agent in 0..{}",
                    f.action, f.at, self.agents
                ));
            }
            let regions = self.regions.unwrap_or(0);
            if f.action.ends_with("-region") && f.region.is_none_or(|r| r >= regions) {
                return err(format!(
                    "fault {} at {}: needs region in 0..{regions} (and regions = N)",
                    f.action, f.at
                ));
            }
        }
        if let Some(b) = self.split_above
            && !(b > 0.0 && b.is_finite())
        {
            return err(format!("split_above = {b} must be a positive number"));
        }
        if let Some(n) = self.regions {
            if !(1..=16).contains(&n) || n > self.agents {
                return err(format!(
                    "regions = {n} must be 1..=16 and at most the agents ({})",
                    self.agents
                ));
            }
            self.rtt()?;
        }
        Ok(rule)
    }

    /// The round trip to the global store in a run across regions.
    pub(crate) fn rtt(&self) -> Result<std::time::Duration, String> {
        let text = self.region_rtt.as_deref().unwrap_or("80ms");
        let d = leasehold::core::rate::parse_duration(text)
            .map_err(|e| format!("scenario {}: region_rtt = {text:?}: {e}", self.name))?;
        if d > std::time::Duration::from_secs(10) {
            return Err(format!(
                "scenario {}: region_rtt = {text:?}: at most 10s",
                self.name
            ));
        }
        Ok(d)
    }

    /// The phase in force at `fraction` of the run.
    pub(crate) fn phase_at(&self, fraction: f64) -> &Phase {
        self.phases
            .iter()
            .rev()
            .find(|p| p.at <= fraction)
            .unwrap_or(&self.phases[0])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// docs/scenarios.md's example is a scenario this reads and accepts.
    #[test]
    fn the_documented_example_is_valid() {
        let doc = include_str!("../../docs/scenarios.md");
        let example = doc
            .split("```toml\n")
            .nth(1)
            .and_then(|rest| rest.split("```").next())
            .expect("a TOML block in docs/scenarios.md");
        let s: Scenario = toml::from_str(example).unwrap_or_else(|e| panic!("{e}"));
        s.validate().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((s.agents, s.faults.len()), (8, 1));
    }

    #[test]
    fn every_built_in_is_valid_and_round_trips_through_toml() {
        for name in BUILT_IN {
            let s = Scenario::built_in(name).unwrap();
            s.validate().unwrap();
            let text = toml::to_string(&s).unwrap();
            let back: Scenario = toml::from_str(&text).unwrap();
            back.validate().unwrap();
            assert_eq!(back.name, *name);
        }
        assert!(Scenario::built_in("nope").unwrap_err().contains("hot-key"));
    }

    #[test]
    fn bad_scenarios_name_the_problem() {
        let mut s = Scenario::built_in("hot-key").unwrap();
        s.keys.distribution = "pareto".into();
        assert!(s.validate().unwrap_err().contains("pareto"));
        let mut s = Scenario::built_in("hot-key").unwrap();
        s.faults.push(fault(0.5, "reboot-datacenter"));
        assert!(s.validate().unwrap_err().contains("reboot-datacenter"));
        let mut s = Scenario::built_in("hot-key").unwrap();
        s.rule.capacity = 0;
        assert!(s.validate().unwrap_err().contains("capacity"));
        let mut s = Scenario::built_in("fleet").unwrap();
        s.phases[0].skew = Some("zipf:-1".into());
        assert!(s.validate().unwrap_err().contains("zipf:-1"));
        let mut s = Scenario::built_in("zipf").unwrap();
        s.agent.horizon = Some("soon".into());
        assert!(
            s.validate()
                .unwrap_err()
                .contains("agent.horizon = \"soon\"")
        );
        s.agent.horizon = Some("0s".into());
        assert!(s.validate().unwrap_err().contains("1ms..=60s"));
    }

    #[test]
    fn the_agent_table_tunes_every_agent() {
        let s: Scenario = toml::from_str(
            "name = \"t\"\n[rule]\ncapacity = 10\nrate = \"10/s\"\n[keys]\ncount = 1\n\
             [[phases]]\nat = 0.0\n[agent]\nhot_above_per_sec = 100\nhorizon = \"250ms\"\n",
        )
        .unwrap();
        s.validate().unwrap();
        let c = s.agent.apply(LimiterConfig::default()).unwrap();
        assert_eq!(c.hot_above_per_sec, 100);
        assert_eq!(c.horizon, Duration::from_millis(250));
        let back: Scenario = toml::from_str(&toml::to_string(&s).unwrap()).unwrap();
        assert_eq!(back.agent, s.agent);
        let plain = toml::to_string(&Scenario::built_in("zipf").unwrap()).unwrap();
        assert!(!plain.contains("[agent]"), "{plain}");
        assert!(
            toml::from_str::<Scenario>("name = \"t\"\n[agent]\nhorizon_ms = 5\n")
                .unwrap_err()
                .to_string()
                .contains("horizon_ms")
        );
    }

    #[test]
    fn the_example_scenario_files_are_valid() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/scenarios");
        let mut n = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let s = Scenario::from_file(&path).unwrap();
            s.validate()
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            n += 1;
        }
        assert!(n >= 3, "examples/scenarios holds {n} files");
    }

    #[test]
    fn skews_split_the_phase_load_over_the_agents() {
        let s = Scenario::built_in("fleet").unwrap();
        let total: f64 = (0..64)
            .map(|a| match s.phases[0].pace(a, 64) {
                Pace::Rate(r) => r,
                other => panic!("{other:?}"),
            })
            .sum();
        assert!((total - 26_000.0).abs() < 1e-6, "{total}");
        // Zipf: agent 0 leads the first phase, agent 16 the second.
        let lead = |p: &Phase| {
            (0..64)
                .max_by(|&a, &b| match (p.pace(a, 64), p.pace(b, 64)) {
                    (Pace::Rate(x), Pace::Rate(y)) => x.total_cmp(&y),
                    _ => std::cmp::Ordering::Equal,
                })
                .unwrap()
        };
        assert_eq!(lead(&s.phases[0]), 0);
        assert_eq!(lead(&s.phases[1]), 16);
        let one = Phase {
            skew: Some("one:0.9".into()),
            ..phase(0.0, 100.0, Some(vec![2, 3]))
        };
        assert_eq!(one.pace(2, 4), Pace::Rate(180.0));
        assert!(matches!(one.pace(3, 4), Pace::Rate(r) if (r - 20.0).abs() < 1e-9));
        assert_eq!(one.pace(0, 4), Pace::Idle);
        let rates = Phase {
            rates: Some(vec![5.0]),
            ..phase(0.0, 0.0, None)
        };
        assert_eq!(rates.pace(0, 2), Pace::Rate(5.0));
        assert_eq!(rates.pace(1, 2), Pace::Idle);
    }
}
