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
//! Environment variables override fields of rules in the file:
//! `LEASEHOLD_RULES__<RULE>__<FIELD>=<value>`, where `<RULE>` is the rule's name in any
//! case with `.` and `-` written as `_` (`LEASEHOLD_RULES__API_WRITE__CAPACITY=200`). A
//! variable that names no rule of the file, names two, or names an unknown field is an
//! error: an override that silently did nothing would be worse.

use std::collections::BTreeMap;
use std::path::Path;

use leasehold_core::rule::{Rule, RuleError, RuleSpec};
use serde::Deserialize;

/// A validated set of rules by name.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Rules {
    rules: BTreeMap<String, Rule>,
}

/// Why a rules file was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RulesError {
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
    /// The file defines no rule: almost certainly the wrong file.
    #[error("rules file {path} defines no [rules.NAME] table")]
    Empty {
        /// The file.
        path: String,
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
        apply_overrides(&mut file.rules, vars)?;
        if file.rules.is_empty() {
            return Err(RulesError::Empty {
                path: shown.to_owned(),
            });
        }
        let mut rules = BTreeMap::new();
        for (name, spec) in &file.rules {
            let rule = Rule::from_spec(name, spec).map_err(|source| RulesError::Rule {
                path: shown.to_owned(),
                source: Box::new(source),
            })?;
            rules.insert(name.clone(), rule);
        }
        Ok(Self { rules })
    }

    /// Rules built in code.
    pub fn from_rules(rules: impl IntoIterator<Item = Rule>) -> Self {
        Self {
            rules: rules
                .into_iter()
                .map(|r| (r.name().as_str().to_owned(), r))
                .collect(),
        }
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

const ENV_PREFIX: &str = "LEASEHOLD_RULES__";

fn env_name(rule: &str) -> String {
    rule.to_ascii_uppercase().replace(['.', '-'], "_")
}

/// Applies `LEASEHOLD_RULES__<RULE>__<FIELD>` overrides; the `config` crate does the typed
/// merge, so `"200"` becomes a number where the field wants one.
fn apply_overrides(
    rules: &mut BTreeMap<String, RuleSpec>,
    vars: impl IntoIterator<Item = (String, String)>,
) -> Result<(), RulesError> {
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
        let spec = &rules[&name];
        let merged: RuleSpec = config::Config::builder()
            .add_source(config::Config::try_from(spec).map_err(|e| err(e.to_string()))?)
            .set_override(field.as_str(), value.as_str())
            .and_then(|b| b.build())
            .and_then(config::Config::try_deserialize)
            .map_err(|e| err(format!("field {field}: {e}")))?;
        rules.insert(name, merged);
    }
    Ok(())
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
        for field in TOKEN_FIELDS {
            match spec.get(field) {
                None | Some(toml::Value::Integer(_)) => {}
                Some(other) => {
                    return Err(RulesError::NotWhole {
                        path: shown.to_owned(),
                        rule: rule.chars().take(80).collect(),
                        field,
                        value: other.to_string().chars().take(80).collect(),
                    });
                }
            }
        }
    }
    Ok(())
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
}
