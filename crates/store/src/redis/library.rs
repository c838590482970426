//! The function library on the store: loaded at connect, and again when a node lost it.

use std::sync::OnceLock;
use std::sync::atomic::Ordering;

use redis::{Cmd, Value};

use super::error::{StoreError, classify, is_missing_library};
use super::{Conn, LIBRARY, RedisStore};

impl RedisStore {
    /// How many times the library was loaded (once at connect, then once per loss).
    pub fn library_loads(&self) -> u64 {
        self.loader.loads.load(Ordering::Relaxed)
    }

    /// Loads the library unless another caller already did since `seen` generation.
    pub(super) async fn reload(&self, seen: u64) -> Result<(), StoreError> {
        let _one_at_a_time = self.loader.lock.lock().await;
        if self.loader.generation.load(Ordering::Acquire) != seen {
            return Ok(());
        }
        self.load_library(self.conn()?).await
    }

    /// At connect: loads the library unless the store holds this text of it already (a
    /// fleet starting together would otherwise have Redis compile it once per agent). On
    /// a cluster it is always loaded, on every primary: one node's answer does not say
    /// what the others hold.
    pub(super) async fn ensure_library(&self, conn: &Conn) -> Result<(), StoreError> {
        if !matches!(conn, Conn::Cluster(_)) {
            let mut cmd = redis::cmd("FCALL_RO");
            cmd.arg("lh_fingerprint").arg(0);
            if let Ok(Value::BulkString(b)) = conn.query(&cmd).await
                && b == fingerprint().as_bytes()
            {
                tracing::debug!("leasehold function library loaded already");
                return Ok(());
            }
        }
        self.load_library(conn).await
    }

    #[tracing::instrument(level = "info", name = "library_load", skip_all)]
    pub(super) async fn load_library(&self, conn: &Conn) -> Result<(), StoreError> {
        let mut cmd = redis::cmd("FUNCTION");
        cmd.arg("LOAD").arg("REPLACE").arg(library_text());
        conn.query(&cmd).await.map_err(classify)?;
        self.loader.loads.fetch_add(1, Ordering::Relaxed);
        self.loader.generation.fetch_add(1, Ordering::Release);
        tracing::info!(
            loads = self.library_loads(),
            "leasehold function library loaded"
        );
        Ok(())
    }

    /// Runs a call of the function library, loading the library again (once, whoever
    /// notices first) if the store lost it.
    pub(super) async fn query_loaded(&self, cmd: &Cmd) -> Result<Value, StoreError> {
        let seen = self.loader.generation.load(Ordering::Acquire);
        match self.conn()?.query(cmd).await {
            Err(e) if is_missing_library(&e) => {
                self.reload(seen).await?;
                self.conn()?.query(cmd).await
            }
            other => other,
        }
        .map_err(classify)
    }
}

/// The marker in [`LIBRARY`] that `lh_fingerprint` returns, replaced by [`fingerprint`].
const MARKER: &str = "LEASEHOLD_FINGERPRINT";

/// The library's text as loaded: [`LIBRARY`] with its fingerprint in place of the marker.
fn library_text() -> &'static str {
    static TEXT: OnceLock<String> = OnceLock::new();
    TEXT.get_or_init(|| LIBRARY.replace(MARKER, fingerprint()))
}

/// FNV-1a (64 bits) of [`LIBRARY`], in hex: names the text, the same in every build of it.
fn fingerprint() -> &'static str {
    static PRINT: OnceLock<String> = OnceLock::new();
    PRINT.get_or_init(|| {
        let h = LIBRARY.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
        });
        format!("leasehold-{h:016x}")
    })
}
