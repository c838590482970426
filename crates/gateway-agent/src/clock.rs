//! A clock tests move by hand. The agent reads time on every decision (lease deadlines,
//! cached denials, demand) and the store on every call; a [`ManualClock`] drives both, so
//! a test of what happens in a second advances the clock a second instead of sleeping
//! one, and the test is exact on a loaded machine. (The agent's timers — the background
//! loop, a rule's timeout — still run on tokio's clock.)

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use leasehold_store::EmbeddedStore;

/// A clock for one agent and its embedded store, moved only by [`ManualClock::advance`].
/// Give it to [`crate::LimiterBuilder::clock`] and build the store with
/// [`ManualClock::store`].
#[derive(Clone, Debug)]
pub struct ManualClock {
    clock: quanta::Clock,
    mock: Arc<quanta::Mock>,
    /// The store's time when the clock was made, µs since the epoch.
    epoch_us: u64,
}

impl Default for ManualClock {
    fn default() -> Self {
        Self::new()
    }
}

impl ManualClock {
    /// A clock at the system's time now, standing still.
    pub fn new() -> Self {
        let (clock, mock) = quanta::Clock::mock();
        // A mock starts at 0; the agent measures from its first reading, so start above it.
        mock.increment(Duration::from_secs(1));
        let epoch_us = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as u64);
        Self {
            clock,
            mock,
            epoch_us,
        }
    }

    /// Moves the clock forward by `d`, for the agent and the store at once.
    pub fn advance(&self, d: Duration) {
        self.mock.increment(d);
    }

    /// An embedded store on this clock.
    pub fn store(&self) -> EmbeddedStore {
        let (mock, epoch_us) = (self.mock.clone(), self.epoch_us);
        EmbeddedStore::with_time(move || epoch_us + mock.value() / 1_000)
    }

    /// The agent's time source.
    pub(crate) fn quanta(&self) -> quanta::Clock {
        self.clock.clone()
    }
}
