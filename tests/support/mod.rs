//! Helpers shared by the integration tests.
#![allow(dead_code, unreachable_pub, clippy::expect_used)]

use std::collections::BTreeMap;
use std::time::Duration;

use gateway_agent::{RedisStore, StoreConfig};
use lease_core::rule::{BucketParams, Rule, RuleSpec};
use redis_harness::RedisServer;

/// A rule's bucket parameters from its spec fields.
pub fn params(
    capacity: u64,
    rate: &str,
    ttl: &str,
    grace: &str,
    relaxed: Option<u64>,
) -> BucketParams {
    let spec = RuleSpec {
        capacity,
        rate: rate.into(),
        lease_ttl: Some(ttl.into()),
        grace: Some(grace.into()),
        lease_max: Some(capacity),
        mode: relaxed.map(|_| "relaxed".into()),
        max_outstanding: relaxed,
        ..RuleSpec::default()
    };
    Rule::from_spec("test", &spec)
        .expect("test rules are valid")
        .bucket_params()
}

/// A multi-threaded runtime for one test.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
}

/// Starts a node, failing the test with install instructions if Redis is missing.
pub fn server() -> RedisServer {
    RedisServer::start().unwrap_or_else(|e| panic!("{e}"))
}

/// A store on `url` with test timeouts.
pub async fn store(url: &str) -> RedisStore {
    RedisStore::connect(url, config())
        .await
        .unwrap_or_else(|e| panic!("connect {url}: {e}"))
}

/// Timeouts for tests: short enough to see faults, long enough for a loaded CI machine.
pub fn config() -> StoreConfig {
    StoreConfig {
        connect_timeout: Duration::from_secs(2),
        call_timeout: Duration::from_millis(800),
    }
}

/// The hash of a bucket as Redis holds it.
pub fn hash(server: &RedisServer, key: &str) -> BTreeMap<String, String> {
    let mut c = server.connection().expect("connection");
    redis::cmd("HGETALL")
        .arg(key)
        .query(&mut c)
        .expect("HGETALL")
}

/// One field of a bucket as a number.
pub fn field(server: &RedisServer, key: &str, name: &str) -> u64 {
    hash(server, key)
        .get(name)
        .map_or(0, |v| v.parse().expect("numeric field"))
}
