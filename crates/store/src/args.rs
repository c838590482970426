//! The command-line flags that name a store, shared by the binaries (feature `cli`).
//!
//! The address may hold a password, so it can come from a flag, the environment
//! (`LEASEHOLD_REDIS_URL`) or a file (`--redis-url-file`, first line), and it is never
//! printed: `--help` hides the environment's values and every error redacts it.

use std::path::PathBuf;

use crate::redis::{StoreConfig, TlsFiles};

/// Where the buckets live and how to reach them.
#[derive(Clone, Debug, Default, clap::Args)]
pub struct StoreArgs {
    /// The store: redis://[USER:PASSWORD@]HOST:PORT, rediss://… (TLS),
    /// cluster://HOST:PORT,HOST:PORT (clusters:// for TLS), or
    /// redis+sentinel://HOST:PORT,HOST:PORT/SERVICE (rediss+sentinel:// for TLS;
    /// ?sentinel_password=… when the Sentinels have a password of their own).
    #[arg(long, env = "LEASEHOLD_REDIS_URL", hide_env_values = true)]
    pub redis: Option<String>,
    /// Read the store's address from the first line of this file (it wins over --redis
    /// and LEASEHOLD_REDIS_URL), so a password stays off the command line.
    #[arg(long, value_name = "FILE", env = "LEASEHOLD_REDIS_URL_FILE")]
    pub redis_url_file: Option<PathBuf>,
    /// PEM file of the CA that signed the server's TLS certificate (default: the
    /// system's trust store).
    #[arg(long, env = "LEASEHOLD_REDIS_CA_FILE", value_name = "FILE")]
    pub redis_ca_file: Option<PathBuf>,
    /// PEM file of a TLS client certificate, for servers that require one.
    #[arg(long, env = "LEASEHOLD_REDIS_CLIENT_CERT", value_name = "FILE")]
    pub redis_client_cert: Option<PathBuf>,
    /// PEM file of the TLS client certificate's key.
    #[arg(long, env = "LEASEHOLD_REDIS_CLIENT_KEY", value_name = "FILE")]
    pub redis_client_key: Option<PathBuf>,
}

impl StoreArgs {
    /// The address given, if any: the file's first line, else `--redis` or the
    /// environment. An error names the file, never its contents.
    pub fn address(&self) -> Result<Option<String>, String> {
        if let Some(path) = &self.redis_url_file {
            let text = std::fs::read_to_string(path)
                .map_err(|e| format!("--redis-url-file {}: {e}", path.display()))?;
            let line = text.lines().next().unwrap_or("").trim();
            if line.is_empty() {
                return Err(format!(
                    "--redis-url-file {}: the first line is empty",
                    path.display()
                ));
            }
            return Ok(Some(line.to_owned()));
        }
        Ok(self.redis.as_ref().map(|s| s.trim().to_owned()))
    }

    /// `text` (an error) with the address's password and whatever else [`redact`]
    /// hides replaced by `***`.
    ///
    /// [`redact`]: crate::redis::redact
    pub fn redact(&self, text: &str) -> String {
        match self.address() {
            Ok(Some(a)) => crate::redis::redact_in(text, &a),
            _ => text.to_owned(),
        }
    }

    /// The connection settings with these TLS files.
    pub fn config(&self) -> StoreConfig {
        StoreConfig {
            tls: TlsFiles {
                ca_file: self.redis_ca_file.clone(),
                client_cert: self.redis_client_cert.clone(),
                client_key: self.redis_client_key.clone(),
            },
            ..StoreConfig::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_file_wins_and_is_read_to_its_first_line() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
        let path = dir.path().join("url");
        std::fs::write(&path, "redis://:pw@127.0.0.1:1\nignored\n")
            .unwrap_or_else(|e| panic!("write: {e}"));
        let args = StoreArgs {
            redis: Some("redis://other:2".into()),
            redis_url_file: Some(path.clone()),
            ..StoreArgs::default()
        };
        assert_eq!(
            args.address(),
            Ok(Some("redis://:pw@127.0.0.1:1".to_owned()))
        );
        std::fs::write(&path, "\n").unwrap_or_else(|e| panic!("write: {e}"));
        let e = args.address().err().unwrap_or_default();
        assert!(e.contains("first line is empty"), "{e}");
        let missing = StoreArgs {
            redis_url_file: Some(dir.path().join("nope")),
            ..StoreArgs::default()
        };
        let e = missing.address().err().unwrap_or_default();
        assert!(e.contains("--redis-url-file") && e.contains("nope"), "{e}");
    }
}
