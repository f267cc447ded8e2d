//! The MCP call positions, kept durably beside the undo log.
//!
//! `last` is the highest position ever given to a call; positions are never reused. `current`
//! is the position a statepoint captures: the newest call that is in effect (after a
//! compensation to P it is P, although later calls had higher numbers). Each compensation is
//! remembered as (to, last): it undid the calls in (to, last], so a statepoint captured at a
//! position in that range can no longer be reached by compensation, and says so. A tool let
//! through unrecorded is remembered with the positions current at its first and its last pass
//! (`passed`): no statepoint captured since the first covers the service, and a rollback to a
//! position before the last cannot undo what it did.

use crate::error::{Error, Result};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

pub struct Positions {
    pub current: u64,
    pub last: u64,
    pub events: Vec<(u64, u64)>,
    /// (first, last, tool): the positions current at a tool's first and last pass.
    pub passed: Vec<(u64, u64, String)>,
    path: PathBuf,
}

impl Positions {
    pub fn load(path: &Path, floor: u64) -> Result<Positions> {
        let mut p = Positions { current: floor, last: floor, events: vec![], passed: vec![], path: path.to_path_buf() };
        match std::fs::read(path) {
            Ok(data) => {
                let v: Value =
                    serde_json::from_slice(&data).map_err(|e| Error::Invalid(format!("{}: {e}", path.display())))?;
                p.last = v["last"].as_u64().unwrap_or(0).max(floor);
                p.current = v["current"].as_u64().unwrap_or(0);
                // A call that reached the database after the state was written (a crash in
                // between) is in effect: its undo rows say so.
                if floor > p.current {
                    p.current = floor;
                }
                p.events = v["compensations"]
                    .as_array()
                    .map(|a| a.iter().filter_map(|e| Some((e[0].as_u64()?, e[1].as_u64()?))).collect())
                    .unwrap_or_default();
                p.passed = v["passed"]
                    .as_array()
                    .map(|a| {
                        a.iter()
                            .filter_map(|e| {
                                Some((e[0].as_u64()?, e[2].as_u64().or(e[0].as_u64())?, e[1].as_str()?.to_string()))
                            })
                            .collect()
                    })
                    .unwrap_or_default();
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::file("read", path)(e)),
        }
        p.save()?;
        Ok(p)
    }

    fn save(&self) -> Result<()> {
        let v = json!({
            "current": self.current,
            "last": self.last,
            "compensations": self.events.iter().map(|(a, b)| json!([a, b])).collect::<Vec<_>>(),
            "passed": self.passed.iter().map(|(p, l, t)| json!([p, t, l])).collect::<Vec<_>>(),
        });
        sys::write_atomic(&self.path, v.to_string().as_bytes(), 0o644).map_err(Error::from)
    }

    /// The position of a new mutating call. Not written here (no fsync per call): a call that
    /// changed the database left undo rows with its position, which `load` takes as the floor;
    /// one that left none is unobservable unless a statepoint captured it, and `captured` writes
    /// the state.
    pub fn next(&mut self) -> u64 {
        self.last += 1;
        self.current = self.last;
        self.last
    }

    /// The current position, for a statepoint: written down, so that no later call can ever
    /// be given a position at or below one a statepoint holds.
    pub fn captured(&self) -> Result<u64> {
        self.save()?;
        Ok(self.current)
    }

    /// A call of `tool` let through unrecorded (written down before it is sent).
    pub fn passed(&mut self, tool: &str) -> Result<()> {
        let now = self.current;
        match self.passed.iter_mut().find(|(_, _, t)| t == tool) {
            Some((_, last, _)) if *last == now => return Ok(()),
            Some((_, last, _)) => *last = now,
            None => self.passed.push((now, now, tool.to_string())),
        }
        self.save()
    }

    pub fn check_reachable(&self, to: u64) -> Result<()> {
        if to > self.last {
            return Err(Error::Refused(format!("position {to} was never reached (the last call is {})", self.last)));
        }
        if let Some((q, m)) = self.events.iter().find(|(q, m)| *q < to && to <= *m) {
            return Err(Error::Refused(format!(
                "position {to} can no longer be restored: the calls {}..={m} were undone by a rollback to position {q}",
                q + 1
            )));
        }
        Ok(())
    }

    pub fn compensated(&mut self, to: u64) -> Result<()> {
        if to < self.current {
            self.events.push((to, self.last));
        }
        self.current = to;
        self.save()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_survive_restart_and_undone_ranges_are_unreachable() {
        let scratch = tempfile::tempdir().unwrap();
        let path = scratch.path().join("positions.json");
        let mut p = Positions::load(&path, 0).unwrap();
        for want in 1..=10 {
            assert_eq!(p.next(), want);
        }
        p.check_reachable(5).unwrap();
        p.compensated(5).unwrap();
        assert_eq!(p.current, 5);
        assert_eq!(p.next(), 11);
        assert!(p.check_reachable(10).unwrap_err().to_string().contains("6..=10 were undone"));
        p.check_reachable(5).unwrap();
        p.check_reachable(11).unwrap();
        assert!(p.check_reachable(12).is_err());
        // A call that left no undo rows (it changed nothing) but was captured by a statepoint
        // is never numbered again after a restart.
        assert_eq!(p.next(), 12);
        assert_eq!(p.captured().unwrap(), 12);
        let mut q = Positions::load(&path, 11).unwrap();
        assert_eq!((q.current, q.last), (12, 12));
        assert_eq!(q.next(), 13);
        // Restart: the state file is read back; undo rows beyond it win.
        let mut p = Positions::load(&path, 14).unwrap();
        assert_eq!((p.current, p.last, p.events.len()), (14, 14, 1));
        p.passed("raw").unwrap();
        p.passed("raw").unwrap();
        p.next();
        p.passed("raw").unwrap();
        let p = Positions::load(&path, 0).unwrap();
        assert_eq!(p.passed, vec![(14, 15, "raw".to_string())]);
    }
}
