//! Envoy-like RLQS filters driven against `leasehold serve` (in process or as a binary):
//! shared by the serve tests and the operations tests.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use leasehold_serve::rlqs::client::QuotaClient;

pub const INTERVAL: Duration = Duration::from_millis(200);

/// Drives a filter for `entries` at `rate` requests a second (evenly spaced) until `end`;
/// on a broken stream it reconnects to the next address of `servers`, keeping what it
/// holds. Returns the instants of its admissions and the assignments it received.
pub async fn run_filter(
    servers: Arc<Mutex<Vec<SocketAddr>>>,
    entries: Vec<(&'static str, &'static str)>,
    rate: f64,
    end: Instant,
) -> (Vec<Instant>, u64) {
    let mut which = 0;
    let addr = servers.lock().unwrap()[which];
    let mut f = QuotaClient::connect(addr, "quota", INTERVAL).await.unwrap();
    let mut received = 0;
    let mut admitted = Vec::new();
    let gap = Duration::from_secs_f64(1.0 / rate);
    let mut next = Instant::now();
    while Instant::now() < end {
        tokio::time::sleep_until(next.into()).await;
        next += gap;
        if f.admit(&entries) {
            admitted.push(Instant::now());
        }
        if f.ended().is_some() {
            // Envoy's filter reconnects; here to the next server.
            which += 1;
            let addr = {
                let s = servers.lock().unwrap();
                s[which % s.len()]
            };
            received += f.received();
            f = QuotaClient::connect_keeping(addr, "quota", INTERVAL, Some(&f))
                .await
                .unwrap();
        }
    }
    (admitted, received + f.received())
}

/// The largest excess of admissions in any window over `B + r·W` (≤ 0: kept).
pub fn worst_excess(mut times: Vec<Instant>, capacity: f64, rate: f64) -> f64 {
    times.sort_unstable();
    let mut worst = f64::MIN;
    for (i, &start) in times.iter().enumerate() {
        for (j, &t) in times.iter().enumerate().skip(i) {
            let w = (t - start).as_secs_f64();
            let n = (j - i + 1) as f64;
            worst = worst.max(n - (capacity + rate * w));
        }
    }
    worst
}
