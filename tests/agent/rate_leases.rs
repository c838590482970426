//! Rate leases (`leasing = "rate"`) on real Redis: agents spending flat out keep the
//! bound, call the store a few times a term whatever their volume, and the bucket's hash
//! shows their shares; an idle agent gives its share up.
#![allow(clippy::expect_used, clippy::unwrap_used)] // tests fail by panicking

use crate::support;

use std::time::Duration;

use support::{field, server};

const RULES: &str =
    "[rules.rl]\ncapacity = 1000\nrate = \"2000/s\"\nleasing = \"rate\"\nterm = \"2s\"\n";

#[test]
fn agents_flat_out_on_rate_leases_keep_the_bound_and_call_a_few_times_a_term() {
    let server = server();
    support::runtime().block_on(async {
        let agents = support::limiters(&server.url(), RULES, 8).await;
        let (admitted, decisions, elapsed) =
            support::flat_out(&agents, 1, "rl", "tenant", Duration::from_secs(4)).await;
        let calls: u64 = agents
            .iter()
            .map(|l| l.stats("rl").unwrap().store_calls)
            .sum();
        let bound = 1000.0 + 2000.0 * elapsed;
        println!(
            "8 agents on rate leases for {elapsed:.2}s: {decisions} decisions, {admitted} admitted \
             (bound {bound:.0}, utilisation {:.3}), {calls} store calls",
            admitted as f64 / bound
        );
        assert!(admitted as f64 <= bound, "admitted {admitted} > {bound}");
        // Each agent: its first call, one once the fleet's demand is known, a renewal at
        // three quarters of each term (0.4 s while so few agents share the key), and the
        // ones its demand makes (flat out, the denied callers it counts swing it by more
        // than half now and then) or a limited grant (backing off). Token leases on this
        // load call thousands of times.
        assert!(calls <= 8 * 60, "{calls} store calls");
        // Loose: flat-out callers on two cores starve the agents' own tasks (see the
        // README's figures for paced load).
        assert!(
            admitted as f64 >= 0.3 * bound,
            "the shares were spent: {admitted} of {bound}"
        );
        // The hash: every agent's share counts, within the rate.
        let key = "lh:{rl|tenant}";
        let holders = field(&server, key, "sn");
        assert!((1..=8).contains(&holders), "{holders} records with a share");
        let unit = field(&server, key, "su");
        let shared = field(&server, key, "sh") as f64 * 1e6 / unit as f64;
        assert!(shared <= 2000.0 + 1e-6, "{shared} tokens/s leased");
        // Idle for longer than the rule's idle time: every agent gives its share up.
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert_eq!(field(&server, key, "sn"), 0, "shares given up when idle");
    });
}

/// Gateways added to a fleet that is already flat out on a key (a scale-out under load):
/// the first ones' bursts may hold all of B, and the newcomers get a burst, and with it a
/// share, once those renew (their bursts shrink to their part of B). They got none for as
/// long as the first ones kept renewing: 5 of 8 agents held B and the other 3 admitted
/// nothing from a lease.
#[test]
fn gateways_added_under_load_get_a_share() {
    let server = server();
    support::runtime().block_on(async {
        let agents = support::limiters(&server.url(), RULES, 8).await;
        support::flat_out(&agents[..5], 1, "rl", "tenant", Duration::from_secs(1)).await;
        let (admitted, _, elapsed) =
            support::flat_out(&agents, 1, "rl", "tenant", Duration::from_secs(3)).await;
        let late: Vec<u64> = (agents[5..].iter())
            .map(|l| l.stats("rl").unwrap().admitted_lease)
            .collect();
        println!(
            "late agents admitted from their leases: {late:?}; all: {admitted} in {elapsed:.2}s"
        );
        assert!(
            late.iter().all(|&n| n > 0),
            "a late agent got no share: {late:?}"
        );
        assert_eq!(
            field(&server, "lh:{rl|tenant}", "sn"),
            8,
            "every agent holds a share"
        );
    });
}

/// A Redis that restarts empty under rate leases (no persistence: every bucket and
/// record gone): the agents' next renewals find no record and a new bucket, and every
/// agent holds a share again; what is admitted after the restart stays within what the
/// agents' bursts held plus B + r·t.
#[test]
fn rate_leases_come_back_after_redis_restarts_empty() {
    let mut server = server();
    support::runtime().block_on(async {
        let agents = support::limiters(&server.url(), RULES, 4).await;
        let (before, _, _) =
            support::flat_out(&agents, 1, "rl", "tenant", Duration::from_secs(2)).await;
        server.restart().expect("restart");
        let (after, decisions, elapsed) =
            support::flat_out(&agents, 1, "rl", "tenant", Duration::from_secs(3)).await;
        let holders = field(&server, "lh:{rl|tenant}", "sn");
        println!("before the restart {before}; after it {after} of {decisions} in {elapsed:.2}s; {holders} shares");
        assert!(after as f64 <= 2.0 * 1000.0 + 2000.0 * elapsed, "{after}");
        assert!(after as f64 >= 0.5 * 2000.0 * elapsed, "{after}: the shares did not come back");
        assert_eq!(holders, 4);
    });
}

/// What a rate lease's admissions report as remaining (the quota headers, serve's
/// `limit_remaining`): what the agent can still admit, falling with each admission. (It
/// read the rate reply's burst as the bucket's level: 4, 3, 2, then 5, 5 with a reset of 0,
/// then a refusal.)
#[test]
fn a_rate_lease_reports_what_it_has_left() {
    let server = server();
    support::runtime().block_on(async {
        let rules = "[rules.rl]\ncapacity = 5\nrate = \"5/s\"\nleasing = \"rate\"\nterm = \"2s\"\n";
        let l = support::limiter(&server.url(), rules).await;
        let check = [leasehold_agent::Check::new(&"rl".into(), "k1", 1)];
        let mut seen = Vec::new();
        for _ in 0..6 {
            let mut each = Vec::new();
            let (d, _) = l.check_all_each(&check, &mut each).await.unwrap();
            seen.push(d);
            // 20 a second against 5: the lease comes in after a few exact calls.
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(
            seen.iter().any(|d| matches!(
                d,
                leasehold_agent::Decision::Allowed {
                    via: leasehold_agent::Admission::Lease,
                    ..
                }
            )),
            "no admission from the lease: {seen:?}"
        );
        // Each admission takes one and at most one comes back between two (one per 200
        // ms): what is said to be left never rises, and a refusal follows nothing left.
        let mut last = u64::MAX;
        for d in &seen {
            match *d {
                leasehold_agent::Decision::Allowed { remaining, .. } => {
                    assert!(remaining <= last, "{seen:?}");
                    last = remaining;
                }
                _ => assert!(last <= 1, "refused with {last} said to be left: {seen:?}"),
            }
        }
    });
}

/// A gateway the load moves to: its key's first caller is decided exactly and refused (the
/// level is empty while the other agent's share holds the whole rate), and that denial is
/// remembered only until the key's first call may be due. It was remembered for the
/// store's whole wait, its callers refused meanwhile without reaching the store or the
/// policy, so the call that gets the key its share came that much later: in `simulate`'s
/// fleet-rate-shifting scenario a move now and then admitted next to nothing for a second.
#[test]
fn a_gateway_the_load_moves_to_is_not_kept_from_its_first_call() {
    let server = server();
    support::runtime().block_on(async {
        let from = support::limiter(&server.url(), RULES).await;
        let to = support::limiter(&server.url(), RULES).await;
        let rule = "rl".into();
        // The whole rate goes to the first agent's share.
        support::flat_out(
            std::slice::from_ref(&from),
            1,
            "rl",
            "tenant",
            Duration::from_secs(1),
        )
        .await;
        let first = to.check(&rule, "tenant", 1).await.unwrap();
        let calls = to.stats("rl").unwrap().store_calls;
        let leasehold_agent::Decision::Denied {
            retry_after: waited,
        } = first
        else {
            panic!("the first caller was admitted ({first:?}): the level had a token");
        };
        tokio::time::sleep(Duration::from_millis(30)).await;
        let _ = to.check(&rule, "tenant", 1).await.unwrap();
        let after = to.stats("rl").unwrap().store_calls;
        println!("refused with a wait of {waited:?}; store calls {calls} then {after}");
        assert!(
            after > calls,
            "a caller 30 ms after the first refusal (a wait of {waited:?}) went to the store"
        );
    });
}

/// A gateway's own load jumping, far below the limit, is not refused, and what it reports
/// as left is the bucket's, not its burst. Its share and burst were sized by the demand
/// before (20 a second: a burst of 10); the cell ran dry within tens of milliseconds of
/// the jump and refused its callers until the renewal the surge made came back (11-16 of
/// 400 in `leasehold serve`), and each admission reported the burst as what was left (0-6
/// against 20 000). A dry cell now borrows from the level with one renewal.
#[test]
fn a_gateway_whose_load_jumps_below_the_limit_is_not_refused() {
    let server = server();
    support::runtime().block_on(async {
        let rules =
            "[rules.rl]\ncapacity = 20000\nrate = \"20000/s\"\nleasing = \"rate\"\nterm = \"8s\"\n";
        let l = support::limiter(&server.url(), rules).await;
        // As the quota headers and serve decide: `remaining` is the key's quota.
        let check = [leasehold_agent::Check::new(&"rl".into(), "tenant", 1)];
        let mut each = Vec::new();
        let mut refused = [0u32; 2];
        let mut least_left = u64::MAX;
        let start = tokio::time::Instant::now();
        let mut at = Duration::ZERO;
        // 20 a second for 2 s, then 200 a second for 2 s.
        for (phase, per_sec) in [(0, 20u32), (1, 200)] {
            for _ in 0..2 * per_sec {
                tokio::time::sleep_until(start + at).await;
                at += Duration::from_secs(1) / per_sec;
                match l.check_all_each(&check, &mut each).await.unwrap().0 {
                    leasehold_agent::Decision::Allowed { remaining, .. } => {
                        if phase == 1 {
                            least_left = least_left.min(remaining);
                        }
                    }
                    _ => refused[phase] += 1,
                }
            }
        }
        let calls = l.stats("rl").unwrap().store_calls;
        println!(
            "refused {refused:?} (20/s, then 200/s); least said to be left {least_left}; \
             {calls} store calls"
        );
        assert_eq!(refused, [0, 0], "refused below the limit");
        // About the bucket's level: the bursts hold a fraction of a second of the demand.
        assert!(least_left >= 10_000, "said to be left: {least_left}");
        // The first calls, the ones the jump makes, and a renewal or two: no call per
        // request.
        assert!(calls <= 40, "{calls} store calls");
    });
}
