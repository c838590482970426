//! The function library against hostile or mistaken callers on a real Redis: it refuses
//! before reading or writing anything, and names what is wrong in a short message.
//! Foreign keys, two keys, no key, split arguments on a plain bucket (and none on a
//! part), numbers in forms other than plain decimal, 1 MB arguments. After each refusal
//! the hash and the expiry of every key involved are as they were.
#![allow(clippy::expect_used, clippy::unwrap_used)] // tests fail by panicking

use crate::support;

use leasehold_redis_harness::RedisServer;
use support::{runtime, server, store};

/// capacity 10, 10 tokens per second, lease ttl 1 s, grace 0.1 s, strict.
const PARAMS: [&str; 6] = ["10", "10", "1000000", "1000000", "100000", "0"];
const NO_SPLIT: [&str; 5] = ["0", "0", "0", "0", "0"];

/// `FCALL f numkeys keys... PARAMS agent seq split... tail...`.
fn fcall(
    conn: &mut redis::Connection,
    f: &str,
    keys: &[&str],
    seq: u64,
    split: &[&str; 5],
    tail: &[&str],
) -> Result<redis::Value, redis::RedisError> {
    let mut cmd = redis::cmd("FCALL");
    cmd.arg(f).arg(keys.len());
    for k in keys {
        cmd.arg(*k);
    }
    for a in PARAMS {
        cmd.arg(a);
    }
    cmd.arg("00ab").arg(seq);
    for a in split {
        cmd.arg(*a);
    }
    for a in tail {
        cmd.arg(*a);
    }
    cmd.query(conn)
}

/// What a key holds and when it expires.
fn snapshot(server: &RedisServer, key: &str) -> (Vec<String>, i64) {
    let all: Vec<Vec<u8>> = server.cmd(&["HGETALL", key]).expect("HGETALL");
    let mut pairs: Vec<String> = all
        .chunks(2)
        .map(|c| format!("{}={}", c[0].escape_ascii(), c[1].escape_ascii()))
        .collect();
    pairs.sort();
    let expiry: i64 = server.cmd(&["PEXPIRETIME", key]).expect("PEXPIRETIME");
    (pairs, expiry)
}

fn refused(r: Result<redis::Value, redis::RedisError>, want: &str) -> String {
    let err = r.expect_err("a hostile call must be refused");
    let text = format!(
        "{} {}",
        err.code().unwrap_or_default(),
        err.detail().unwrap_or_default()
    );
    assert!(text.contains(want), "got {text:?}, want {want:?}");
    assert!(text.len() < 300, "error of {} bytes", text.len());
    text
}

#[test]
fn the_library_refuses_hostile_calls_before_touching_anything() {
    let server = server();
    runtime().block_on(async {
        let _store = store(&server.url()).await; // loads the library
    });
    let mut conn = server.connection().expect("connection");

    // An application's own hash, which a caller names by mistake.
    let _: () = server
        .cmd(&["HSET", "app:user:1", "name", "ada", "plan", "pro"])
        .expect("HSET");
    let app = snapshot(&server, "app:user:1");
    // A real, drained bucket.
    let bucket = "lh:{api|tenant-1}";
    fcall(&mut conn, "lh_exact", &[bucket], 1, &NO_SPLIT, &["10"]).expect("drain");
    let drained = snapshot(&server, bucket);
    assert!(drained.1 > 0, "a bucket key carries an expiry");

    for f in ["lh_exact", "lh_acquire", "lh_release", "lh_split"] {
        let tail: &[&str] = match f {
            "lh_acquire" => &["0", "5", "1", "0"],
            "lh_split" => &["2", "7", "99999999999"],
            _ => &["1"],
        };
        refused(
            fcall(&mut conn, f, &["app:user:1"], 2, &NO_SPLIT, tail),
            "not a bucket key: app:user:1",
        );
        refused(
            fcall(
                &mut conn,
                f,
                &[bucket, "lh:{api|tenant-2}"],
                2,
                &NO_SPLIT,
                tail,
            ),
            "exactly one key expected, got 2",
        );
        refused(
            fcall(&mut conn, f, &[], 2, &NO_SPLIT, tail),
            "exactly one key expected, got 0",
        );
    }
    // Split arguments on a plain bucket would reseed it (refill a drained bucket).
    refused(
        fcall(
            &mut conn,
            "lh_exact",
            &[bucket],
            3,
            &["5", "99999999999999", "10", "0", "0"],
            &["10"],
        ),
        "split part arguments on a key that is not a part",
    );
    // A part key without its split.
    refused(
        fcall(
            &mut conn,
            "lh_exact",
            &["lh:{api|tenant-1|7.0}"],
            3,
            &NO_SPLIT,
            &["1"],
        ),
        "a part key needs its split",
    );
    // Braces or a foreign shape inside the tag.
    for key in [
        "lh:{api|a}b}",
        "lh:{api}",
        "lh:{|x}",
        "lh:{api|x",
        "LH:{api|x}",
    ] {
        refused(
            fcall(&mut conn, "lh_exact", &[key], 3, &NO_SPLIT, &["1"]),
            "not a bucket key",
        );
    }
    // Numbers: plain decimal integers only.
    for n in ["1e0", "0x1", " 1", "1 ", "+1", "1.0", "-0", ""] {
        refused(
            fcall(&mut conn, "lh_exact", &[bucket], 4, &NO_SPLIT, &[n]),
            "invalid argument cost",
        );
    }
    // 1 MB arguments come back as a short error.
    let big = "9".repeat(1 << 20);
    let text = refused(
        fcall(&mut conn, "lh_exact", &[bucket], 5, &NO_SPLIT, &[&big]),
        "invalid argument cost = 9999",
    );
    assert!(text.contains("(1048576 bytes)"), "{text}");
    let big_key = format!("lh:{{api|{}}}", "x".repeat(1 << 20));
    refused(
        fcall(&mut conn, "lh_exact", &[&big_key], 5, &NO_SPLIT, &["1"]),
        "not a bucket key",
    );

    assert_eq!(
        snapshot(&server, "app:user:1"),
        app,
        "the foreign hash changed"
    );
    assert_eq!(snapshot(&server, bucket), drained, "the bucket changed");
    for key in [
        "lh:{api|tenant-2}",
        "lh:{api|tenant-1|7.0}",
        big_key.as_str(),
    ] {
        let exists: i64 = server.cmd(&["EXISTS", key]).expect("EXISTS");
        assert_eq!(exists, 0, "{} was written", &key[..key.len().min(40)]);
    }
}
