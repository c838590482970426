//! A Redis that may evict bucket keys is refused: an evicted bucket comes back full and
//! would admit again what was already spent. Every bucket key carries an expiry, so the
//! volatile-* policies count as evicting too; only noeviction is accepted, unless the
//! operator opts in.
#![allow(clippy::expect_used, clippy::unwrap_used)] // tests fail by panicking

use crate::support;

use leasehold_agent::{BuildError, Limiter, LimiterConfig};

const RULES: &str = "[rules.api]\ncapacity = 100\nrate = \"1/1h\"\n";

async fn build(url: &str, allow: bool) -> Result<Limiter, BuildError> {
    Limiter::builder()
        .redis(url)
        .rules(support::rules(RULES))
        .config({
            let mut c = LimiterConfig::default();
            c.store = support::config();
            c.allow_evicting_store = allow;
            c
        })
        .build()
        .await
}

#[test]
fn an_evicting_store_is_refused_unless_allowed() {
    let server = support::server();
    support::runtime().block_on(async {
        assert!(
            build(&server.url(), false).await.is_ok(),
            "noeviction is accepted"
        );
        for policy in [
            "allkeys-lru",
            "volatile-lru",
            "volatile-ttl",
            "allkeys-random",
        ] {
            let _: () = server
                .cmd(&["CONFIG", "SET", "maxmemory-policy", policy])
                .unwrap();
            let err = build(&server.url(), false)
                .await
                .expect_err(policy)
                .to_string();
            assert!(err.contains(policy) && err.contains("noeviction"), "{err}");
            let l = build(&server.url(), true)
                .await
                .expect("allowed by the operator");
            assert!(matches!(
                l.check(&"api".into(), "t", 1).await.unwrap(),
                leasehold_agent::Decision::Allowed { .. }
            ));
        }
    });
}

/// A bucket lost while an agent holds a lease from it (evicted, flushed) restarts empty
/// when the agent next declares what it holds: nothing already handed out is admitted
/// again. (Leases of at least 10 here, so the agent still holds tokens when it asks
/// for more; a bucket lost while nobody holds a lease from it cannot be told from a new
/// one, which is why an evicting store is refused.)
#[test]
fn a_bucket_lost_under_a_lease_restarts_empty() {
    let server = support::server();
    support::runtime().block_on(async {
        let rules =
            "[rules.api]\ncapacity = 100\nrate = \"1/1h\"\nleasing = \"lease\"\nlease_min = 10\n";
        let l = support::limiter(&server.url(), rules).await;
        let key = leasehold_core::key::BucketKey::new(
            &leasehold_core::rule::RuleName::new("api").unwrap(),
            "tenant-1",
        )
        .unwrap();
        let mut admitted = 0u64;
        // Traffic for a while (the agent leases and measures its demand), then the
        // bucket is lost.
        for _ in 0..20 {
            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
            if matches!(
                l.check(&"api".into(), "tenant-1", 1).await.unwrap(),
                leasehold_agent::Decision::Allowed { .. }
            ) {
                admitted += 1;
            }
        }
        let _: i64 = server.cmd(&["DEL", key.as_str()]).unwrap();
        // Everything the agent can still get: its lease, and what a bucket restarted
        // empty refills (one token an hour).
        for i in 0..400 {
            if i % 20 == 0 {
                tokio::time::sleep(std::time::Duration::from_millis(1)).await;
            }
            if matches!(
                l.check(&"api".into(), "tenant-1", 1).await.unwrap(),
                leasehold_agent::Decision::Allowed { .. }
            ) {
                admitted += 1;
            }
        }
        println!("admitted {admitted} of B = 100 with the bucket lost after 20 decisions");
        assert!(
            admitted <= 100 + 1,
            "a lost bucket minted tokens: {admitted} admitted"
        );
    });
}
