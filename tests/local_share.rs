//! The local share on a real Redis: `lh_seat` against its model, and agents spending
//! seats and the global part together within one bucket's bound.
#![allow(clippy::expect_used, clippy::unwrap_used)] // tests fail by panicking

mod support;

use leasehold_core::local::{SeatReply, seats_key};
use leasehold_core::model::AgentId;
use leasehold_core::model::seats::Seats;
use support::{runtime, server, store};

/// Claims, renewals, refusals and leaving, the same on Redis as in the model (with the
/// model run at Redis's own times, read back from the key's `ts`), and hostile input
/// refused by name.
#[test]
fn lh_seat_matches_the_model() {
    let server = server();
    runtime().block_on(async {
        let st = store(&server.url()).await;
        let mut model = Seats::new();
        let ttl = 300_000;
        let steps: &[(u64, bool, u64)] = &[
            (1, false, 0),
            (2, false, 0),
            (3, false, 0),
            (1, false, 50),
            (3, false, 0),
            (2, true, 0),
            (3, false, 0),
            (4, false, 0),
            (1, false, 400),
            (4, false, 0),
            (5, false, 0),
        ];
        for &(agent, leave, sleep_ms) in steps {
            tokio::time::sleep(std::time::Duration::from_millis(sleep_ms)).await;
            let got = st
                .claim_seat("seats", AgentId(agent), 2, ttl, leave)
                .await
                .expect("lh_seat");
            let ts: String = server
                .cmd(&["HGET", &seats_key("seats"), "ts"])
                .expect("ts");
            let now: u64 = ts.parse().unwrap();
            let want = if leave {
                model.leave(AgentId(agent));
                SeatReply::Full { retry_us: 0 }
            } else {
                model.claim(AgentId(agent), 2, ttl, now)
            };
            assert_eq!(got, want, "agent {agent} leave {leave} at {now}");
            assert!(model.held(now) <= 2);
        }
        let pttl: i64 = server.cmd(&["PTTL", &seats_key("seats")]).expect("PTTL");
        assert!(pttl > 1000 && pttl <= 1300, "the key outlives its last tenure: {pttl}");
        let mut c = server.connection().unwrap();
        for (args, want) in [
            (vec!["lh:{x|y}", "ab", "2", "10", "0"], "not a seats key"),
            (vec!["lh:{x}:seats", "zz", "2", "10", "0"], "agent"),
            (vec!["lh:{x}:seats", "ab", "0", "10", "0"], "seats or ttl_us = 0"),
            (vec!["lh:{x}:seats", "ab", "5000", "10", "0"], "seats = 5000"),
            (vec!["lh:{x}:seats", "ab", "2", "10", "2"], "leave = 2"),
        ] {
            let e = redis::cmd("FCALL")
                .arg("lh_seat")
                .arg(1)
                .arg(&args)
                .query::<redis::Value>(&mut c)
                .unwrap_err()
                .to_string();
            assert!(e.contains(want), "{args:?}: {e}");
        }
    });
}
