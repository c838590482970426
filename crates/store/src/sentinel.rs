//! The primary that Redis Sentinels name, followed through failovers without spending a
//! grant of a node that is no longer the primary.
//!
//! In a failover, planned (`SENTINEL FAILOVER`) or not, Sentinel promotes a replica and
//! only later tells the old primary to follow it. Meanwhile the old primary still takes
//! writes, and every write it takes after the promotion is lost when it becomes a
//! replica: tokens it granted come back to the bucket on the new primary, and the same
//! budget is spent twice (measured: about B over a 20 s run). So the store listens to
//! every Sentinel's announcements (`+try-failover` … `+switch-master`, on pub/sub) and
//! **fences** the service from the moment any Sentinel starts a failover of it: calls wait
//! (up to their timeout, then fail as unavailable, and each rule's failure policy
//! decides) until the switch is announced, and then go to the new primary. A failover
//! that is aborted lifts the fence. A call that finds its node gone or demoted
//! (`READONLY`) also asks the Sentinels again, as a fallback when no announcement
//! arrives.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures_util::StreamExt;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::sentinel::SentinelClient;
use redis::{Cmd, RedisError, Value};

/// The announcements a Sentinel publishes that start a failover of a service.
const STARTS: [&str; 3] = [
    "+try-failover",
    "+selected-slave",
    "+failover-state-send-slaveof-noone",
];
/// The announcement that ends one: the new primary is in the Sentinel's configuration.
/// (`+failover-end` comes a tick before it, while the Sentinel still names the old one.)
/// An aborted failover (`-failover-abort-*`) ends one too.
const SWITCH: &str = "+switch-master";

/// The primary a set of Sentinels names for one service.
pub(crate) struct SentinelConn {
    sentinels: Arc<tokio::sync::Mutex<SentinelClient>>,
    current: arc_swap::ArcSwap<ConnectionManager>,
    settings: ConnectionManagerConfig,
    looking: AtomicBool,
    /// The service's name, as Sentinels know it.
    service: String,
    /// One bit per Sentinel that has announced a failover of the service and not yet
    /// its end: calls wait while any is set.
    fence: tokio::sync::watch::Sender<u64>,
    /// How long a call waits for a fence to lift.
    wait: Duration,
}

impl SentinelConn {
    /// Starts following `service` on the Sentinels at `watch`, with `conn` to the primary
    /// they name now.
    pub(crate) fn start(
        sentinels: Arc<tokio::sync::Mutex<SentinelClient>>,
        watch: Vec<redis::ConnectionInfo>,
        watch_tls: Option<crate::redis::Certs>,
        service: String,
        conn: ConnectionManager,
        settings: ConnectionManagerConfig,
        wait: Duration,
    ) -> Arc<Self> {
        let me = Arc::new(Self {
            sentinels,
            current: arc_swap::ArcSwap::from_pointee(conn),
            settings,
            looking: AtomicBool::new(false),
            service,
            fence: tokio::sync::watch::Sender::new(0),
            wait,
        });
        for (i, addr) in watch.into_iter().enumerate().take(64) {
            tokio::spawn(listen(Arc::downgrade(&me), 1 << i, addr, watch_tls.clone()));
        }
        me
    }

    /// Whether a failover of the service is under way (calls wait for its end).
    pub(crate) fn fenced(&self) -> bool {
        *self.fence.borrow() != 0
    }

    /// Waits until no failover is under way, at most `wait`.
    async fn unfenced(&self) -> Result<(), RedisError> {
        let mut rx = self.fence.subscribe();
        match tokio::time::timeout(self.wait, rx.wait_for(|bits| *bits == 0)).await {
            Ok(_) => Ok(()),
            Err(_) => Err(RedisError::from((
                redis::ErrorKind::Io,
                "failover in progress",
                format!("the Sentinels are failing over {}", self.service),
            ))),
        }
    }

    pub(crate) async fn query(self: &Arc<Self>, cmd: &Cmd) -> Result<Value, RedisError> {
        self.unfenced().await?;
        let mut conn = ConnectionManager::clone(&self.current.load());
        let reply = cmd.query_async(&mut conn).await;
        self.after(&reply);
        reply
    }

    pub(crate) async fn query_pipe(
        self: &Arc<Self>,
        pipe: &redis::Pipeline,
    ) -> Result<Vec<Value>, RedisError> {
        self.unfenced().await?;
        let mut conn = ConnectionManager::clone(&self.current.load());
        let reply = pipe.query_async(&mut conn).await;
        self.after(&reply);
        reply
    }

    fn after<T>(self: &Arc<Self>, reply: &Result<T, RedisError>) {
        let Err(e) = reply else { return };
        let moved = e.is_io_error()
            || e.is_connection_refusal()
            || e.is_connection_dropped()
            || e.is_timeout()
            || matches!(e.code(), Some("READONLY" | "MASTERDOWN" | "LOADING"));
        if moved && !self.looking.swap(true, Ordering::AcqRel) {
            let me = Arc::clone(self);
            tokio::spawn(async move {
                me.find_primary().await;
                me.looking.store(false, Ordering::Release);
            });
        }
    }

    /// Asks the Sentinels which node is the primary now and connects to it.
    async fn find_primary(&self) {
        self.find_primary_at(None).await;
    }

    /// [`SentinelConn::find_primary`], asking again (for up to a second) until the
    /// Sentinels name `expected` (`host:port`), when given.
    async fn find_primary_at(&self, expected: Option<&str>) {
        let mut tries = 0;
        let client = loop {
            tries += 1;
            match self.sentinels.lock().await.async_get_client().await {
                Ok(c)
                    if expected
                        .is_none_or(|want| c.get_connection_info().addr().to_string() == want)
                        || tries == 20 =>
                {
                    break c;
                }
                Ok(_) => {}
                Err(e) if tries == 20 => {
                    tracing::warn!(service = %self.service, error = %e, "no primary reachable through the Sentinels: none named one, or the one named does not answer");
                    return;
                }
                Err(_) => {}
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let addr = client.get_connection_info().addr().to_string();
        match ConnectionManager::new_with_config(client, self.settings.clone()).await {
            Ok(conn) => {
                tracing::warn!(service = %self.service, primary = %addr, "connected to the primary the Sentinels name");
                self.current.store(Arc::new(conn));
            }
            Err(e) => {
                tracing::warn!(service = %self.service, primary = %addr, error = %e, "primary named by the Sentinels unreachable");
            }
        }
    }

    /// Raises (`true`) or lowers this Sentinel's bit of the fence.
    fn set_fence(&self, bit: u64, on: bool) {
        self.fence.send_if_modified(|bits| {
            let was = *bits;
            if on {
                *bits |= bit;
            } else {
                *bits &= !bit;
            }
            if (was == 0) != (*bits == 0) {
                if on {
                    tracing::warn!(service = %self.service, "Sentinel failover under way: store calls wait for the new primary");
                } else {
                    tracing::warn!(service = %self.service, "Sentinel failover over: store calls resume");
                }
            }
            was != *bits
        });
    }
}

/// The service an announcement is about: `+switch-master NAME ...`, or for an
/// instance, `TYPE NAME IP PORT [@ MASTER IP PORT]` (a replica's event names its primary
/// after `@`).
fn service_of<'a>(channel: &str, payload: &'a str) -> Option<&'a str> {
    let words: Vec<&str> = payload.split_whitespace().collect();
    if channel == SWITCH {
        return words.first().copied();
    }
    match words.iter().position(|w| *w == "@") {
        Some(at) => words.get(at + 1).copied(),
        None if words.first() == Some(&"master") => words.get(1).copied(),
        None => None,
    }
}

/// Whether `e` is a server refusing the credentials given (none, or wrong ones).
pub(crate) fn auth_refused(e: &RedisError) -> bool {
    matches!(e.code(), Some("NOAUTH" | "WRONGPASS"))
        || e.kind() == redis::ErrorKind::AuthenticationFailed
}

/// Follows one Sentinel's announcements for as long as the connection lives, raising
/// and lowering its bit of the fence; reconnects when the Sentinel is lost (a lost
/// Sentinel lowers its bit: it can no longer tell the end of its failover).
async fn listen(
    conn: std::sync::Weak<SentinelConn>,
    bit: u64,
    addr: redis::ConnectionInfo,
    tls: Option<crate::redis::Certs>,
) {
    let shown = addr.addr().to_string();
    let mut failures = 0u32;
    loop {
        if conn.strong_count() == 0 {
            return;
        }
        let subscribed = async {
            let client = match &tls {
                #[cfg(feature = "tls")]
                Some(certs) => redis::Client::build_with_tls(addr.clone(), certs.clone())?,
                #[cfg(not(feature = "tls"))]
                Some(never) => match *never {},
                None => redis::Client::open(addr.clone())?,
            };
            let mut pubsub = client.get_async_pubsub().await?;
            let mut channels: Vec<&str> = STARTS.to_vec();
            channels.push(SWITCH);
            pubsub.subscribe(channels).await?;
            pubsub.psubscribe("-failover-abort-*").await?;
            Ok::<_, RedisError>(pubsub)
        };
        let pubsub = match tokio::time::timeout(Duration::from_secs(2), subscribed).await {
            Ok(Ok(p)) => p,
            Ok(Err(e)) => {
                failures += 1;
                // A refused password does not mend by itself (the Sentinel's was changed,
                // say): said again every 30 attempts, as an error, since failovers are then
                // seen only when a call finds the old primary read-only.
                if auth_refused(&e) && (failures == 1 || failures.is_multiple_of(30)) {
                    tracing::error!(
                        sentinel = %shown,
                        error = %e,
                        failures,
                        "this Sentinel refuses the address's sentinel_password: its failover \
                         announcements are not followed, and a failover is seen only once a \
                         call finds the old primary read-only; retrying"
                    );
                } else if failures == 1 {
                    tracing::warn!(sentinel = %shown, error = %e, "cannot follow this Sentinel's failover announcements; retrying");
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
            Err(_) => {
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        if failures > 0 {
            tracing::info!(sentinel = %shown, failures, "following this Sentinel's failover announcements again");
        }
        failures = 0;
        let mut messages = pubsub.into_on_message();
        loop {
            let msg = tokio::select! {
                m = messages.next() => m,
                // Checks now and then whether the store is still there.
                () = tokio::time::sleep(Duration::from_secs(5)) => {
                    if conn.strong_count() == 0 {
                        return;
                    }
                    continue;
                }
            };
            let Some(msg) = msg else { break };
            let Some(me) = conn.upgrade() else { return };
            let channel = msg.get_channel_name().to_owned();
            let Ok(payload) = msg.get_payload::<String>() else {
                continue;
            };
            if service_of(&channel, &payload) != Some(me.service.as_str()) {
                continue;
            }
            tracing::info!(sentinel = %shown, event = %channel, %payload, "Sentinel announcement");
            if STARTS.contains(&channel.as_str()) {
                me.set_fence(bit, true);
            } else if channel == SWITCH {
                // The new primary first, then the fence: no call may reach the old one.
                let words: Vec<&str> = payload.split_whitespace().collect();
                let new = match words.as_slice() {
                    [_, _, _, host, port, ..] => Some(format!("{host}:{port}")),
                    _ => None,
                };
                me.find_primary_at(new.as_deref()).await;
                me.set_fence(bit, false);
            } else {
                // The failover was aborted: whoever is primary now.
                if *me.fence.borrow() & bit != 0 {
                    me.find_primary().await;
                }
                me.set_fence(bit, false);
            }
        }
        if let Some(me) = conn.upgrade() {
            me.set_fence(bit, false);
        }
        tracing::warn!(sentinel = %shown, "lost this Sentinel's announcements; reconnecting");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::service_of;

    #[test]
    fn announcements_name_their_service() {
        assert_eq!(
            service_of("+try-failover", "master mymaster 127.0.0.1 6379"),
            Some("mymaster")
        );
        assert_eq!(
            service_of(
                "+selected-slave",
                "slave 127.0.0.1:6380 127.0.0.1 6380 @ mymaster 127.0.0.1 6379"
            ),
            Some("mymaster")
        );
        assert_eq!(
            service_of("+switch-master", "mymaster 127.0.0.1 6379 127.0.0.1 6380"),
            Some("mymaster")
        );
        assert_eq!(
            service_of("-failover-abort-not-elected", "master other 10.0.0.1 6379"),
            Some("other")
        );
        assert_eq!(service_of("+try-failover", ""), None);
    }
}
