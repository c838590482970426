//! The rule set, read from a TOML file:
//!
//! ```toml
//! [rules."api.write"]
//! capacity = 100          # burst B, tokens
//! rate = "10/s"           # refill r: N/PERIOD
//! lease_ttl = "5s"
//! on_failure = "fail_closed"
//! ```
//!
//! Every rule is validated when the file is read; one bad rule refuses the whole file,
//! with an error naming the rule, the field and the value.
//!
//! A rule may tune single subjects (hot tenants) with overrides: any field but the
//! name, unset fields inherited from the rule, each validated like a rule:
//!
//! ```toml
//! [rules."api.write".overrides."tenant-42"]      # this exact subject
//! capacity = 5000
//! rate = "2000/s"
//! [rules."api.write".overrides."sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"]
//! rate = "1/s"                                    # the subject with this SHA-256
//! ```
//!
//! Environment variables override fields of rules in the file:
//! `LEASEHOLD_RULES__<RULE>__<FIELD>=<value>`, where `<RULE>` is the rule's name in any
//! case with `.` and `-` written as `_` (`LEASEHOLD_RULES__API_WRITE__CAPACITY=200`). A
//! variable that names no rule of the file, names two, or names an unknown field is an
//! error: an override that silently did nothing would be worse. A subject's override is
//! reached as `LEASEHOLD_RULES__<RULE>__OVERRIDES__<SUBJECT>__<FIELD>`, `<SUBJECT>`
//! written like `<RULE>` with every character outside `A-Z 0-9` as `_`; it must name an
//! override of the file.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use leasehold_core::SubjectMatch;
use leasehold_core::key::{BucketKey, sha256};
use leasehold_core::rule::{OverrideSpec, Rule, RuleError, RuleSpec};
use serde::Deserialize;

/// A validated set of rules by name, with their per-subject overrides.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Rules {
    rules: BTreeMap<String, Rule>,
    overrides: BTreeMap<String, Overrides>,
}

/// The overrides of one rule, validated.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Overrides {
    /// By name as written in the file.
    named: BTreeMap<String, Rule>,
    exact: HashMap<Box<[u8]>, String>,
    /// Every override by the SHA-256 of the subject it applies to.
    by_digest: HashMap<[u8; 32], String>,
    hashed: bool,
}

impl Overrides {
    /// The override that applies to `subject`, with its name. Hashes the subject only
    /// when the rule has `sha256:` overrides.
    pub fn resolve(&self, subject: &[u8]) -> Option<(&str, &Rule)> {
        let name = match self.exact.get(subject) {
            Some(name) => name,
            None if self.hashed => self.by_digest.get(&sha256(subject))?,
            None => return None,
        };
        self.named.get_key_value(name).map(|(n, r)| (n.as_str(), r))
    }

    /// The override that applies to the subject whose SHA-256 is `digest`.
    pub fn resolve_digest(&self, digest: &[u8; 32]) -> Option<(&str, &Rule)> {
        let name = self.by_digest.get(digest)?;
        self.named.get_key_value(name).map(|(n, r)| (n.as_str(), r))
    }

    /// Every override, by name.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Rule)> {
        self.named.iter().map(|(n, r)| (n.as_str(), r))
    }

    /// How many.
    pub fn len(&self) -> usize {
        self.named.len()
    }

    /// True when the rule has none.
    pub fn is_empty(&self) -> bool {
        self.named.is_empty()
    }

    fn insert(&mut self, name: &str, m: SubjectMatch, rule: Rule) -> Result<(), String> {
        let digest = match &m {
            SubjectMatch::Exact(subject) => sha256(subject),
            SubjectMatch::Sha256(d) => *d,
        };
        if let Some(other) = self.by_digest.get(&digest) {
            return Err(format!("names the same subject as override {other:?}"));
        }
        match m {
            SubjectMatch::Exact(subject) => {
                self.exact.insert(subject, name.to_owned());
            }
            SubjectMatch::Sha256(_) => self.hashed = true,
        }
        self.by_digest.insert(digest, name.to_owned());
        self.named.insert(name.to_owned(), rule);
        Ok(())
    }
}

/// Why a rules file was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RulesError {
    /// A reloaded file lacks a rule the process checks (a gateway's configured rule):
    /// taking it would make every request of that rule fail.
    #[error("rules file {path}: rule {rule:?} is missing, and requests are checked against it")]
    Required {
        /// The file.
        path: String,
        /// The rule it lacks.
        rule: String,
    },
    /// The file could not be read or is not valid TOML of the expected shape.
    #[error("rules file {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// What went wrong (boxed: the configuration error is large).
        source: Box<config::ConfigError>,
    },
    /// A rule is invalid.
    #[error("rules file {path}: {source}")]
    Rule {
        /// The file.
        path: String,
        /// The rule's problem (boxed: a rule error carries several strings).
        source: Box<RuleError>,
    },
    /// The file is not valid TOML (a number too large for 64 bits, say).
    #[error("rules file {path}: {message}")]
    Syntax {
        /// The file.
        path: String,
        /// The parser's message, with the line at fault.
        message: String,
    },
    /// A field that counts tokens holds something other than a whole number (the
    /// configuration layer would round `10.5` to 11).
    #[error("rules file {path}: rule {rule}: {field} = {value}: must be a whole number of tokens")]
    NotWhole {
        /// The file.
        path: String,
        /// The rule.
        rule: String,
        /// The field.
        field: &'static str,
        /// The value as written.
        value: String,
    },
    /// An environment override that does not apply.
    #[error("environment override {var}: {why}")]
    Override {
        /// The variable.
        var: String,
        /// Why it does not apply.
        why: String,
    },
    /// An override's name cannot say which subject it applies to.
    #[error("rules file {path}: rule {rule} override {name:?}: {why}")]
    OverrideName {
        /// The file.
        path: String,
        /// The rule.
        rule: String,
        /// The override's name (first 80 characters).
        name: String,
        /// What is wrong with it.
        why: String,
    },
    /// The file defines no rule: almost certainly the wrong file.
    #[error("rules file {path} defines no [rules.NAME] table")]
    Empty {
        /// The file.
        path: String,
    },
    /// The rules do not fit the agent that is given them (a region-scoped rule without a
    /// weight for the agent's region, say): refused, and the rules in force stay.
    #[error("rules refused: {why}")]
    NotForAgent {
        /// What does not fit.
        why: String,
    },
}

/// A lookup of a rule that is not defined.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown rule {name:?}; defined rules: {known}")]
pub struct UnknownRule {
    /// The name asked for.
    pub name: String,
    /// The names defined, comma-separated.
    pub known: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RulesFile {
    #[serde(default)]
    rules: BTreeMap<String, RuleSpec>,
}

impl Rules {
    /// Reads and validates a TOML rules file, with the process's `LEASEHOLD_RULES__*`
    /// environment overrides applied.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, RulesError> {
        let path = path.as_ref();
        let shown = path.display().to_string();
        if let Ok(text) = std::fs::read_to_string(path) {
            whole_numbers(&text, &shown)?;
        }
        let source = config::File::from(path).format(config::FileFormat::Toml);
        Self::load(source, &shown, std::env::vars())
    }

    /// Parses and validates rules from TOML text (no environment overrides).
    pub fn from_toml(text: &str) -> Result<Self, RulesError> {
        Self::from_toml_with_env(text, std::iter::empty())
    }

    /// Parses rules from TOML text with the overrides among `vars` (name, value) applied.
    pub fn from_toml_with_env(
        text: &str,
        vars: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Self, RulesError> {
        whole_numbers(text, "<inline>")?;
        Self::load(
            config::File::from_str(text, config::FileFormat::Toml),
            "<inline>",
            vars,
        )
    }

    fn load<S>(
        source: S,
        shown: &str,
        vars: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Self, RulesError>
    where
        S: config::Source + Send + Sync + 'static,
    {
        let read = |source| RulesError::Read {
            path: shown.to_owned(),
            source: Box::new(source),
        };
        let mut file: RulesFile = config::Config::builder()
            .add_source(source)
            .build()
            .map_err(read)?
            .try_deserialize()
            .map_err(read)?;
        // A value from the environment is not in the file: errors from here on name the
        // variables that changed what the file says.
        let applied = apply_overrides(&mut file.rules, vars)?;
        let with_env;
        let shown = if applied.is_empty() {
            shown
        } else {
            with_env = format!("{shown} (with {} from the environment)", applied.join(", "));
            with_env.as_str()
        };
        if file.rules.is_empty() {
            return Err(RulesError::Empty {
                path: shown.to_owned(),
            });
        }
        let mut rules = BTreeMap::new();
        let mut overrides = BTreeMap::new();
        let bad = |source| RulesError::Rule {
            path: shown.to_owned(),
            source: Box::new(source),
        };
        for (name, spec) in &file.rules {
            rules.insert(name.clone(), Rule::from_spec(name, spec).map_err(bad)?);
            let mut set = Overrides::default();
            for (subject, o) in &spec.overrides {
                let name_err = |why: String| RulesError::OverrideName {
                    path: shown.to_owned(),
                    rule: name.clone(),
                    name: subject.chars().take(80).collect(),
                    why,
                };
                let m = SubjectMatch::parse(subject).map_err(name_err)?;
                let rule = Rule::for_override(name, spec, subject, o).map_err(bad)?;
                set.insert(subject, m, rule).map_err(name_err)?;
            }
            if !set.is_empty() {
                overrides.insert(name.clone(), set);
            }
        }
        Ok(Self { rules, overrides })
    }

    /// Rules built in code.
    pub fn from_rules(rules: impl IntoIterator<Item = Rule>) -> Self {
        Self {
            rules: rules
                .into_iter()
                .map(|r| (r.name().as_str().to_owned(), r))
                .collect(),
            overrides: BTreeMap::new(),
        }
    }

    /// These rules and `more` (one of the same name replaces it); overrides stay.
    #[must_use]
    pub fn and(mut self, more: impl IntoIterator<Item = Rule>) -> Self {
        for r in more {
            self.rules.insert(r.name().as_str().to_owned(), r);
        }
        self
    }

    /// The rule that applies to `subject` under `name`: its override if it has one,
    /// else the rule.
    pub fn resolve(&self, name: &str, subject: &[u8]) -> Result<&Rule, UnknownRule> {
        let rule = self.get(name)?;
        Ok(self
            .overrides
            .get(name)
            .and_then(|o| o.resolve(subject))
            .map_or(rule, |(_, r)| r))
    }

    /// The rule that applies to the bucket `key` of rule `name` (the subject is known by
    /// its SHA-256, which every key carries or implies).
    pub fn resolve_key(&self, name: &str, key: &BucketKey) -> Result<&Rule, UnknownRule> {
        let rule = self.get(name)?;
        let found = self
            .overrides
            .get(name)
            .zip(key.subject_sha256())
            .and_then(|(o, d)| o.resolve_digest(&d));
        Ok(found.map_or(rule, |(_, r)| r))
    }

    /// The overrides of the rule `name` (none for an unknown rule).
    pub fn overrides(&self, name: &str) -> Option<&Overrides> {
        self.overrides.get(name)
    }

    /// The rule named `name`.
    pub fn get(&self, name: &str) -> Result<&Rule, UnknownRule> {
        self.rules.get(name).ok_or_else(|| UnknownRule {
            name: name.chars().take(80).collect(),
            known: self.rules.keys().cloned().collect::<Vec<_>>().join(", "),
        })
    }

    /// All rules, by name.
    pub fn iter(&self) -> impl Iterator<Item = &Rule> {
        self.rules.values()
    }

    /// How many rules.
    pub fn len(&self) -> usize {
        self.rules.len()
    }

    /// True when there are none.
    pub fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }
}

/// Whether `path` names envoyproxy/ratelimit's YAML rather than a rules file: a `.yaml`
/// or `.yml` file, or a directory of them (as ratelimit's runtime directory).
pub fn names_yaml(path: &Path) -> bool {
    path.is_dir()
        || matches!(
            path.extension().and_then(|x| x.to_str()),
            Some("yaml" | "yml")
        )
}

/// The newest modification time under `path`: the file's, or for a directory, its own
/// and its files'.
pub fn modified(path: &Path) -> Option<std::time::SystemTime> {
    let meta = std::fs::metadata(path).ok()?;
    if !meta.is_dir() {
        return meta.modified().ok();
    }
    std::fs::read_dir(path)
        .ok()?
        .flatten()
        .filter_map(|e| e.metadata().ok()?.modified().ok())
        .chain(meta.modified().ok())
        .max()
}

/// Calls `reload` whenever the file (or directory) at `path` changes, checked every
/// second, and on SIGHUP, with why (`"file changed"`, `"SIGHUP"`). Runs until dropped.
pub async fn watch(path: &Path, mut reload: impl FnMut(&'static str)) {
    let mut seen = modified(path);
    let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
    #[cfg(unix)]
    let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).ok();
    loop {
        #[cfg(unix)]
        let hangup = async {
            match hup.as_mut() {
                Some(h) => {
                    h.recv().await;
                }
                None => std::future::pending().await,
            }
        };
        #[cfg(not(unix))]
        let hangup = std::future::pending::<()>();
        let why = tokio::select! {
            _ = tick.tick() => {
                let now = modified(path);
                if now == seen {
                    continue;
                }
                seen = now;
                "file changed"
            }
            () = hangup => "SIGHUP",
        };
        reload(why);
    }
}

const ENV_PREFIX: &str = "LEASEHOLD_RULES__";

fn env_name(rule: &str) -> String {
    rule.to_ascii_uppercase().replace(['.', '-'], "_")
}

/// Applies `LEASEHOLD_RULES__<RULE>__<FIELD>` overrides; the `config` crate does the typed
/// merge, so `"200"` becomes a number where the field wants one. Returns the variables
/// applied, by name, sorted.
fn apply_overrides(
    rules: &mut BTreeMap<String, RuleSpec>,
    vars: impl IntoIterator<Item = (String, String)>,
) -> Result<Vec<String>, RulesError> {
    let mut applied = Vec::new();
    for (var, value) in vars {
        let Some(rest) = var.strip_prefix(ENV_PREFIX) else {
            continue;
        };
        let err = |why: String| RulesError::Override {
            var: var.clone(),
            why,
        };
        let (rule, field) = rest
            .rsplit_once("__")
            .ok_or_else(|| err("expected LEASEHOLD_RULES__<RULE>__<FIELD>".into()))?;
        let (rule, subject) = match rule.split_once("__OVERRIDES__") {
            Some((rule, subject)) => (rule, Some(subject)),
            None => (rule, None),
        };
        let matches: Vec<String> = rules
            .keys()
            .filter(|name| env_name(name) == rule.to_ascii_uppercase())
            .cloned()
            .collect();
        let name = match matches.as_slice() {
            [one] => one.clone(),
            [] => {
                let known: Vec<String> = rules.keys().map(|n| env_name(n)).collect();
                return Err(err(format!(
                    "no rule {rule} in the file (rules: {})",
                    known.join(", ")
                )));
            }
            many => return Err(err(format!("matches several rules: {}", many.join(", ")))),
        };
        let field = field.to_ascii_lowercase();
        let Some(spec) = rules.get_mut(&name) else {
            continue;
        };
        if let Some(subject) = subject {
            let found: Vec<&String> = spec
                .overrides
                .keys()
                .filter(|s| env_subject(s) == subject.to_ascii_uppercase())
                .collect();
            let key = match found.as_slice() {
                [one] => (*one).clone(),
                [] => {
                    let known: Vec<String> =
                        spec.overrides.keys().map(|s| env_subject(s)).collect();
                    return Err(err(format!(
                        "rule {name} has no override {subject} (overrides: {})",
                        known.join(", ")
                    )));
                }
                many => {
                    let many: Vec<&str> = many.iter().map(|s| s.as_str()).collect();
                    return Err(err(format!(
                        "matches several overrides: {}",
                        many.join(", ")
                    )));
                }
            };
            let merged: OverrideSpec = merge_field(&spec.overrides[&key], &field, &value)
                .map_err(|e| err(format!("field {field}: {e}")))?;
            spec.overrides.insert(key, merged);
        } else {
            // The overrides stay out of the round trip: their names may hold dots.
            let overrides = std::mem::take(&mut spec.overrides);
            let merged: Result<RuleSpec, _> = merge_field(spec, &field, &value);
            spec.overrides = overrides;
            let mut merged = merged.map_err(|e| err(format!("field {field}: {e}")))?;
            merged.overrides = std::mem::take(&mut spec.overrides);
            *spec = merged;
        }
        applied.push(var);
    }
    applied.sort_unstable();
    Ok(applied)
}

/// `spec` with `field` set to `value`; the `config` crate does the typed merge, so `"200"`
/// becomes a number where the field wants one.
fn merge_field<T>(spec: &T, field: &str, value: &str) -> Result<T, config::ConfigError>
where
    T: serde::Serialize + serde::de::DeserializeOwned,
{
    config::Config::builder()
        .add_source(config::Config::try_from(spec)?)
        .set_override(field, value)?
        .build()?
        .try_deserialize()
}

/// An override's subject as an environment variable spells it.
fn env_subject(subject: &str) -> String {
    subject
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_uppercase()
            } else {
                '_'
            }
        })
        .collect()
}

/// The fields of a rule that count tokens.
const TOKEN_FIELDS: [&str; 5] = [
    "capacity",
    "lease_min",
    "lease_max",
    "max_outstanding",
    "replicas",
];

/// Refuses text that is not TOML (with the line and the text at fault), and a token
/// count written as anything but an integer (naming the rule and field).
fn whole_numbers(text: &str, shown: &str) -> Result<(), RulesError> {
    let doc = text
        .parse::<toml::Table>()
        .map_err(|e| RulesError::Syntax {
            path: shown.to_owned(),
            message: e.to_string().trim_end().chars().take(400).collect(),
        })?;
    let Some(rules) = doc.get("rules").and_then(toml::Value::as_table) else {
        return Ok(());
    };
    for (rule, spec) in rules {
        let Some(spec) = spec.as_table() else {
            continue;
        };
        let overrides = spec.get("overrides").and_then(toml::Value::as_table);
        let tables = std::iter::once((rule.chars().take(80).collect::<String>(), spec)).chain(
            overrides.into_iter().flatten().filter_map(|(name, o)| {
                let shown: String = name.chars().take(80).collect();
                Some((format!("{rule} override {shown:?}"), o.as_table()?))
            }),
        );
        for (label, table) in tables {
            for field in TOKEN_FIELDS {
                match table.get(field) {
                    None | Some(toml::Value::Integer(_)) => {}
                    Some(other) => {
                        return Err(RulesError::NotWhole {
                            path: shown.to_owned(),
                            rule: label,
                            field,
                            value: shown_value(other),
                        });
                    }
                }
            }
        }
    }
    Ok(())
}

/// A value as its author would recognise it: a large float in exponent form (`1e300`, not
/// its 301 digits), anything longer than 80 characters cut with `…`.
fn shown_value(v: &toml::Value) -> String {
    let text = match v {
        toml::Value::Float(f) if f.is_finite() && f.abs() >= 1e16 => format!("{f:e}"),
        other => other.to_string(),
    };
    if text.chars().count() > 80 {
        format!("{}…", text.chars().take(80).collect::<String>())
    } else {
        text
    }
}

/// A rule as listings show it (`check-config`, the coordinator's page), every field
/// written as an operator reads it.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct RuleSummary {
    /// The rule's name, or `override NAME` for an override.
    pub name: String,
    /// Capacity B.
    pub capacity: u64,
    /// Rate r in tokens a second while that reads well, else as written (`1/1h`).
    pub rate: String,
    /// Rate r, tokens a second.
    pub rate_per_sec: f64,
    /// `lease_max`, `-` for rate leasing (it does nothing there).
    pub lease_max: String,
    /// `auto`, `lease`, `exact` or `rate`.
    pub leasing: &'static str,
    /// The lease ttl; for rate leasing the longest term (`<= 4s`).
    pub ttl: String,
    /// `strict` or `relaxed/N`.
    pub mode: String,
    /// Shadow: decided and reported, never enforced.
    pub shadow: bool,
    /// What the rule does while the store is unreachable.
    pub on_failure: String,
    /// `single`, `global` or `region` (deployments in regions).
    pub scope: &'static str,
    /// With a local share: the seats and what the store keeps.
    pub local: Option<String>,
}

impl RuleSummary {
    /// The summary of `rule` under the label `name`.
    pub fn of(name: &str, r: &Rule) -> Self {
        use leasehold_core::rule::{FailurePolicy, Leasing, Mode, Scope};
        let per_sec = r.rate().per_sec_f64();
        let leasing = match r.leasing() {
            Leasing::Auto => "auto",
            Leasing::Lease => "lease",
            Leasing::Exact => "exact",
            Leasing::Rate => "rate",
        };
        // A rate lease's term is its lease ttl (the longest: shorter while few agents
        // share the key); `lease_max` does nothing for it.
        let (lease_max, ttl) = match r.leasing() {
            Leasing::Rate => ("-".to_owned(), format!("<= {:?}", r.lease_ttl())),
            _ => (r.lease_max().to_string(), format!("{:?}", r.lease_ttl())),
        };
        Self {
            name: name.to_owned(),
            capacity: r.capacity().get(),
            rate: if per_sec >= 0.01 {
                format!("{per_sec:.3}/s")
            } else {
                r.rate().to_string()
            },
            rate_per_sec: per_sec,
            lease_max,
            leasing,
            ttl,
            mode: match r.mode() {
                Mode::Strict => "strict".to_owned(),
                Mode::Relaxed { max_outstanding } => format!("relaxed/{max_outstanding}"),
            },
            shadow: r.shadow(),
            on_failure: match r.failure_policy() {
                FailurePolicy::FailOpen => "fail_open".to_owned(),
                FailurePolicy::FailClosed => "fail_closed (503)".to_owned(),
                FailurePolicy::LocalEmergency { rate: Some(rate) } => {
                    format!("local_emergency at {rate}")
                }
                FailurePolicy::LocalEmergency { rate: None } => {
                    "local_emergency (last share)".to_owned()
                }
            },
            scope: match r.scope() {
                Scope::Single => "single",
                Scope::Global { .. } => "global",
                Scope::Region { .. } => "region",
            },
            local: r.local().map(|l| {
                let g = r.global_part();
                format!(
                    "local share {}%: {} seats of {} tokens at {:.3}/s; the store keeps {} at {:.3}/s",
                    l.percent,
                    l.agents,
                    l.capacity,
                    l.rate.per_sec_f64(),
                    g.capacity(),
                    g.rate().per_sec_f64()
                )
            }),
        }
    }
}

impl Rules {
    /// Every rule and, after each, its overrides (labelled `override NAME`).
    pub fn summaries(&self) -> Vec<RuleSummary> {
        let mut out = Vec::new();
        for r in self.iter() {
            out.push(RuleSummary::of(r.name().as_str(), r));
            for (subject, o) in self
                .overrides(r.name().as_str())
                .into_iter()
                .flat_map(|o| o.iter())
            {
                out.push(RuleSummary::of(&format!("override {subject}"), o));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_counts_must_be_whole_and_errors_name_rule_field_and_value() {
        let e = Rules::from_toml("[rules.a]\ncapacity = 10.5\nrate = \"1/s\"\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("rule a") && e.contains("capacity = 10.5"), "{e}");
        let e = Rules::from_toml("[rules.b]\ncapacity = 10\nrate = \"1/s\"\nlease_max = \"5\"\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("rule b") && e.contains("lease_max"), "{e}");
        let e = Rules::from_toml("[rules.c]\ncapacity = 99999999999999999999\nrate = \"1/s\"\n")
            .unwrap_err()
            .to_string();
        println!("{e}");
        assert!(e.contains("capacity"), "{e}");
        // A large float as written, not as its 301 digits cut at 80.
        let e = Rules::from_toml("[rules.d]\ncapacity = 1e300\nrate = \"1/s\"\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("capacity = 1e300:"), "{e}");
    }

    #[test]
    fn reads_dotted_names_and_validates_each_rule() {
        let rules = Rules::from_toml(
            r#"
            [rules."api.write"]
            capacity = 100
            rate = "10/s"
            [rules.global]
            capacity = 10000
            rate = "5000/s"
            mode = "relaxed"
            "#,
        )
        .unwrap();
        assert_eq!(rules.len(), 2);
        assert_eq!(rules.get("api.write").unwrap().capacity().get(), 100);
        let e = rules.get("api.read").unwrap_err().to_string();
        assert!(
            e.contains("\"api.read\"") && e.contains("api.write, global"),
            "{e}"
        );
    }

    #[test]
    fn environment_overrides_fields_of_named_rules() {
        let text = "[rules.\"api.write\"]\ncapacity = 100\nrate = \"10/s\"\n[rules.Tenant-X]\ncapacity = 5\nrate = \"1/s\"\n";
        let env = |pairs: &[(&str, &str)]| -> Vec<(String, String)> {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        let rules = Rules::from_toml_with_env(
            text,
            env(&[
                ("LEASEHOLD_RULES__API_WRITE__CAPACITY", "200"),
                ("LEASEHOLD_RULES__tenant_x__RATE", "3/s"),
                ("UNRELATED", "x"),
            ]),
        )
        .unwrap();
        assert_eq!(rules.get("api.write").unwrap().capacity().get(), 200);
        assert_eq!(rules.get("Tenant-X").unwrap().rate().tokens(), 3);
        assert_eq!(rules.len(), 2, "no rule is created by an override");
        let e = Rules::from_toml_with_env(text, env(&[("LEASEHOLD_RULES__NOPE__CAPACITY", "1")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("no rule NOPE") && e.contains("API_WRITE"), "{e}");
        let e =
            Rules::from_toml_with_env(text, env(&[("LEASEHOLD_RULES__API_WRITE__CAPACTY", "1")]))
                .unwrap_err()
                .to_string();
        assert!(e.contains("capacty"), "{e}");
        let e = Rules::from_toml_with_env(
            text,
            env(&[("LEASEHOLD_RULES__API_WRITE__CAPACITY", "lots")]),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("capacity"), "{e}");
        let e =
            Rules::from_toml_with_env(text, env(&[("LEASEHOLD_RULES__API_WRITE__CAPACITY", "0")]))
                .unwrap_err()
                .to_string();
        assert!(e.contains("rule api.write: capacity"), "{e}");
        // The value came from the environment, not the file: the error says which variable.
        assert!(
            e.contains("with LEASEHOLD_RULES__API_WRITE__CAPACITY from the environment"),
            "{e}"
        );
    }

    #[test]
    fn refuses_bad_files_naming_the_problem() {
        let e = Rules::from_toml("[rules.a]\ncapacity = 0\nrate = \"1/s\"").unwrap_err();
        assert!(e.to_string().contains("rule a: capacity"), "{e}");
        let e =
            Rules::from_toml("[rules.a]\ncapacity = 5\nrate = \"1/s\"\ncapacty = 3").unwrap_err();
        assert!(e.to_string().contains("capacty"), "{e}");
        let e = Rules::from_toml("[limits.a]\ncapacity = 5").unwrap_err();
        assert!(e.to_string().contains("limits"), "{e}");
        let e = Rules::from_toml("").unwrap_err();
        assert!(e.to_string().contains("no [rules.NAME]"), "{e}");
        let e = Rules::from_file("/nonexistent/limits.toml").unwrap_err();
        assert!(e.to_string().contains("/nonexistent/limits.toml"), "{e}");
    }

    const WITH_OVERRIDES: &str = r#"
        [rules."api.write"]
        capacity = 100
        rate = "10/s"
        lease_max = 10

        [rules."api.write".overrides."tenant-42"]
        capacity = 5000
        rate = "2000/s"
        leasing = "lease"
        lease_max = 500

        [rules."api.write".overrides."sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"]
        rate = "1/s"
        shadow = true

        [rules."api.write".overrides."user.one@example.com"]
        capacity = 7
    "#;

    #[test]
    fn overrides_inherit_unset_fields_and_resolve_by_subject_or_digest() {
        let rules = Rules::from_toml(WITH_OVERRIDES).unwrap();
        let base = rules.resolve("api.write", b"tenant-1").unwrap();
        assert_eq!(
            (base.capacity().get(), base.rate().per_sec_f64() as u64),
            (100, 10)
        );
        let hot = rules.resolve("api.write", b"tenant-42").unwrap();
        assert_eq!(hot.capacity().get(), 5000);
        assert_eq!(hot.rate().per_sec_f64() as u64, 2000);
        assert_eq!(hot.leasing(), leasehold_core::Leasing::Lease);
        assert_eq!(hot.lease_max().get(), 500);
        assert_eq!(hot.name().as_str(), "api.write", "same bucket namespace");
        // "test" hashes to 9f86d0...: its override sets only the rate and shadow.
        let hashed = rules.resolve("api.write", b"test").unwrap();
        assert_eq!(
            (hashed.capacity().get(), hashed.rate().per_sec_f64() as u64),
            (100, 1)
        );
        assert_eq!(hashed.lease_max().get(), 10, "inherited");
        assert!(hashed.shadow() && !base.shadow());
        let dotted = rules.resolve("api.write", b"user.one@example.com").unwrap();
        assert_eq!(dotted.capacity().get(), 7);
        // The coordinator finds the same rules from the bucket keys.
        for subject in [
            &b"tenant-42"[..],
            b"test",
            b"tenant-1",
            b"user.one@example.com",
        ] {
            let key = BucketKey::new(base.name(), subject).unwrap();
            assert_eq!(
                rules.resolve_key("api.write", &key).unwrap(),
                rules.resolve("api.write", subject).unwrap()
            );
        }
        let o = rules.overrides("api.write").unwrap();
        assert_eq!(o.len(), 3);
        assert!(rules.resolve("api.read", b"x").is_err());
    }

    #[test]
    fn override_errors_name_the_rule_the_override_and_the_field() {
        let bad = |extra: &str| {
            Rules::from_toml(&format!(
                "[rules.a]\ncapacity = 10\nrate = \"1/s\"\n[rules.a.overrides.\"t-1\"]\n{extra}\n"
            ))
            .unwrap_err()
            .to_string()
        };
        let e = bad("capacity = 0");
        assert!(e.contains("rule a override \"t-1\": capacity"), "{e}");
        let e = bad("rate = \"fast\"");
        assert!(e.contains("rule a override \"t-1\": rate"), "{e}");
        let e = bad("capacty = 5");
        assert!(e.contains("capacty"), "{e}");
        let e = bad("capacity = 2.5");
        assert!(
            e.contains("override \"t-1\"") && e.contains("capacity = 2.5"),
            "{e}"
        );
        let e = bad("name = \"b\"");
        assert!(e.contains("name"), "{e}");
        let e = bad("[rules.a.overrides.\"t-1\".overrides.x]\ncapacity = 1");
        assert!(e.contains("overrides"), "{e}");
        let e = Rules::from_toml(
            "[rules.a]\ncapacity = 10\nrate = \"1/s\"\n[rules.a.overrides.\"sha256:12ab\"]\ncapacity = 1\n",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("override \"sha256:12ab\"") && e.contains("64 hex"),
            "{e}"
        );
        // An exact subject and its digest are the same subject: ambiguous, refused.
        let e = Rules::from_toml(
            "[rules.a]\ncapacity = 10\nrate = \"1/s\"\n[rules.a.overrides.test]\ncapacity = 1\n\
             [rules.a.overrides.\"sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08\"]\ncapacity = 2\n",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("same subject"), "{e}");
    }

    #[test]
    fn environment_reaches_overrides() {
        let vars = vec![
            (
                "LEASEHOLD_RULES__API_WRITE__OVERRIDES__TENANT_42__CAPACITY".to_owned(),
                "6000".to_owned(),
            ),
            (
                "LEASEHOLD_RULES__API_WRITE__OVERRIDES__USER_ONE_EXAMPLE_COM__RATE".to_owned(),
                "3/s".to_owned(),
            ),
            (
                "LEASEHOLD_RULES__API_WRITE__RATE".to_owned(),
                "20/s".to_owned(),
            ),
        ];
        let rules = Rules::from_toml_with_env(WITH_OVERRIDES, vars).unwrap();
        assert_eq!(
            rules
                .resolve("api.write", b"tenant-42")
                .unwrap()
                .capacity()
                .get(),
            6000
        );
        let dotted = rules.resolve("api.write", b"user.one@example.com").unwrap();
        assert_eq!(
            (dotted.capacity().get(), dotted.rate().per_sec_f64() as u64),
            (7, 3)
        );
        assert_eq!(
            rules
                .resolve("api.write", b"other")
                .unwrap()
                .rate()
                .per_sec_f64() as u64,
            20
        );
        assert_eq!(
            rules.overrides("api.write").unwrap().len(),
            3,
            "kept through the merge"
        );
        let e = Rules::from_toml_with_env(
            WITH_OVERRIDES,
            vec![(
                "LEASEHOLD_RULES__API_WRITE__OVERRIDES__TENANT_43__CAPACITY".to_owned(),
                "1".to_owned(),
            )],
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("no override TENANT_43") && e.contains("TENANT_42"),
            "{e}"
        );
    }
}
