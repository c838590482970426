//! The coordinator's leader lock on a real Redis: one leader at a time, renewed only by
//! its holder, handed over when it lapses, and never extended or deleted by an instance
//! that lost it (token compare and act in one script).
#![allow(clippy::expect_used, clippy::unwrap_used)] // tests fail by panicking

use crate::support;

use std::time::Duration;

use leasehold_agent::RedisStore;
use leasehold_coordinator::{Coordinator, CoordinatorConfig, service::LOCK_KEY};

const RULES: &str = "[rules.api]\ncapacity = 10\nrate = \"10/s\"\n";

async fn instance(url: &str) -> Coordinator {
    let store = RedisStore::connect(url, support::config()).await.unwrap();
    let config = {
        let mut c = CoordinatorConfig::default();
        c.lock_ttl = Duration::from_secs(30);
        c
    };
    Coordinator::new(store, support::rules(RULES), config)
}

#[test]
fn one_leader_and_a_lost_lock_is_left_alone() {
    let server = support::server();
    support::runtime().block_on(async {
        let a = instance(&server.url()).await;
        let b = instance(&server.url()).await;
        a.tick().await.unwrap();
        b.tick().await.unwrap();
        assert!(
            a.snapshot().read().leader,
            "the first instance takes the lock"
        );
        assert!(!b.snapshot().read().leader, "the second does not");
        let holder_a: String = server.cmd(&["GET", LOCK_KEY]).unwrap();

        // A's lock lapses (here: removed) and B takes it.
        let _: i64 = server.cmd(&["DEL", LOCK_KEY]).unwrap();
        b.tick().await.unwrap();
        assert!(b.snapshot().read().leader);
        let holder_b: String = server.cmd(&["GET", LOCK_KEY]).unwrap();
        assert_ne!(holder_a, holder_b);

        // B's lock with a short expiry: A's renewal must not touch it.
        let _: i64 = server.cmd(&["PEXPIRE", LOCK_KEY, "20000"]).unwrap();
        a.tick().await.unwrap();
        assert!(!a.snapshot().read().leader, "A lost the lock");
        let pttl: i64 = server.cmd(&["PTTL", LOCK_KEY]).unwrap();
        assert!(pttl <= 20_000, "A extended B's lock to {pttl} ms");
        let holder: String = server.cmd(&["GET", LOCK_KEY]).unwrap();
        assert_eq!(holder, holder_b);

        // A stops: B's lock stays. B renews its own.
        let running = std::sync::Arc::new(a).spawn();
        running.stop().await;
        let holder: String = server.cmd(&["GET", LOCK_KEY]).unwrap();
        assert_eq!(
            holder, holder_b,
            "a stopped instance deleted another's lock"
        );
        b.tick().await.unwrap();
        let pttl: i64 = server.cmd(&["PTTL", LOCK_KEY]).unwrap();
        assert!(pttl > 20_000, "B renewed its lock: {pttl} ms");

        // B stops: the lock is released.
        std::sync::Arc::new(b).spawn().stop().await;
        let exists: i64 = server.cmd(&["EXISTS", LOCK_KEY]).unwrap();
        assert_eq!(exists, 0, "the leader gives the lock up when it stops");
    });
}
