//! A spawned Redis on a core of its own, as a Redis server has its own machine.
//!
//! On a small machine the load, the agents and a spawned redis-server otherwise share the
//! cores, and the scheduler preempts Redis for milliseconds at a time (LATENCY showed
//! 4 ms "fast-command" events on 2 cores): every call in flight waits, and that sets the
//! tail of whichever system runs, not its design. So, for `spawn` and `spawn-replica`
//! on a machine with two cores or more, the last core this process may use is Redis's
//! and every thread of this process moves to the others; `--shared-cores` keeps the old
//! sharing. Both systems of a comparison run the same way.

use nix::sched::{CpuSet, sched_getaffinity, sched_setaffinity};
use nix::unistd::Pid;

/// The core kept for Redis, and the cores this process's threads had before (given back
/// on drop).
#[derive(Debug)]
pub(super) struct RedisCore {
    core: usize,
    before: CpuSet,
}

impl RedisCore {
    /// Keeps the last core this process may use for Redis and moves every thread of this
    /// process to the rest (threads started later inherit it). None on one core.
    pub(super) fn reserve() -> Result<Option<Self>, String> {
        let err = |e: nix::Error| format!("keeping a core for Redis: {e}");
        let before = sched_getaffinity(Pid::from_raw(0)).map_err(err)?;
        let cores: Vec<usize> = (0..CpuSet::count())
            .filter(|&c| before.is_set(c).unwrap_or(false))
            .collect();
        let Some((&core, rest)) = cores.split_last() else {
            return Ok(None);
        };
        if rest.is_empty() {
            return Ok(None);
        }
        let mut others = CpuSet::new();
        for &c in rest {
            others.set(c).map_err(err)?;
        }
        set_all_threads(&others).map_err(err)?;
        Ok(Some(Self { core, before }))
    }

    /// Runs process `pid` (a redis-server) on the kept core only.
    pub(super) fn pin(&self, pid: u32) -> Result<(), String> {
        let mut one = CpuSet::new();
        let err = |e: nix::Error| format!("running redis-server {pid} on core {}: {e}", self.core);
        one.set(self.core).map_err(err)?;
        let pid = i32::try_from(pid).map_err(|_| format!("redis-server pid {pid}"))?;
        sched_setaffinity(Pid::from_raw(pid), &one).map_err(err)
    }

    /// The kept core.
    pub(super) fn core(&self) -> usize {
        self.core
    }
}

impl Drop for RedisCore {
    fn drop(&mut self) {
        let _ = set_all_threads(&self.before);
    }
}

/// Sets the cores of every thread of this process (a thread that ended meanwhile is
/// skipped).
fn set_all_threads(cores: &CpuSet) -> Result<(), nix::Error> {
    let tasks = std::fs::read_dir("/proc/self/task").map_err(|_| nix::Error::ENOENT)?;
    for task in tasks.flatten() {
        let Some(tid) = task
            .file_name()
            .to_str()
            .and_then(|t| t.parse::<i32>().ok())
        else {
            continue;
        };
        match sched_setaffinity(Pid::from_raw(tid), cores) {
            Ok(()) | Err(nix::Error::ESRCH) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_last_core_and_gives_the_rest_back() {
        let before = sched_getaffinity(Pid::from_raw(0)).unwrap_or_else(|e| panic!("{e}"));
        let n = (0..CpuSet::count())
            .filter(|&c| before.is_set(c).unwrap_or(false))
            .count();
        let kept = RedisCore::reserve().unwrap_or_else(|e| panic!("{e}"));
        match (&kept, n) {
            (None, 1) => {}
            (Some(k), n) if n >= 2 => {
                let now = sched_getaffinity(Pid::from_raw(0)).unwrap_or_else(|e| panic!("{e}"));
                assert!(
                    !now.is_set(k.core()).unwrap_or(true),
                    "this thread left the kept core"
                );
                assert!(before.is_set(k.core()).unwrap_or(false));
            }
            (k, n) => panic!("{n} cores, kept {k:?}"),
        }
        if let Some(k) = &kept {
            // A process pinned runs on the kept core only.
            let mut child = std::process::Command::new("sleep")
                .arg("30")
                .spawn()
                .unwrap_or_else(|e| panic!("sleep: {e}"));
            let pinned = k.pin(child.id());
            let pid = Pid::from_raw(i32::try_from(child.id()).unwrap_or_else(|e| panic!("{e}")));
            let cores = sched_getaffinity(pid);
            let _ = child.kill();
            let _ = child.wait();
            pinned.unwrap_or_else(|e| panic!("{e}"));
            let cores = cores.unwrap_or_else(|e| panic!("{e}"));
            for c in 0..CpuSet::count() {
                assert_eq!(cores.is_set(c).unwrap_or(false), c == k.core(), "core {c}");
            }
        }
        drop(kept);
        let after = sched_getaffinity(Pid::from_raw(0)).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(after, before, "the cores are given back");
    }
}
