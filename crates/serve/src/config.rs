//! envoyproxy/ratelimit's YAML configuration, read as it is, and turned into Leasehold
//! rules.
//!
//! ```yaml
//! domain: messaging
//! descriptors:
//!   - key: message_type
//!     value: marketing
//!     descriptors:
//!       - key: to_number
//!         rate_limit:
//!           unit: day
//!           requests_per_unit: 5
//!   - key: to_number
//!     rate_limit: {unit: day, requests_per_unit: 100}
//!     leasehold: {capacity: 20, on_failure: fail_open}   # Leasehold's own, optional
//! ```
//!
//! Every field of ratelimit's documented schema is read with its meaning there: `domain`;
//! nested `descriptors` with `key` and optional `value` (`*` wildcards anywhere in it);
//! `rate_limit` with `unit` (second, minute, hour, day, week, month, year) and
//! `requests_per_unit` (0: every request is over the limit), or `unlimited: true`, and
//! `name` and `replaces` (a matched limit named in another matched limit's `replaces` is
//! not applied); `shadow_mode`; `detailed_metric`, `value_to_metric` (how the metric key
//! is built); `share_threshold` (every value matching a wildcard shares one limit);
//! `quota_mode` (over the limit, the request is still OK unless every quota descriptor is
//! over); `metadata` (a map, returned in dynamic metadata when the descriptor passes). Any
//! other field is refused, naming it.
//!
//! Each `rate_limit` becomes a token bucket with r = requests_per_unit per unit and
//! B = requests_per_unit, unless the descriptor's `leasehold` block says otherwise
//! (`capacity`, `rate`, `on_failure`, `leasing`, `term`, `lease_ttl`, `lease_max`, `timeout`,
//! `replicas`, `mode`, `max_outstanding`, `emergency_rate`), and `leasehold.subject`
//! names the descriptor keys whose values tell buckets apart (default: every entry of
//! the request's descriptor, as ratelimit keys its counters). Unlike ratelimit's fixed
//! windows, a bucket never admits twice its limit across a window edge.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use leasehold_agent::RuleRef;
use leasehold_core::rule::{OverrideSpec, Rule, RuleError, RuleSpec};
use leasehold_store::Rules;
use serde::Deserialize;
use sha2::{Digest, Sha256};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct YamlRoot {
    domain: String,
    #[serde(default)]
    descriptors: Vec<YamlDescriptor>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct YamlDescriptor {
    key: String,
    /// Misplaced (ratelimit ignores it here): refused with where it goes.
    #[serde(default)]
    unit: Option<serde_norway::Value>,
    #[serde(default)]
    value: Option<String>,
    rate_limit: Option<YamlRateLimit>,
    #[serde(default)]
    descriptors: Vec<YamlDescriptor>,
    #[serde(default)]
    shadow_mode: bool,
    #[serde(default)]
    quota_mode: bool,
    #[serde(default)]
    detailed_metric: bool,
    #[serde(default)]
    value_to_metric: bool,
    #[serde(default)]
    share_threshold: bool,
    /// Returned in dynamic metadata when the descriptor passes.
    #[serde(default)]
    metadata: Option<serde_json::Value>,
    #[serde(default)]
    leasehold: Option<Extras>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct YamlRateLimit {
    #[serde(default)]
    requests_per_unit: Option<u32>,
    #[serde(default)]
    unit: Option<String>,
    #[serde(default)]
    unlimited: bool,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    replaces: Vec<YamlReplaces>,
    /// Misplaced (ratelimit ignores it here): refused with where it goes.
    #[serde(default)]
    shadow_mode: Option<serde_norway::Value>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct YamlReplaces {
    name: String,
}

/// Leasehold's own settings of a descriptor's limit.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Extras {
    capacity: Option<u64>,
    rate: Option<String>,
    on_failure: Option<String>,
    emergency_rate: Option<String>,
    leasing: Option<String>,
    term: Option<String>,
    lease_ttl: Option<String>,
    lease_max: Option<u64>,
    timeout: Option<String>,
    replicas: Option<u64>,
    mode: Option<String>,
    max_outstanding: Option<u64>,
    /// The descriptor keys whose values name the bucket.
    subject: Option<Vec<String>>,
}

/// Why a configuration was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file could not be read.
    #[error("{path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// Not YAML of the expected shape (an unknown field is named here).
    #[error("{path}: {message}")]
    Yaml {
        /// The file.
        path: String,
        /// The parser's message, with the line.
        message: String,
    },
    /// A descriptor or limit that cannot be used.
    #[error("{path}: descriptor {descriptor}: {why}")]
    Descriptor {
        /// The file.
        path: String,
        /// The descriptor's full key (`domain.key_value.key`).
        descriptor: String,
        /// What is wrong.
        why: String,
    },
    /// The limit does not make a valid Leasehold rule.
    #[error("{path}: descriptor {descriptor}: {source}")]
    Rule {
        /// The file.
        path: String,
        /// The descriptor's full key.
        descriptor: String,
        /// The rule's problem.
        source: Box<RuleError>,
    },
    /// Two files for one domain.
    #[error(
        "{path}: domain {domain:?} is already defined (--merge-domain-config, or \
         MERGE_DOMAIN_CONFIG=true, adds its descriptors to it)"
    )]
    DuplicateDomain {
        /// The file.
        path: String,
        /// The domain.
        domain: String,
    },
    /// A directory with no configuration file in it: served, it would limit nothing.
    #[error(
        "{path}: a directory with no *.yaml or *.yml file: every request would pass \
         unlimited (name a file, or put the domains' YAML files in it)"
    )]
    EmptyDirectory {
        /// The directory.
        path: String,
    },
}

/// The most tokens a second a limit may give (Leasehold's bound on rates).
pub const MAX_PER_SECOND: u64 = leasehold_core::rate::MAX_TOKENS_PER_SEC;

/// The time unit of a limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Unit {
    /// 1 s.
    Second,
    /// 60 s.
    Minute,
    /// 3 600 s.
    Hour,
    /// 86 400 s.
    Day,
    /// 7 days.
    Week,
    /// 30 days (as ratelimit counts it).
    Month,
    /// 365 days.
    Year,
}

impl Unit {
    const ALL: [Self; 7] = [
        Self::Second,
        Self::Minute,
        Self::Hour,
        Self::Day,
        Self::Week,
        Self::Month,
        Self::Year,
    ];

    /// The unit its YAML name (in any case) names.
    pub(crate) fn parse(text: &str) -> Option<Self> {
        Self::ALL
            .into_iter()
            .find(|u| u.name().eq_ignore_ascii_case(text))
    }

    /// Seconds in one unit.
    pub fn seconds(self) -> u64 {
        match self {
            Self::Second => 1,
            Self::Minute => 60,
            Self::Hour => 3600,
            Self::Day => 86_400,
            Self::Week => 7 * 86_400,
            Self::Month => 30 * 86_400,
            Self::Year => 365 * 86_400,
        }
    }

    /// Its name in the YAML.
    pub fn name(self) -> &'static str {
        match self {
            Self::Second => "second",
            Self::Minute => "minute",
            Self::Hour => "hour",
            Self::Day => "day",
            Self::Week => "week",
            Self::Month => "month",
            Self::Year => "year",
        }
    }

    /// The unit numbered `n` in the Envoy API (a descriptor's `limit`), if any.
    pub fn from_envoy(n: i32) -> Option<Self> {
        Self::ALL.into_iter().find(|u| u.envoy() == n)
    }

    /// The unit in the Envoy API's numbering.
    pub fn envoy(self) -> i32 {
        use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit as U;
        (match self {
            Self::Second => U::Second,
            Self::Minute => U::Minute,
            Self::Hour => U::Hour,
            Self::Day => U::Day,
            Self::Week => U::Week,
            Self::Month => U::Month,
            Self::Year => U::Year,
        }) as i32
    }
}

/// What a matched descriptor is limited by.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// `unlimited: true`: always OK, not counted against anything.
    Unlimited,
    /// `requests_per_unit: 0`: always over the limit.
    DenyAll,
    /// The Leasehold rule of that name.
    Rule(RuleRef),
}

/// One `rate_limit` of the configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Limit {
    /// What to do.
    pub action: Action,
    /// As configured (reported to Envoy in `current_limit`).
    pub requests_per_unit: u32,
    /// As configured.
    pub unit: Option<Unit>,
    /// `rate_limit.name`.
    pub name: Option<String>,
    /// `rate_limit.replaces`.
    pub replaces: Vec<String>,
    /// `shadow_mode`.
    pub shadow: bool,
    /// `quota_mode`: over this limit, the request is still OK unless every quota
    /// descriptor of it is over.
    pub quota_mode: bool,
    /// `metadata`: returned in dynamic metadata when the descriptor passes.
    pub metadata: Option<serde_json::Value>,
    /// `detailed_metric`.
    pub detailed_metric: bool,
    /// The descriptor's full key, `domain.key_value.key`.
    pub full_key: String,
    /// `leasehold.subject`: the keys whose values name the bucket.
    pub subject_keys: Option<Vec<String>>,
    /// The descriptor's entries from the domain down, as configured: key and value (a
    /// key alone matches any value; a value may hold a `*` wildcard).
    pub entries: Vec<(String, Option<String>)>,
    /// No `leasehold.on_failure`: a refusal only because the store is unreachable is
    /// answered as envoyproxy/ratelimit answers a Redis error, with a gRPC error, and
    /// Envoy's `failure_mode_deny` decides (the rule itself fails closed).
    pub failure_to_envoy: bool,
}

#[derive(Debug, Default)]
struct Node {
    children: HashMap<String, Node>,
    /// Wildcard children: their key (`key_val*ue`) split on `*`.
    wildcards: Vec<(String, Vec<String>)>,
    limit: Option<Limit>,
    value_to_metric: bool,
    share_threshold: bool,
}

/// A request's descriptor matched to a limit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Matched<'a> {
    /// The limit.
    pub limit: &'a Limit,
    /// The bucket's subject: the descriptor's entries (those `leasehold.subject` names),
    /// a wildcard with `share_threshold` standing for every value it matches.
    pub subject: String,
    /// The metric key, as ratelimit builds it.
    pub metric_key: String,
}

/// Every domain, and the Leasehold rules their limits became.
#[derive(Debug, Default)]
pub struct Domains {
    domains: HashMap<String, Node>,
    rules: Vec<Rule>,
}

/// A YAML parser's message in the words of the file: Rust's integer type names become
/// the numbers they hold (`requests_per_unit: -1` said "expected u32").
fn plain(message: &str) -> String {
    message
        .replace(
            "expected u32",
            "expected a whole number from 0 to 4294967295",
        )
        .replace(
            "expected u64",
            "expected a whole number from 0 to 18446744073709551615",
        )
}

impl Domains {
    /// Reads one YAML file, or every `*.yaml` / `*.yml` file of a directory (as
    /// ratelimit's runtime directory), one domain per file. A directory with none is
    /// refused: at start, and on a reload, which keeps the limits in force (files
    /// deleted by mistake would otherwise lift every limit).
    pub fn from_path(path: &Path) -> Result<Self, ConfigError> {
        Self::from_path_merging(path, false)
    }

    /// [`Domains::from_path`]; with `merge`, files naming the same domain add their
    /// descriptors to it (ratelimit's `MERGE_DOMAIN_CONFIG`; a descriptor defined twice is
    /// still refused), in file name order.
    pub fn from_path_merging(path: &Path, merge: bool) -> Result<Self, ConfigError> {
        let mut files = Vec::new();
        if path.is_dir() {
            let read = std::fs::read_dir(path).map_err(|source| ConfigError::Read {
                path: path.display().to_string(),
                source,
            })?;
            for e in read.flatten() {
                let p = e.path();
                if matches!(p.extension().and_then(|x| x.to_str()), Some("yaml" | "yml")) {
                    files.push(p);
                }
            }
            files.sort();
            if files.is_empty() {
                return Err(ConfigError::EmptyDirectory {
                    path: path.display().to_string(),
                });
            }
        } else {
            files.push(path.to_owned());
        }
        let mut out = Self::default();
        for f in files {
            let shown = f.display().to_string();
            let text = std::fs::read_to_string(&f).map_err(|source| ConfigError::Read {
                path: shown.clone(),
                source,
            })?;
            out.add_yaml(&text, &shown, merge)?;
        }
        Ok(out)
    }

    /// Parses one domain's YAML text (`shown` names it in errors).
    pub fn from_yaml(text: &str, shown: &str) -> Result<Self, ConfigError> {
        let mut out = Self::default();
        out.add_yaml(text, shown, false)?;
        Ok(out)
    }

    fn add_yaml(&mut self, text: &str, shown: &str, merge: bool) -> Result<(), ConfigError> {
        let root: YamlRoot = serde_norway::from_str(text).map_err(|e| ConfigError::Yaml {
            path: shown.to_owned(),
            message: plain(&e.to_string()),
        })?;
        if root.domain.is_empty() {
            return Err(ConfigError::Yaml {
                path: shown.to_owned(),
                message: "domain must not be empty".into(),
            });
        }
        let mut node = match self.domains.remove(&root.domain) {
            Some(known) if merge => known,
            Some(_) => {
                return Err(ConfigError::DuplicateDomain {
                    path: shown.to_owned(),
                    domain: root.domain,
                });
            }
            None => Node::default(),
        };
        self.load(
            &mut node,
            shown,
            &root.domain,
            &root.descriptors,
            &mut Vec::new(),
        )?;
        self.domains.insert(root.domain, node);
        Ok(())
    }

    /// Loads `descriptors` under `parent`, whose path has the descriptor keys `above`.
    fn load(
        &mut self,
        into: &mut Node,
        shown: &str,
        parent: &str,
        descriptors: &[YamlDescriptor],
        above: &mut Vec<(String, Option<String>)>,
    ) -> Result<(), ConfigError> {
        for d in descriptors {
            let bad = |descriptor: &str, why: String| ConfigError::Descriptor {
                path: shown.to_owned(),
                descriptor: descriptor.to_owned(),
                why,
            };
            if d.key.is_empty() {
                return Err(bad(parent, "a descriptor has an empty key".into()));
            }
            let final_key = match d.value.as_deref() {
                Some(v) if !v.is_empty() => format!("{}_{v}", d.key),
                _ => d.key.clone(),
            };
            let full = format!("{parent}.{final_key}");
            if into.children.contains_key(&final_key) {
                return Err(bad(&full, "duplicate descriptor".into()));
            }
            // Fields ratelimit accepts where they mean nothing: refused, with where they go.
            if d.unit.is_some() {
                return Err(bad(
                    &full,
                    "unit belongs inside rate_limit (ratelimit ignores it beside it)".into(),
                ));
            }
            if d.rate_limit
                .as_ref()
                .is_some_and(|r| r.shadow_mode.is_some())
            {
                return Err(bad(
                    &full,
                    "shadow_mode belongs beside rate_limit, not inside it (ratelimit ignores \
                     it there, so the limit would be enforced)"
                        .into(),
                ));
            }
            if d.metadata.as_ref().is_some_and(|m| !m.is_object()) {
                return Err(bad(
                    &full,
                    "metadata must be a map (of keys to values)".into(),
                ));
            }
            if d.share_threshold && !final_key.contains('*') {
                return Err(bad(
                    &full,
                    "share_threshold applies only to a value with a * wildcard".into(),
                ));
            }
            above.push((d.key.clone(), d.value.clone().filter(|v| !v.is_empty())));
            let limit = match &d.rate_limit {
                Some(rl) => Some(self.limit(shown, &full, d, rl, above)?),
                None => {
                    if d.leasehold.is_some() {
                        return Err(bad(&full, "leasehold settings need a rate_limit".into()));
                    }
                    None
                }
            };
            if final_key.contains('*') {
                into.wildcards.push((
                    final_key.clone(),
                    final_key.split('*').map(str::to_owned).collect(),
                ));
            }
            let mut node = Node {
                limit,
                value_to_metric: d.value_to_metric,
                share_threshold: d.share_threshold,
                ..Node::default()
            };
            // A subject names keys of the request's entries for this descriptor: its own
            // and those above it (another would match no entry, and every value of the
            // descriptor would share one bucket).
            if let Some(keys) = node.limit.as_ref().and_then(|l| l.subject_keys.as_ref())
                && let Some(k) = keys.iter().find(|k| !above.iter().any(|(a, _)| a == *k))
            {
                return Err(bad(
                    &full,
                    format!(
                        "leasehold.subject names {k:?}, which is not a key of this descriptor \
                         or those above it ({})",
                        above
                            .iter()
                            .map(|(k, _)| k.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                ));
            }
            self.load(&mut node, shown, &full, &d.descriptors, above)?;
            above.pop();
            into.children.insert(final_key, node);
        }
        Ok(())
    }

    fn limit(
        &mut self,
        shown: &str,
        full: &str,
        d: &YamlDescriptor,
        rl: &YamlRateLimit,
        entries: &[(String, Option<String>)],
    ) -> Result<Limit, ConfigError> {
        let bad = |why: String| ConfigError::Descriptor {
            path: shown.to_owned(),
            descriptor: full.to_owned(),
            why,
        };
        let unit = rl.unit.as_deref().map(|u| Unit::parse(u).ok_or(u));
        let unit = match (rl.unlimited, unit) {
            (true, Some(_)) => return Err(bad("should not specify a unit when unlimited".into())),
            (true, None) => None,
            (false, Some(Ok(u))) => Some(u),
            (false, Some(Err(u))) => {
                return Err(bad(format!(
                    "invalid rate limit unit {u:?}: expected second, minute, hour, day, week, month or year"
                )));
            }
            (false, None) => return Err(bad("rate_limit needs a unit".into())),
        };
        for r in &rl.replaces {
            if r.name.is_empty() {
                return Err(bad("a replaces entry has an empty name".into()));
            }
            if rl.name.as_deref() == Some(r.name.as_str()) {
                return Err(bad("replaces names its own limit".into()));
            }
        }
        let rpu = rl.requests_per_unit.unwrap_or(0);
        if let Some(u) = unit
            && u64::from(rpu) > MAX_PER_SECOND * u.seconds()
        {
            return Err(bad(format!(
                "requests_per_unit {rpu} per {} is more than Leasehold's {MAX_PER_SECOND} a \
                 second: for no limit write `unlimited: true`",
                u.name()
            )));
        }
        let extras = d.leasehold.as_ref();
        let action = match unit {
            None => Action::Unlimited,
            Some(_) if rpu == 0 => Action::DenyAll,
            Some(u) => {
                let name = rule_name(full);
                let mut spec = RuleSpec::new(u64::from(rpu), format!("{rpu}/{}s", u.seconds()));
                spec.shadow = Some(d.shadow_mode);
                let mut o = OverrideSpec::default();
                if let Some(x) = extras {
                    o.capacity = x.capacity;
                    o.rate.clone_from(&x.rate);
                    o.on_failure.clone_from(&x.on_failure);
                    o.emergency_rate.clone_from(&x.emergency_rate);
                    o.leasing.clone_from(&x.leasing);
                    o.term.clone_from(&x.term);
                    o.lease_ttl.clone_from(&x.lease_ttl);
                    o.lease_max = x.lease_max;
                    o.timeout.clone_from(&x.timeout);
                    o.replicas = x.replicas;
                    o.mode.clone_from(&x.mode);
                    o.max_outstanding = x.max_outstanding;
                }
                let rule = Rule::from_spec(&name, &o.apply(&spec)).map_err(|source| {
                    ConfigError::Rule {
                        path: shown.to_owned(),
                        descriptor: full.to_owned(),
                        source: Box::new(source),
                    }
                })?;
                self.rules.push(rule);
                Action::Rule(name.into())
            }
        };
        Ok(Limit {
            action,
            requests_per_unit: rpu,
            unit,
            name: rl.name.clone().filter(|n| !n.is_empty()),
            replaces: rl.replaces.iter().map(|r| r.name.clone()).collect(),
            shadow: d.shadow_mode,
            quota_mode: d.quota_mode,
            metadata: d.metadata.clone(),
            detailed_metric: d.detailed_metric,
            full_key: full.to_owned(),
            subject_keys: extras.and_then(|x| x.subject.clone()),
            entries: entries.to_vec(),
            failure_to_envoy: extras.is_none_or(|x| x.on_failure.is_none()),
        })
    }

    /// The Leasehold rules the limits became.
    pub fn rules(&self) -> Rules {
        Rules::from_rules(self.rules.iter().cloned())
    }

    /// Whether `name` is the rule of a descriptor's limit (its subject is the descriptor's
    /// entries, not a caller's string).
    pub fn has_rule(&self, name: &str) -> bool {
        self.rules.iter().any(|r| r.name().as_str() == name)
    }

    /// The domains, sorted.
    pub fn domain_names(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.domains.keys().map(String::as_str).collect();
        v.sort_unstable();
        v
    }

    /// Every limit by its full key (for listings).
    pub fn limits(&self) -> BTreeMap<&str, &Limit> {
        let mut all = Vec::new();
        for n in self.domains.values() {
            limits_under(n, &mut all);
        }
        all.into_iter().map(|l| (l.full_key.as_str(), l)).collect()
    }

    /// Each `replaces` entry naming no limit of its domain, as a line for the log: it
    /// replaces nothing. (envoyproxy/ratelimit loads such a file too, so it is loaded.)
    pub fn unmatched_replaces(&self) -> Vec<String> {
        let mut lines = Vec::new();
        for (domain, node) in &self.domains {
            let mut limits = Vec::new();
            limits_under(node, &mut limits);
            for l in &limits {
                for r in &l.replaces {
                    if !limits.iter().any(|o| o.name.as_deref() == Some(r.as_str())) {
                        lines.push(format!(
                            "{}: replaces {r:?}, but no limit of domain {domain} has that name: \
                             it replaces nothing",
                            l.full_key
                        ));
                    }
                }
            }
        }
        lines
    }

    /// True when `domain` is configured.
    pub fn has_domain(&self, domain: &str) -> bool {
        self.domains.contains_key(domain)
    }

    /// The limit a request descriptor (its `(key, value)` entries, in order) matches in
    /// `domain`, as ratelimit matches it: at each level `key_value` first, then a
    /// wildcard, then `key` alone; a limit applies only at the descriptor's last entry.
    pub fn find<'a>(&'a self, domain: &str, entries: &[(&str, &str)]) -> Option<Matched<'a>> {
        let mut node = self.domains.get(domain)?;
        let mut metric = String::from(domain);
        let mut detailed = String::from(domain);
        // Per entry, the value that names the bucket (a shared wildcard's pattern).
        let mut values: Vec<&str> = Vec::with_capacity(entries.len());
        let mut found = None;
        for (i, &(key, value)) in entries.iter().enumerate() {
            let key_value = format!("{key}_{value}");
            detailed.push('.');
            detailed.push_str(&key_value);
            let (next, how) = if let Some(n) = node.children.get(&key_value) {
                (n, Matched_::Value)
            } else if let Some((pattern, _)) = node
                .wildcards
                .iter()
                .find(|(_, parts)| wildcard_match(parts, &key_value))
            {
                (
                    &node.children[pattern],
                    Matched_::Wildcard(pattern.as_str()),
                )
            } else if let Some(n) = node.children.get(key) {
                (n, Matched_::Key)
            } else {
                return None;
            };
            metric.push('.');
            metric.push_str(key);
            match how {
                Matched_::Value => {
                    metric.push('_');
                    metric.push_str(value);
                    values.push(value);
                }
                Matched_::Wildcard(pattern) => {
                    let pattern_value = &pattern[key.len() + 1..];
                    metric.push('_');
                    if next.share_threshold {
                        metric.push_str(pattern_value);
                        values.push(pattern_value);
                    } else if next.value_to_metric {
                        metric.push_str(value);
                        values.push(value);
                    } else {
                        metric.push_str(pattern_value);
                        values.push(value);
                    }
                }
                Matched_::Key => {
                    if next.value_to_metric {
                        metric.push('_');
                        metric.push_str(value);
                    }
                    values.push(value);
                }
            }
            if i == entries.len() - 1 {
                found = next.limit.as_ref();
            }
            node = next;
        }
        let limit = found?;
        let pairs: Vec<[&str; 2]> = entries
            .iter()
            .zip(&values)
            .filter(|((k, _), _)| {
                limit
                    .subject_keys
                    .as_ref()
                    .is_none_or(|keys| keys.iter().any(|s| s == k))
            })
            .map(|((k, _), v)| [*k, *v])
            .collect();
        let subject = serde_json::to_string(&pairs).unwrap_or_default();
        let metric_key = if limit.detailed_metric {
            detailed
        } else {
            metric
        };
        Some(Matched {
            limit,
            subject,
            metric_key,
        })
    }
}

enum Matched_<'a> {
    Value,
    Wildcard(&'a str),
    Key,
}

/// `*` matches any run of characters, anywhere in the pattern.
fn wildcard_match(parts: &[String], value: &str) -> bool {
    let (Some(first), Some(last)) = (parts.first(), parts.last()) else {
        return false;
    };
    if parts.len() == 1 {
        return first == value;
    }
    let fixed: usize = parts.iter().map(String::len).sum();
    if value.len() < fixed || !value.starts_with(first.as_str()) || !value.ends_with(last.as_str())
    {
        return false;
    }
    let mut rest = &value[first.len()..value.len() - last.len()];
    for p in &parts[1..parts.len() - 1] {
        match rest.find(p.as_str()) {
            Some(i) => rest = &rest[i + p.len()..],
            None => return false,
        }
    }
    true
}

/// The limits of `n` and of every node under it, `n`'s first.
fn limits_under<'a>(n: &'a Node, out: &mut Vec<&'a Limit>) {
    out.extend(&n.limit);
    for c in n.children.values() {
        limits_under(c, out);
    }
}

/// A Leasehold rule name for a descriptor's full key: the key with every character
/// outside `A-Z a-z 0-9 . _ -` as `-`, shortened with a hash of the key when it had to
/// change or is long, so two descriptors never share a rule.
pub fn rule_name(full_key: &str) -> String {
    let clean: String = full_key
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '-'
            }
        })
        .collect();
    if clean == full_key && clean.len() <= 64 {
        return clean;
    }
    let digest = Sha256::digest(full_key.as_bytes());
    let hex: String = digest[..4].iter().map(|b| format!("{b:02x}")).collect();
    let keep: String = clean.chars().take(55).collect();
    format!("{keep}~{hex}").replace('~', "-")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(yaml: &str) -> Result<Domains, String> {
        Domains::from_yaml(yaml, "test.yaml").map_err(|e| e.to_string())
    }

    /// Every field of ratelimit's documented schema, as its README examples use them.
    const EVERY_FIELD: &str = r#"
domain: example
descriptors:
  - key: message_type
    value: marketing
    descriptors:
      - key: to_number
        rate_limit:
          unit: day
          requests_per_unit: 5
  - key: to_number
    rate_limit: {unit: day, requests_per_unit: 100}
  - key: ldap
    rate_limit: {unlimited: true}
  - key: remote_address
    value: 50.0.0.5
    rate_limit: {unit: second, requests_per_unit: 0}
  - key: service
    descriptors:
      - key: user
        value: user-a
        rate_limit: {requests_per_unit: 10, unit: second}
        shadow_mode: true
  - key: key_1
    value: value_1
    descriptors:
      - key: user
        value: bkthomps
        rate_limit: {name: specific_limit, requests_per_unit: 5, unit: second}
  - key: key_2
    value: value_2
    descriptors:
      - key: user
        value: bkthomps
        rate_limit:
          replaces:
            - name: specific_limit
          requests_per_unit: 10
          unit: second
  - key: key1
    detailed_metric: true
    rate_limit: {unit: minute, requests_per_unit: 10}
  - key: path
    value: /api/*/action
    value_to_metric: true
    rate_limit: {unit: minute, requests_per_unit: 20}
  - key: files
    value: docs/*
    share_threshold: true
    metadata: {team: storage}
    rate_limit: {unit: hour, requests_per_unit: 7}
  - key: week
    rate_limit: {unit: WEEK, requests_per_unit: 700}
  - key: tenant
    rate_limit: {unit: second, requests_per_unit: 50}
    leasehold:
      capacity: 10
      on_failure: fail_open
      leasing: exact
      subject: [tenant]
"#;

    #[test]
    fn every_documented_field_reads_with_its_meaning() {
        let d = load(EVERY_FIELD).unwrap();
        // Nested descriptors: only at the descriptor's depth.
        let m = d
            .find(
                "example",
                &[("message_type", "marketing"), ("to_number", "206")],
            )
            .unwrap();
        assert_eq!(m.limit.requests_per_unit, 5);
        assert_eq!(m.limit.unit, Some(Unit::Day));
        assert_eq!(m.metric_key, "example.message_type_marketing.to_number");
        assert!(
            d.find("example", &[("message_type", "marketing")])
                .is_none()
        );
        // A key without value matches any value, each its own bucket.
        let a = d.find("example", &[("to_number", "1")]).unwrap();
        let b = d.find("example", &[("to_number", "2")]).unwrap();
        assert_ne!(a.subject, b.subject);
        assert_eq!(a.limit.full_key, "example.to_number");
        // unlimited, requests_per_unit 0, most specific match first.
        assert_eq!(
            d.find("example", &[("ldap", "x")]).unwrap().limit.action,
            Action::Unlimited
        );
        let deny = d
            .find("example", &[("remote_address", "50.0.0.5")])
            .unwrap();
        assert_eq!(deny.limit.action, Action::DenyAll);
        assert!(
            d.find("example", &[("remote_address", "50.0.0.6")])
                .is_none()
        );
        // shadow_mode makes a shadow rule.
        let s = d
            .find("example", &[("service", "s"), ("user", "user-a")])
            .unwrap();
        assert!(s.limit.shadow);
        let rules = d.rules();
        let Action::Rule(name) = &s.limit.action else {
            panic!()
        };
        assert!(rules.get(name.as_str()).unwrap().shadow());
        // name and replaces.
        let r = d
            .find("example", &[("key_2", "value_2"), ("user", "bkthomps")])
            .unwrap();
        assert_eq!(r.limit.replaces, vec!["specific_limit".to_owned()]);
        let n = d
            .find("example", &[("key_1", "value_1"), ("user", "bkthomps")])
            .unwrap();
        assert_eq!(n.limit.name.as_deref(), Some("specific_limit"));
        // detailed_metric keeps the runtime value in the metric key.
        let m = d.find("example", &[("key1", "v9")]).unwrap();
        assert_eq!(m.metric_key, "example.key1_v9");
        // A wildcard anywhere; value_to_metric puts the runtime value in the metric key.
        let m = d.find("example", &[("path", "/api/7/action")]).unwrap();
        assert_eq!(m.metric_key, "example.path_/api/7/action");
        assert!(d.find("example", &[("path", "/api/7/other")]).is_none());
        // share_threshold: every matching value shares one bucket.
        let x = d.find("example", &[("files", "docs/a.pdf")]).unwrap();
        let y = d.find("example", &[("files", "docs/b.csv")]).unwrap();
        assert_eq!(x.subject, y.subject);
        assert_eq!(x.metric_key, "example.files_docs/*");
        // Units as ratelimit counts them, any case.
        let w = d.find("example", &[("week", "x")]).unwrap();
        let Action::Rule(name) = &w.limit.action else {
            panic!()
        };
        let rule = rules.get(name.as_str()).unwrap();
        assert!((rule.rate().per_sec_f64() - 700.0 / 604_800.0).abs() < 1e-9);
        assert_eq!(rule.capacity().get(), 700, "B = requests_per_unit");
        // Leasehold's own fields.
        let t = d.find("example", &[("tenant", "t1")]).unwrap();
        let Action::Rule(name) = &t.limit.action else {
            panic!()
        };
        let rule = rules.get(name.as_str()).unwrap();
        assert_eq!(rule.capacity().get(), 10);
        assert_eq!(rule.leasing(), leasehold_core::Leasing::Exact);
        assert_eq!(t.subject, r#"[["tenant","t1"]]"#);
        assert_eq!(d.domain_names(), vec!["example"]);
    }

    #[test]
    fn subject_names_only_the_keys_it_lists() {
        let d = load(
            "domain: d\ndescriptors:\n  - key: route\n    descriptors:\n      - key: user\n        rate_limit: {unit: second, requests_per_unit: 5}\n        leasehold: {subject: [user]}\n",
        )
        .unwrap();
        let a = d.find("d", &[("route", "/a"), ("user", "u")]).unwrap();
        let b = d.find("d", &[("route", "/b"), ("user", "u")]).unwrap();
        assert_eq!(a.subject, b.subject, "one bucket per user across routes");
    }

    /// Every unit of ratelimit's schema loads, a year's limit too (a config written for
    /// ratelimit must not be refused for its longest units).
    #[test]
    fn every_unit_of_ratelimit_loads() {
        for unit in ["second", "minute", "hour", "day", "week", "month", "year"] {
            for n in [1, 5, 1_000_000] {
                let yaml = format!(
                    "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {{unit: {unit}, requests_per_unit: {n}}}\n"
                );
                let d = load(&yaml).unwrap_or_else(|e| panic!("{n} per {unit}: {e}"));
                assert!(d.find("d", &[("k", "v")]).is_some(), "{n} per {unit}");
            }
        }
    }

    #[test]
    fn what_cannot_be_used_is_refused_by_name() {
        let e = load("domain: d\ndescriptors:\n  - key: a\n    rate_limt: {unit: second}\n")
            .unwrap_err();
        assert!(e.contains("unknown field `rate_limt`"), "{e}");
        let e = load("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: fortnight, requests_per_unit: 1}\n").unwrap_err();
        assert!(
            e.contains("descriptor d.a") && e.contains("fortnight"),
            "{e}"
        );
        let e =
            load("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {requests_per_unit: 1}\n")
                .unwrap_err();
        assert!(e.contains("needs a unit"), "{e}");
        let e = load("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: -1}\n").unwrap_err();
        assert!(
            e.contains("requests_per_unit")
                && e.contains("-1")
                && e.contains("a whole number from 0 to 4294967295"),
            "{e}"
        );
        let e = load("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unlimited: true, unit: second}\n").unwrap_err();
        assert!(e.contains("unlimited"), "{e}");
        let e = load("domain: d\ndescriptors:\n  - key: a\n    metadata: [1, 2]\n    rate_limit: {unit: second, requests_per_unit: 1}\n").unwrap_err();
        assert!(e.contains("metadata must be a map"), "{e}");
        let e =
            load("domain: d\ndescriptors:\n  - key: a\n    value: b\n    share_threshold: true\n")
                .unwrap_err();
        assert!(e.contains("share_threshold"), "{e}");
        let e = load("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1, name: n, replaces: [{name: n}]}\n").unwrap_err();
        assert!(e.contains("replaces names its own"), "{e}");
        // A replaces entry that names no limit is loaded, as ratelimit loads it, and said.
        let d = load("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1, name: n, replaces: [{name: m}, {name: o}]}\n  - key: b\n    rate_limit: {unit: second, requests_per_unit: 1, name: m}\n").unwrap_or_else(|e| panic!("{e}"));
        let lines = d.unmatched_replaces();
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert!(
            lines[0].starts_with("d.a: replaces \"o\", but no limit of domain d"),
            "{lines:?}"
        );
        let e = load("domain: d\ndescriptors:\n  - key: a\n  - key: a\n").unwrap_err();
        assert!(e.contains("duplicate"), "{e}");
        let e = load("domain: d\ndescriptors:\n  - key: ''\n").unwrap_err();
        assert!(e.contains("empty key"), "{e}");
        let e = load("domain: ''\n").unwrap_err();
        assert!(e.contains("domain"), "{e}");
        // What ratelimit accepts and ignores, or takes beyond Leasehold's bounds: refused,
        // saying how to write it.
        let e = load("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 4294967295}\n").unwrap_err();
        assert!(e.contains("for no limit write `unlimited: true`"), "{e}");
        let e = load("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 5, shadow_mode: true}\n").unwrap_err();
        assert!(e.contains("shadow_mode belongs beside rate_limit"), "{e}");
        let e = load("domain: d\ndescriptors:\n  - key: a\n    unit: second\n    rate_limit: {unit: second, requests_per_unit: 5}\n").unwrap_err();
        assert!(e.contains("unit belongs inside rate_limit"), "{e}");
        let e = load("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1}\n    leasehold: {capacty: 3}\n").unwrap_err();
        assert!(e.contains("capacty"), "{e}");
        let e = load("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1}\n    leasehold: {on_failure: maybe}\n").unwrap_err();
        assert!(
            e.contains("descriptor d.a") && e.contains("on_failure"),
            "{e}"
        );
        // A subject key the descriptor does not have would put every value in one bucket.
        let e = load("domain: d\ndescriptors:\n  - key: route\n    descriptors:\n      - key: api_key\n        rate_limit: {unit: second, requests_per_unit: 5}\n        leasehold: {subject: [tenant]}\n").unwrap_err();
        assert!(
            e.contains("descriptor d.route.api_key")
                && e.contains("\"tenant\", which is not a key of this descriptor or those above it (route, api_key)"),
            "{e}"
        );
    }

    #[test]
    fn rule_names_are_valid_and_distinct() {
        assert_eq!(rule_name("d.key_value"), "d.key_value");
        let a = rule_name("d.path_/api/*/action");
        let b = rule_name("d.path_/api/*/actiox");
        assert_ne!(a, b);
        assert!(leasehold_core::rule::RuleName::new(&a).is_ok(), "{a}");
        let long = rule_name(&"x".repeat(200));
        assert!(long.len() <= 64, "{long}");
    }

    #[test]
    fn a_directory_without_yaml_files_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("notes.txt"), "not a config").unwrap();
        let e = Domains::from_path(dir.path()).unwrap_err().to_string();
        assert!(e.contains("no *.yaml or *.yml file"), "{e}");
        assert!(e.contains("unlimited"), "{e}");
        std::fs::write(
            dir.path().join("gw.yaml"),
            "domain: gw\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1}\n",
        )
        .unwrap();
        assert!(Domains::from_path(dir.path()).is_ok());
    }
}
