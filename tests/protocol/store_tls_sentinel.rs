//! The store behind TLS (rustls, a private CA, client certificates) and behind Redis
//! Sentinel (a real failover), against real `redis-server` processes.
#![allow(clippy::expect_used, clippy::unwrap_used)] // tests fail by panicking

use crate::support;

use std::time::{Duration, Instant};

use leasehold_agent::{RedisStore, StoreConfig, StoreError, TlsFiles};
use leasehold_core::key::BucketKey;
use leasehold_core::model::{AgentId, Op, Request};
use leasehold_core::rule::RuleName;
use leasehold_redis_harness::{RedisServer, SentinelSet, TestCerts};
use support::{params, runtime};

fn key(subject: &str) -> BucketKey {
    BucketKey::new(&RuleName::new("tls").expect("name"), subject).expect("key")
}

fn exact(seq: u64, cost: u64) -> Request {
    Request {
        agent: AgentId(7),
        seq,
        op: Op::Exact { cost },
    }
}

fn tls_config(ca: Option<&std::path::Path>, client: Option<&TestCerts>) -> StoreConfig {
    {
        let mut c = support::config();
        c.tls = {
            let mut c = TlsFiles::default();
            c.ca_file = ca.map(Into::into);
            c.client_cert = client.map(|c| c.client_cert.clone());
            c.client_key = client.map(|c| c.client_key.clone());
            c
        };
        c
    }
}

async fn open(url: &str, config: StoreConfig) -> Result<RedisStore, StoreError> {
    RedisStore::open(url, config).await
}

#[test]
fn rediss_with_a_private_ca_decides_and_an_untrusted_server_is_refused() {
    let certs = TestCerts::generate().unwrap_or_else(|e| panic!("{e}"));
    let server = RedisServer::start_tls(&certs, false).unwrap_or_else(|e| panic!("{e}"));
    let url = server.tls_url().expect("tls port");
    let p = params(10, "1/s", "1s", "100ms", None);
    runtime().block_on(async {
        let store = open(&url, tls_config(Some(&certs.ca_cert), None))
            .await
            .unwrap_or_else(|e| panic!("TLS with the CA: {e}"));
        let reply = store.call(&key("a"), &p, &exact(1, 4)).await.expect("call");
        assert_eq!(reply.granted, 4);
        assert_eq!(reply.remaining, 6);

        // A CA that did not sign the server's certificate, and the system's trust
        // store (which does not hold the private CA): both refused.
        for config in [
            tls_config(Some(&certs.other_ca_cert), None),
            tls_config(None, None),
        ] {
            let e = open(&url, config).await.expect_err("untrusted server");
            let text = e.to_string();
            assert!(
                text.to_lowercase().contains("certificate") || text.contains("Unknown"),
                "the error names the certificate: {text}"
            );
        }

        // Plain text to the TLS port never passes for a connection either.
        let plain = url.replace("rediss://", "redis://");
        assert!(open(&plain, support::config()).await.is_err());
        // TLS files with a plain-text address are a configuration error.
        let e = open(&server.url(), tls_config(Some(&certs.ca_cert), None))
            .await
            .expect_err("TLS files for redis://");
        assert!(e.to_string().contains("not rediss://"), "{e}");
        // A missing or malformed file is named.
        let missing = certs.ca_cert.with_file_name("nope.crt");
        let e = open(&url, tls_config(Some(&missing), None))
            .await
            .expect_err("missing CA file");
        assert!(e.to_string().contains("nope.crt"), "{e}");
        let e = open(
            &url,
            tls_config(Some(&server.dir().join("redis.log")), None),
        )
        .await
        .expect_err("not PEM");
        assert!(e.to_string().contains("not a PEM file"), "{e}");
    });
}

#[test]
fn a_server_that_requires_client_certificates_gets_one() {
    let certs = TestCerts::generate().unwrap_or_else(|e| panic!("{e}"));
    let server = RedisServer::start_tls(&certs, true).unwrap_or_else(|e| panic!("{e}"));
    let url = server.tls_url().expect("tls port");
    let p = params(10, "1/s", "1s", "100ms", None);
    runtime().block_on(async {
        assert!(
            open(&url, tls_config(Some(&certs.ca_cert), None))
                .await
                .is_err(),
            "no client certificate: refused"
        );
        let mut half = tls_config(Some(&certs.ca_cert), Some(&certs));
        half.tls.client_key = None;
        let e = open(&url, half).await.expect_err("certificate without key");
        assert!(e.to_string().contains("without its key"), "{e}");

        let store = open(&url, tls_config(Some(&certs.ca_cert), Some(&certs)))
            .await
            .unwrap_or_else(|e| panic!("mutual TLS: {e}"));
        let reply = store
            .call(&key("m"), &p, &exact(1, 10))
            .await
            .expect("call");
        assert_eq!(reply.granted, 10);

        // The agent over mutual TLS: a capacity-3 key admits 3.
        let limiter = leasehold_agent::Limiter::builder()
            .redis(url.clone())
            .rules(support::rules(
                "[rules.t]\ncapacity = 3\nrate = \"1/h\"\nleasing = \"exact\"\n",
            ))
            .config({
                let mut c = leasehold_agent::LimiterConfig::default();
                c.store = tls_config(Some(&certs.ca_cert), Some(&certs));
                c
            })
            .build()
            .await
            .unwrap_or_else(|e| panic!("limiter over TLS: {e}"));
        let mut admitted = 0;
        for _ in 0..5 {
            if matches!(
                limiter
                    .check(&"t".into(), "tenant", 1)
                    .await
                    .expect("check"),
                leasehold_agent::Decision::Allowed { .. }
            ) {
                admitted += 1;
            }
        }
        assert_eq!(admitted, 3);
    });
}

/// The store follows a Sentinel failover: after `SENTINEL FAILOVER` the old primary is a
/// replica (writes answer READONLY), the store asks the Sentinel again and its calls
/// reach the new primary, with the bucket's state as replicated.
#[test]
fn sentinel_failover_moves_the_store_to_the_new_primary() {
    let set = SentinelSet::start().unwrap_or_else(|e| panic!("{e}"));
    runtime().block_on(async {
        let store = open(&set.url(), support::config())
            .await
            .unwrap_or_else(|e| panic!("through the Sentinel: {e}"));
        assert!(format!("{store:?}").contains("sentinel"));
        let k = key("s");
        let old = set.primary_port().expect("primary");
        debit_across_a_failover(&set, &store, &k).await;
        assert_ne!(set.primary_port().expect("primary"), old);
        let tokens = support::field(&set.pair.replica, k.as_str(), "tok");
        assert_eq!(tokens, 60, "the write went to the promoted replica");
    });
}

/// Takes 30 of `k`'s 100 tokens through `store`, has the Sentinel fail over, then takes
/// 10 more: calls fail until the store has asked the Sentinel again, then succeed on the
/// new primary, which holds the replicated debit (60 left).
async fn debit_across_a_failover(set: &SentinelSet, store: &RedisStore, k: &BucketKey) {
    let p = params(100, "1/h", "1s", "100ms", None);
    let r = store.call(k, &p, &exact(1, 30)).await.expect("call");
    assert_eq!((r.granted, r.remaining), (30, 70));
    set.pair
        .wait_synced(Duration::from_secs(10))
        .unwrap_or_else(|e| panic!("{e}"));
    set.fail_over().unwrap_or_else(|e| panic!("{e}"));
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut seq = 2;
    let reply = loop {
        seq += 1;
        match store.call(k, &p, &exact(seq, 10)).await {
            Ok(r) => break r,
            Err(e) if Instant::now() < deadline => {
                eprintln!("during failover: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("the store never reached the new primary: {e}"),
        }
    };
    assert_eq!((reply.granted, reply.remaining), (10, 60));
}

/// The primary's password in a Sentinel address is percent-decoded, as redis-rs
/// decodes a redis:// address's.
#[test]
fn a_sentinel_address_s_password_is_percent_decoded() {
    let set = SentinelSet::start().unwrap_or_else(|e| panic!("{e}"));
    let _: () = set
        .pair
        .primary
        .cmd(&["CONFIG", "SET", "requirepass", "a?b#c%d"])
        .unwrap_or_else(|e| panic!("{e}"));
    let url = format!(
        "redis+sentinel://:a%3Fb%23c%25d@127.0.0.1:{}/{}",
        set.port(),
        SentinelSet::SERVICE
    );
    let p = params(100, "1/h", "1s", "100ms", None);
    runtime().block_on(async {
        let store = open(&url, support::config())
            .await
            .unwrap_or_else(|e| panic!("with the decoded password: {e}"));
        let r = store
            .call(&key("pw"), &p, &exact(1, 5))
            .await
            .expect("call");
        assert_eq!((r.granted, r.remaining), (5, 95));
    });
}

/// Sentinels with a password of their own (`requirepass`, or their default user's) are
/// reached with the address's `sentinel_password`, percent-decoded; the credentials
/// before the `@` stay the primary's. The store then follows a failover through them.
/// Without it, or with a parameter misspelt, the error says what is missing and shows no
/// password.
#[test]
fn sentinels_with_a_password_of_their_own_are_reached_with_sentinel_password() {
    let set = SentinelSet::start().unwrap_or_else(|e| panic!("{e}"));
    set.require_password("s&nt#pw-secret")
        .unwrap_or_else(|e| panic!("{e}"));
    let base = format!(
        "redis+sentinel://127.0.0.1:{}/{}",
        set.port(),
        SentinelSet::SERVICE
    );
    runtime().block_on(async {
        for (address, says) in [
            (
                base.clone(),
                "the Sentinels refused the credentials (NOAUTH): theirs go in \
                 ?sentinel_password=",
            ),
            (
                format!("{base}?sentinel_pasword=s%26nt%23pw-secret"),
                "an unknown parameter `sentinel_pasword`",
            ),
            // A raw `&` cuts the password: the rest is no parameter, and not shown.
            (
                format!("{base}?sentinel_password=s&nt%23pw-secret"),
                "an unknown parameter (not shown)",
            ),
            (
                format!("{base}?sentinel_password=s%26nt#pw-secret"),
                "(%23)",
            ),
            (
                format!("{base}?sentinel_password=50%off-pw-secret"),
                "a `%` in `sentinel_password`",
            ),
            (
                format!("{base}?sentinel_password="),
                "`sentinel_password` needs a value",
            ),
            (
                format!("{base}?sentinel_password=wrong-secret"),
                "the Sentinels refused the credentials (WRONGPASS)",
            ),
        ] {
            let e = open(&address, support::config())
                .await
                .expect_err(&address)
                .to_string();
            assert!(e.contains(says), "{address}: {e}");
            assert!(
                !e.contains("pw-secret") && !e.contains("wrong-secret"),
                "{e}"
            );
        }
        let url = format!("{base}?sentinel_password=s%26nt%23pw-secret");
        let store = open(&url, support::config())
            .await
            .unwrap_or_else(|e| panic!("with the Sentinel's password: {e}"));
        debit_across_a_failover(&set, &store, &key("sp")).await;
        drop(store);

        // The primary with a password of its own (the Sentinel told it): a wrong one
        // before the @ is said to be the primary's, the Sentinels having taken theirs.
        let primary = if set.primary_port().expect("primary") == set.pair.replica.port() {
            &set.pair.replica
        } else {
            &set.pair.primary
        };
        let _: () = primary
            .cmd(&["CONFIG", "SET", "requirepass", "prim-secret"])
            .unwrap_or_else(|e| panic!("{e}"));
        let _: String = set
            .cmd(&[
                "SENTINEL",
                "SET",
                SentinelSet::SERVICE,
                "auth-pass",
                "prim-secret",
            ])
            .unwrap_or_else(|e| panic!("{e}"));
        let wrong = format!(
            "redis+sentinel://:wrong-secret@127.0.0.1:{}/{}?sentinel_password=s%26nt%23pw-secret",
            set.port(),
            SentinelSet::SERVICE
        );
        let e = open(&wrong, support::config())
            .await
            .expect_err("a wrong primary password")
            .to_string();
        assert!(
            e.contains("the primary the Sentinels name refused the credentials (WRONGPASS)"),
            "{e}"
        );
        assert!(!e.contains("-secret"), "{e}");
    });
}

#[test]
fn sentinel_addresses_are_checked_and_their_passwords_never_shown() {
    runtime().block_on(async {
        for (address, says) in [
            ("redis+sentinel://127.0.0.1:1", "no /SERVICE"),
            ("redis+sentinel://127.0.0.1:1/", "service name"),
            ("redis+sentinel:///svc", "no Sentinel"),
            ("redis+sentinel://127.0.0.1/svc", ":PORT"),
            (
                "redis+sentinel://:pw-secret@127.0.0.1:x/svc",
                "not a number",
            ),
            // As in redis:// addresses, `?` and `#` in the password are percent-encoded.
            (
                "redis+sentinel://:pw-secret#x@127.0.0.1:1/svc",
                "must be percent-encoded",
            ),
            // A cluster address without nodes is named as such, not in the client's words.
            ("cluster://", "cluster address with no nodes"),
            ("clusters://,", "cluster address with no nodes"),
        ] {
            let e = open(address, support::config())
                .await
                .expect_err(address)
                .to_string();
            assert!(e.contains(says), "{address}: {e}");
            assert!(!e.contains("pw-secret"), "{e}");
        }
        // Nothing listens: unavailable, and the password stays hidden.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("port")
            .port();
        let e = open(
            &format!("redis+sentinel://:pw-secret@127.0.0.1:{port}/svc"),
            support::config(),
        )
        .await
        .expect_err("no sentinel")
        .to_string();
        assert!(!e.contains("pw-secret"), "{e}");
    });
}

/// A planned failover (`SENTINEL FAILOVER`) under load mints nothing. Sentinel promotes
/// the replica and only later demotes the old primary, which takes writes meanwhile and
/// loses them: an agent that kept spending there saw the same budget twice (about B over
/// the run). The store fences the service from the Sentinel's first announcement of the
/// failover to its switch, so the whole run admits at most B + r·T.
#[test]
fn a_planned_sentinel_failover_under_load_admits_at_most_the_bound() {
    planned_failover_under_load("auto");
}

/// As above, the key leased by rate: the shares and bursts written to the old primary
/// after the new one was promoted are lost with it, and the agents' renewals on the new
/// primary find their records as replicated (or none): still at most B + r·T.
#[test]
fn a_planned_sentinel_failover_under_rate_leases_admits_at_most_the_bound() {
    planned_failover_under_load("rate");
}

/// Four callers flat out on one key of `leasing` through a Sentinel failover.
fn planned_failover_under_load(leasing: &str) {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    let set = Arc::new(SentinelSet::start().unwrap_or_else(|e| panic!("{e}")));
    let (capacity, rate) = (100u64, 10u64);
    runtime().block_on(async {
        let limiter = support::limiter(
            &set.url(),
            &format!(
                "[rules.hot]\ncapacity = {capacity}\nrate = \"{rate}/s\"\non_failure = \"fail_closed\"\nleasing = \"{leasing}\"\n"
            ),
        )
        .await;
        // The store follows the Sentinel's announcements from here on.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let stop = Arc::new(AtomicBool::new(false));
        let admitted = Arc::new(AtomicU64::new(0));
        let unavailable = Arc::new(AtomicU64::new(0));
        let started = Instant::now();
        let tasks: Vec<_> = (0..4)
            .map(|_| {
                let (l, stop, admitted, unavailable) = (
                    limiter.clone(),
                    stop.clone(),
                    admitted.clone(),
                    unavailable.clone(),
                );
                tokio::spawn(async move {
                    while !stop.load(Ordering::Relaxed) {
                        match l.check(&"hot".into(), "tenant", 1).await.expect("valid check") {
                            leasehold_agent::Decision::Allowed { .. } => {
                                admitted.fetch_add(1, Ordering::Relaxed);
                            }
                            leasehold_agent::Decision::Unavailable { .. } => {
                                unavailable.fetch_add(1, Ordering::Relaxed);
                                tokio::time::sleep(Duration::from_millis(5)).await;
                            }
                            _ => tokio::time::sleep(Duration::from_millis(1)).await,
                        }
                    }
                })
            })
            .collect();
        tokio::time::sleep(Duration::from_secs(2)).await;
        let s = set.clone();
        tokio::task::spawn_blocking(move || s.fail_over())
            .await
            .expect("join")
            .unwrap_or_else(|e| panic!("{e}"));
        let failed_over = started.elapsed();
        // Long enough after the demotion for the new primary's bucket to be spent again.
        tokio::time::sleep(Duration::from_secs(3)).await;
        stop.store(true, Ordering::Relaxed);
        for t in tasks {
            t.await.expect("hammer");
        }
        let elapsed = started.elapsed().as_secs_f64();
        let bound = capacity + (rate as f64 * elapsed).ceil() as u64;
        let got = admitted.load(Ordering::Relaxed);
        eprintln!(
            "failover done after {failed_over:?}; {got} admitted in {elapsed:.1} s \
             (bound {bound}); {} unavailable",
            unavailable.load(Ordering::Relaxed)
        );
        assert!(got <= bound, "{got} admitted against a bound of {bound}");
        // And the limiter went on deciding with the new primary.
        assert!(
            got >= capacity,
            "{got} admitted: the limiter stopped deciding"
        );
        limiter.shutdown().await;
    });
}
