//! What the agent tells operators: the metrics it records (through the `metrics` crate,
//! to whatever recorder the application installed) and their help text, and with the
//! `prometheus` feature an exporter the application may choose to install.
//!
//! The agent never installs a global recorder by itself: the application owns it.

use std::sync::atomic::{AtomicU64, Ordering};

/// Every metric the agent records, with its kind, unit and help text: the reference the
/// metrics table of docs/operating.md is written from.
pub const METRICS: &[(&str, Kind, &str)] = &[
    (
        "leasehold_decisions_total",
        Kind::Counter,
        "Decisions by rule and outcome (admitted_lease, admitted_local, admitted_exact, admitted_fail_open, admitted_emergency, denied, unavailable, shadow_denied, shadow_unavailable).",
    ),
    (
        "leasehold_decision_seconds",
        Kind::Histogram,
        "Time to decide, sampled one decision in 64 (hot path and store calls alike).",
    ),
    (
        "leasehold_store_call_seconds",
        Kind::Histogram,
        "Store call time by shard and op (acquire, release, exact, exact_many: a batch of cold decisions), retries included.",
    ),
    (
        "leasehold_store_calls_total",
        Kind::Counter,
        "Store calls by rule.",
    ),
    (
        "leasehold_store_errors_total",
        Kind::Counter,
        "Store calls that failed, by rule.",
    ),
    (
        "leasehold_store_errors_by_kind_total",
        Kind::Counter,
        "Store errors by kind (timeout, unavailable, oom, noperm, readonly, refused, protocol, not_replicated, other).",
    ),
    (
        "leasehold_breaker_open",
        Kind::Gauge,
        "1 while the shard's circuit breaker is open (its keys follow their failure policy), by shard.",
    ),
    (
        "leasehold_lease_grants_total",
        Kind::Counter,
        "Leases granted by the store, by rule.",
    ),
    (
        "leasehold_lease_tokens_granted_total",
        Kind::Counter,
        "Tokens leased from the store, by rule.",
    ),
    (
        "leasehold_lease_returns_total",
        Kind::Counter,
        "Leases given back before expiry, by rule.",
    ),
    (
        "leasehold_lease_tokens_returned_total",
        Kind::Counter,
        "Tokens given back to the store, by rule.",
    ),
    (
        "leasehold_reclaims_total",
        Kind::Counter,
        "Leases returned because they sat unused or exceeded the agent's share, by rule.",
    ),
    (
        "leasehold_emergency_activations_total",
        Kind::Counter,
        "Times a key entered its local emergency limit, by rule.",
    ),
    (
        "leasehold_keys_in_memory",
        Kind::Gauge,
        "Keys whose state the agent holds (bounded by max_keys).",
    ),
    (
        "leasehold_keys_evicted_total",
        Kind::Counter,
        "Idle cold keys dropped to stay under max_keys.",
    ),
    (
        "leasehold_keys_decided_without_state_total",
        Kind::Counter,
        "Decisions on new keys made by one exact call without keeping state, at max_keys, \
         because no sampled key could make room.",
    ),
    (
        "leasehold_keys_first_seen_total",
        Kind::Counter,
        "Decisions on keys seen for the first time at max_keys, made by one exact call \
         without keeping state (seen again soon, a key takes an idle key's place).",
    ),
    (
        "leasehold_store_may_evict_buckets",
        Kind::Gauge,
        "1 when the store's maxmemory-policy may evict bucket keys (read every 30 s).",
    ),
    (
        "leasehold_library_loads_total",
        Kind::Counter,
        "Times the function library was loaded (at connect, and after each loss).",
    ),
];

/// A metric's kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Monotonic; the name ends in `_total`.
    Counter,
    /// A level.
    Gauge,
    /// A distribution (exported with buckets).
    Histogram,
}

/// Registers the help text of every metric with the installed recorder (call it after
/// installing one; the limiter's `build` does).
pub fn describe() {
    for &(name, kind, help) in METRICS {
        match kind {
            Kind::Counter => metrics::describe_counter!(name, help),
            Kind::Gauge => metrics::describe_gauge!(name, help),
            Kind::Histogram => {
                metrics::describe_histogram!(name, metrics::Unit::Seconds, help)
            }
        }
    }
}

/// Bucket bounds (seconds) of the time histograms: 1 µs to 1 s.
pub const TIME_BUCKETS: &[f64] = &[
    1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2,
    5e-2, 0.1, 0.25, 0.5, 1.0,
];

/// Installs a Prometheus recorder as this process's global recorder (histograms with
/// [`TIME_BUCKETS`], the agent's help text), once per process: later calls return the
/// same handle. For applications that serve the text themselves; runs inside a tokio
/// runtime (a task does the recorder's upkeep).
#[cfg(feature = "prometheus")]
pub fn install_prometheus() -> Result<metrics_exporter_prometheus::PrometheusHandle, String> {
    use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
    static HANDLE: std::sync::OnceLock<Result<PrometheusHandle, String>> =
        std::sync::OnceLock::new();
    let runtime = tokio::runtime::Handle::try_current()
        .map_err(|_| "install_prometheus must run inside a tokio runtime".to_owned())?;
    HANDLE
        .get_or_init(|| {
            let recorder = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), TIME_BUCKETS)
                .map_err(|e| e.to_string())?
                .build_recorder();
            let handle = recorder.handle();
            metrics::set_global_recorder(recorder)
                .map_err(|_| "a global metrics recorder is already installed".to_owned())?;
            describe();
            let upkeep = handle.clone();
            runtime.spawn(async move {
                let mut tick = tokio::time::interval(std::time::Duration::from_secs(5));
                loop {
                    tick.tick().await;
                    upkeep.run_upkeep();
                }
            });
            Ok(handle)
        })
        .clone()
}

/// [`install_prometheus`], and serves the text on `listener` at `/metrics` (any other
/// path is 404, so a health probe pointed here by mistake fails rather than passes). For
/// applications that have no recorder of their own; call it once, before building
/// limiters.
#[cfg(feature = "prometheus")]
pub fn serve_prometheus(
    listener: std::net::TcpListener,
) -> Result<metrics_exporter_prometheus::PrometheusHandle, String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let runtime = tokio::runtime::Handle::try_current()
        .map_err(|_| "serve_prometheus must run inside a tokio runtime".to_owned())?;
    let handle = install_prometheus()?;
    listener.set_nonblocking(true).map_err(|e| e.to_string())?;
    let listener = {
        let _entered = runtime.enter();
        tokio::net::TcpListener::from_std(listener).map_err(|e| e.to_string())?
    };
    let served = handle.clone();
    runtime.spawn(async move {
        // At most this many scrapes at once; a scraper must send its request head within
        // 10 s.
        let open = std::sync::Arc::new(tokio::sync::Semaphore::new(64));
        loop {
            let (mut socket, _) = match listener.accept().await {
                Ok(a) => a,
                Err(e) => {
                    // Out of descriptors, say: pause rather than spin.
                    tracing::warn!(error = %e, "prometheus listener: accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    continue;
                }
            };
            let Ok(permit) = open.clone().try_acquire_owned() else {
                continue;
            };
            let _ = socket.set_nodelay(true);
            let served = served.clone();
            tokio::spawn(async move {
                let _permit = permit;
                // Read the request head (bounded in size and time), answer, close.
                let mut buf = [0u8; 4096];
                let mut seen = 0;
                let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
                while seen < buf.len() {
                    match tokio::time::timeout_at(deadline, socket.read(&mut buf[seen..])).await {
                        Ok(Ok(0) | Err(_)) | Err(_) => return,
                        Ok(Ok(n)) => seen += n,
                    }
                    if buf[..seen].windows(4).any(|w| w == b"\r\n\r\n") {
                        break;
                    }
                }
                let path = std::str::from_utf8(&buf[..seen])
                    .ok()
                    .and_then(|h| h.split_whitespace().nth(1))
                    .map(|p| p.split('?').next().unwrap_or(p));
                let (status, body) = if path == Some("/metrics") {
                    ("200 OK", served.render())
                } else {
                    ("404 Not Found", "the metrics are at /metrics\n".to_owned())
                };
                let head = format!(
                    "HTTP/1.1 {status}\r\ncontent-type: text/plain; version=0.0.4\r\n\
                     content-length: {}\r\nconnection: close\r\n\r\n",
                    body.len()
                );
                let _ = socket.write_all(head.as_bytes()).await;
                let _ = socket.write_all(body.as_bytes()).await;
            });
        }
    });
    Ok(handle)
}

/// Whether a log line that every request could repeat is due: true at most once per
/// `every_ns` for `slot` (`now_ns` on any clock that does not go back; the slot holds
/// when it was last said). The agent's lines and serve's use it.
pub fn once_per(slot: &AtomicU64, now_ns: u64, every_ns: u64) -> bool {
    let now = now_ns.max(1);
    let last = slot.load(Ordering::Relaxed);
    (last == 0 || now.saturating_sub(last) >= every_ns)
        && slot
            .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A line every request could repeat is said once, then again only a period later.
    #[test]
    fn once_per_says_a_repeated_line_once_a_period() {
        let slot = AtomicU64::new(0);
        assert!(once_per(&slot, 0, 10), "the first time");
        assert!(!once_per(&slot, 6, 10));
        assert!(!once_per(&slot, 10, 10));
        assert!(once_per(&slot, 11, 10));
        assert!(!once_per(&slot, 20, 10));
    }
}
