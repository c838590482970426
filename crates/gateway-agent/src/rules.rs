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

use std::collections::BTreeMap;
use std::path::Path;

use lease_core::rule::{Rule, RuleError, RuleSpec};
use serde::Deserialize;

/// A validated set of rules by name.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Rules {
    rules: BTreeMap<String, Rule>,
}

/// Why a rules file was refused.
#[derive(Debug, thiserror::Error)]
pub enum RulesError {
    /// The file could not be read or is not valid TOML of the expected shape.
    #[error("rules file {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// What went wrong.
        source: config::ConfigError,
    },
    /// A rule is invalid.
    #[error("rules file {path}: {source}")]
    Rule {
        /// The file.
        path: String,
        /// The rule's problem.
        source: RuleError,
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
    /// Reads and validates a TOML rules file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, RulesError> {
        let path = path.as_ref();
        let shown = path.display().to_string();
        let source = config::File::from(path).format(config::FileFormat::Toml);
        Self::load(source, &shown)
    }

    /// Parses and validates rules from TOML text.
    pub fn from_toml(text: &str) -> Result<Self, RulesError> {
        Self::load(
            config::File::from_str(text, config::FileFormat::Toml),
            "<inline>",
        )
    }

    fn load<S>(source: S, shown: &str) -> Result<Self, RulesError>
    where
        S: config::Source + Send + Sync + 'static,
    {
        let read = |source| RulesError::Read {
            path: shown.to_owned(),
            source,
        };
        let file: RulesFile = config::Config::builder()
            .add_source(source)
            .build()
            .map_err(read)?
            .try_deserialize()
            .map_err(read)?;
        if file.rules.is_empty() {
            return Err(RulesError::Empty {
                path: shown.to_owned(),
            });
        }
        let mut rules = BTreeMap::new();
        for (name, spec) in &file.rules {
            let rule = Rule::from_spec(name, spec).map_err(|source| RulesError::Rule {
                path: shown.to_owned(),
                source,
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

#[cfg(test)]
mod tests {
    use super::*;

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
