//! The listeners of Leasehold's binaries (`leasehold serve`, the coordinator's admin
//! endpoint, the example gateway): one accept loop for HTTP/1 and HTTP/2 (gRPC), hardened
//! against what a network sends a long-running service.
//!
//! - **`TCP_NODELAY`** on every accepted socket: without it, a small answer written
//!   after another small one waits for the peer's delayed ACK (measured: 1% of gRPC
//!   answers 40-48 ms late, and Envoy's rate limit filter gives up at 20 ms).
//! - **Header-read timeout** (HTTP/1): a request head must arrive within it, and an idle
//!   keep-alive connection is closed after it (slowloris, forgotten sockets).
//! - **Idle timeout** (both): a connection from which nothing was read for this long is
//!   shut down gracefully (HTTP/2: `GOAWAY`, so a proxy's pool reconnects cleanly).
//! - **A bound on open connections**, below the process's file descriptor limit: each
//!   listener's own (`Limits::max_connections`), and every listener of the process
//!   together at most three quarters of that limit (a process with a gRPC and an HTTP
//!   listener must not spend its descriptors twice). Past either, a new connection is
//!   closed at once, counted in `leasehold_connections_rejected_total{listener}` and
//!   logged (at most every 10 s), so the connections already open keep being answered.
//!   `leasehold_connections_open{listener}` is the gauge of open ones.
//! - Accept errors (`EMFILE`, ...) are logged and retried after a pause, never spun on.
#![forbid(unsafe_code)]

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

/// What the listeners record: (name, kind, help). The binaries describe them to their
/// recorder.
pub const METRICS: &[(&str, &str, &str)] = &[
    (
        "leasehold_connections_open",
        "gauge",
        "Per listener, connections open now.",
    ),
    (
        "leasehold_connections_rejected_total",
        "counter",
        "Per listener, connections closed at once because the listener's bound was reached.",
    ),
];

/// Registers the help text of `metrics` ((name, kind, help), kind `counter`, `gauge` or
/// `histogram` of seconds) with the installed recorder.
pub fn describe(metrics: &[(&'static str, &str, &'static str)]) {
    for &(name, kind, help) in metrics {
        match kind {
            "counter" => metrics::describe_counter!(name, help),
            "histogram" => metrics::describe_histogram!(name, metrics::Unit::Seconds, help),
            _ => metrics::describe_gauge!(name, help),
        }
    }
}

use axum::extract::ConnectInfo;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tower::ServiceExt;

/// What one listener allows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Limits {
    /// Connections open at once; more are closed as they arrive.
    pub max_connections: usize,
    /// HTTP/1: the most time a request head may take to arrive, and an idle keep-alive
    /// connection may wait for the next one.
    pub header_read_timeout: Duration,
    /// A connection from which nothing was read for this long is shut down gracefully.
    pub idle_timeout: Duration,
}

impl Default for Limits {
    /// 10 s for a request head, 5 minutes idle, and connections up to three quarters of
    /// the process's file descriptor limit (at most 16 384): the rest stays for the
    /// store's connections and files.
    fn default() -> Self {
        let fds = open_files_limit().unwrap_or(1024);
        Self {
            max_connections: (fds.saturating_mul(3) / 4).clamp(16, 16_384),
            header_read_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(300),
        }
    }
}

impl Limits {
    /// These limits with at most `n` connections open at once.
    pub fn max_connections(mut self, n: usize) -> Self {
        self.max_connections = n.max(1);
        self
    }

    /// These limits with `header_read` and `idle` timeouts.
    pub fn timeouts(mut self, header_read: Duration, idle: Duration) -> Self {
        self.header_read_timeout = header_read;
        self.idle_timeout = idle;
        self
    }
}

/// Connections open in this process, across every listener.
static OPEN: AtomicUsize = AtomicUsize::new(0);

/// The most connections every listener of the process may hold together: three quarters
/// of the open-files limit (the default of one listener's).
fn process_budget() -> usize {
    static BUDGET: std::sync::LazyLock<usize> =
        std::sync::LazyLock::new(|| Limits::default().max_connections);
    *BUDGET
}

/// One connection counted in [`OPEN`], until dropped.
struct Counted;

impl Counted {
    /// A place for one more connection, if the process has one.
    fn take() -> Option<Self> {
        let budget = process_budget();
        OPEN.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
            (n < budget).then_some(n + 1)
        })
        .ok()
        .map(|_| Self)
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        OPEN.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The soft limit on open files, from `/proc/self/limits` (Linux); `None` elsewhere or
/// when unlimited.
pub fn open_files_limit() -> Option<usize> {
    let text = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = text.lines().find(|l| l.starts_with("Max open files"))?;
    line.split_whitespace().nth(3)?.parse().ok()
}

/// Serves `app` on `listener` under `limits` until `shutdown` completes, then lets the
/// connections finish what they are doing (at most 10 s). `name` labels the metrics and
/// log lines. Each request carries its peer's address as `ConnectInfo<SocketAddr>`.
pub async fn serve(
    name: &'static str,
    listener: TcpListener,
    app: axum::Router,
    limits: Limits,
    shutdown: impl Future<Output = ()> + Send,
) -> io::Result<()> {
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    builder.http2().timer(TokioTimer::new());
    let builder = Arc::new(builder);
    let open = Arc::new(tokio::sync::Semaphore::new(limits.max_connections));
    let (stop, _) = tokio::sync::watch::channel(false);
    let mut tasks = tokio::task::JoinSet::new();
    let mut last_warning: Option<Instant> = None;
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => accepted,
        };
        // Reap finished connections as we go, so the set stays the size of the open ones.
        while tasks.try_join_next().is_some() {}
        let (stream, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                // Out of descriptors, or a connection reset before it was accepted: wait a
                // little (an error that repeats would otherwise spin a core).
                if last_warning.is_none_or(|t| t.elapsed() > Duration::from_secs(10)) {
                    tracing::error!(listener = name, error = %e, "accepting a connection failed; retrying");
                    last_warning = Some(Instant::now());
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        // This listener's place, then the process's (none taken unless both are free).
        let places = Arc::clone(&open)
            .try_acquire_owned()
            .ok()
            .and_then(|permit| Some((permit, Counted::take()?)));
        let Some((permit, counted)) = places else {
            metrics::counter!("leasehold_connections_rejected_total", "listener" => name)
                .increment(1);
            if last_warning.is_none_or(|t| t.elapsed() > Duration::from_secs(10)) {
                tracing::warn!(
                    listener = name,
                    max_connections = limits.max_connections,
                    process_max_connections = process_budget(),
                    "connection limit reached: new connections are closed until some end"
                );
                last_warning = Some(Instant::now());
            }
            drop(stream);
            continue;
        };
        if let Err(e) = stream.set_nodelay(true) {
            tracing::debug!(listener = name, error = %e, "TCP_NODELAY");
        }
        metrics::gauge!("leasehold_connections_open", "listener" => name).increment(1.0);
        let (builder, app, mut stopping) = (Arc::clone(&builder), app.clone(), stop.subscribe());
        tasks.spawn(async move {
            let read_at = Arc::new(AtomicU64::new(0));
            let started = Instant::now();
            let io = TokioIo::new(Tracked {
                inner: stream,
                read_at: Arc::clone(&read_at),
                started,
            });
            let service = hyper::service::service_fn(move |mut req: hyper::Request<hyper::body::Incoming>| {
                req.extensions_mut().insert(ConnectInfo(peer));
                app.clone().oneshot(req.map(axum::body::Body::new))
            });
            let conn = builder.serve_connection_with_upgrades(io, service);
            let mut conn = std::pin::pin!(conn);
            let mut idle = tokio::time::interval(limits.idle_timeout / 4);
            idle.tick().await;
            let mut closing = false;
            loop {
                tokio::select! {
                    r = conn.as_mut() => {
                        if let Err(e) = r {
                            tracing::debug!(listener = name, %peer, error = %e, "connection ended");
                        }
                        break;
                    }
                    _ = idle.tick(), if !closing => {
                        let quiet = started.elapsed().saturating_sub(Duration::from_micros(read_at.load(Ordering::Relaxed)));
                        if quiet >= limits.idle_timeout {
                            tracing::debug!(listener = name, %peer, "idle connection closed");
                            conn.as_mut().graceful_shutdown();
                            closing = true;
                        }
                    }
                    _ = stopping.wait_for(|s| *s), if !closing => {
                        conn.as_mut().graceful_shutdown();
                        closing = true;
                    }
                }
            }
            metrics::gauge!("leasehold_connections_open", "listener" => name).decrement(1.0);
            drop((permit, counted));
        });
    }
    drop(listener);
    let _ = stop.send(true);
    let _ = tokio::time::timeout(Duration::from_secs(10), async {
        while tasks.join_next().await.is_some() {}
    })
    .await;
    Ok(())
}

/// A socket that notes when it last read anything (µs since `started`).
struct Tracked {
    inner: TcpStream,
    read_at: Arc<AtomicU64>,
    started: Instant,
}

impl AsyncRead for Tracked {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let me = self.get_mut();
        let before = buf.filled().len();
        let polled = Pin::new(&mut me.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            me.read_at
                .store(me.started.elapsed().as_micros() as u64, Ordering::Relaxed);
        }
        polled
    }
}

impl AsyncWrite for Tracked {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// Ctrl-C or SIGTERM (what Kubernetes and systemd send to stop a process): the binaries'
/// graceful stop (give it to [`serve`] as `shutdown`); it says so in the log (JSON with
/// `--log-format json`).
pub async fn stop_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                let which = tokio::select! {
                    _ = tokio::signal::ctrl_c() => "SIGINT",
                    _ = term.recv() => "SIGTERM",
                };
                tracing::info!(signal = which, "{STOPPING}");
                return;
            }
            Err(e) => {
                tracing::warn!(error = %e, "SIGTERM cannot be caught; Ctrl-C stops gracefully")
            }
        }
    }
    let _ = tokio::signal::ctrl_c().await;
    tracing::info!(signal = "SIGINT", "{STOPPING}");
}

/// What a server says as it stops.
const STOPPING: &str = "stopping: work in flight finishes, leases held go back";

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::SocketAddr;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn start(limits: Limits) -> (SocketAddr, tokio::sync::oneshot::Sender<()>) {
        let app = axum::Router::new().route("/", axum::routing::get(|| async { "ok" }));
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(serve("test", listener, app, limits, async {
            let _ = stopped.await;
        }));
        (addr, stop)
    }

    /// Reads until the peer closes (or 10 s pass); what was read.
    async fn until_closed(s: &mut TcpStream) -> Option<String> {
        let mut got = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut got)).await;
        read.ok()
            .map(|_| String::from_utf8_lossy(&got).into_owned())
    }

    const GET: &[u8] = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n";

    #[tokio::test]
    async fn half_sent_and_idle_connections_are_closed() {
        let limits =
            Limits::default().timeouts(Duration::from_millis(300), Duration::from_secs(60));
        let (addr, _stop) = start(limits).await;
        // Half a request head, then nothing.
        let mut half = TcpStream::connect(addr).await.expect("connect");
        half.write_all(b"GET / HTTP/1.1\r\nHost:")
            .await
            .expect("send");
        let answer = until_closed(&mut half).await.expect("closed within 10 s");
        assert!(!answer.contains("200 OK"), "{answer}");
        // One request, then an idle keep-alive connection.
        let mut idle = TcpStream::connect(addr).await.expect("connect");
        idle.write_all(GET).await.expect("send");
        let answer = until_closed(&mut idle).await.expect("closed within 10 s");
        assert!(answer.starts_with("HTTP/1.1 200 OK"), "{answer}");
    }

    #[tokio::test]
    async fn connections_past_the_bound_are_closed_and_the_others_answered() {
        let limits = Limits::default()
            .max_connections(2)
            .timeouts(Duration::from_secs(30), Duration::from_secs(60));
        let (addr, _stop) = start(limits).await;
        let mut a = TcpStream::connect(addr).await.expect("connect");
        let mut b = TcpStream::connect(addr).await.expect("connect");
        // Each is accepted (the server holds them) before the third comes.
        for s in [&mut a, &mut b] {
            s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n")
                .await
                .expect("send");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        let mut c = TcpStream::connect(addr).await.expect("connect");
        let refused = until_closed(&mut c).await.expect("closed at once");
        assert_eq!(refused, "");
        for s in [&mut a, &mut b] {
            s.write_all(b"Connection: close\r\n\r\n")
                .await
                .expect("send");
            let answer = until_closed(s).await.expect("answered");
            assert!(answer.starts_with("HTTP/1.1 200 OK"), "{answer}");
        }
        // Room again once they are gone.
        let mut d = TcpStream::connect(addr).await.expect("connect");
        d.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .expect("send");
        let answer = until_closed(&mut d).await.expect("answered");
        assert!(answer.starts_with("HTTP/1.1 200 OK"), "{answer}");
    }

    #[test]
    fn the_default_bound_stays_below_the_descriptor_limit() {
        let limits = Limits::default();
        if let Some(fds) = open_files_limit() {
            assert!(limits.max_connections < fds, "{limits:?} vs {fds}");
        }
        assert!(limits.max_connections >= 16);
    }
}
