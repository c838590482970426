//! The function library on the store: loaded at connect, and again when a node lost it.

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

    #[tracing::instrument(level = "info", name = "library_load", skip_all)]
    pub(super) async fn load_library(&self, conn: &Conn) -> Result<(), StoreError> {
        let mut cmd = redis::cmd("FUNCTION");
        cmd.arg("LOAD").arg("REPLACE").arg(LIBRARY);
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
