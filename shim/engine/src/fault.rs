//! Fault injection for the system tests: each step of a statepoint operation that must be undone
//! on failure is a named point, and `/run/planarian/fault` holding a point's name makes that step
//! fail once (the file is removed as it fires, so the recovery that follows runs for real).
//! A file rather than an environment variable: `restore` runs under conmon, which Podman starts
//! with an environment of its own. Only statepoint operations look; pass-through verbs never do.

use std::path::Path;

const FILE: &str = "/run/planarian/fault";

/// The step named by the fault file failed on purpose.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("injected fault at {point}")]
pub struct Injected {
    pub point: String,
}

/// Fails with "injected fault at NAME" when the fault file names this point.
pub fn point(name: &str) -> Result<(), Injected> {
    at(Path::new(FILE), name)
}

fn at(file: &Path, name: &str) -> Result<(), Injected> {
    match std::fs::read_to_string(file) {
        Ok(text) if text.trim() == name && std::fs::remove_file(file).is_ok() => Err(Injected { point: name.to_string() }),
        _ => Ok(()),
    }
}

const ORACLE: &str = "/run/planarian/oracle";

/// For the tests of a rollback in place: a directory named by `/run/planarian/oracle` (removed
/// as it is read) gets a full CRIU dump of the container right after the rollback, before it
/// runs again, to compare with the statepoint.
pub fn oracle_dir() -> Option<std::path::PathBuf> {
    let text = std::fs::read_to_string(ORACLE).ok()?;
    std::fs::remove_file(ORACLE).ok()?;
    Some(std::path::PathBuf::from(text.trim()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fires_once_at_the_named_point_only() {
        let dir = std::env::temp_dir().join(format!("planarian-fault-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("fault");
        assert_eq!(at(&f, "snapshot.frozen"), Ok(()));
        std::fs::write(&f, "snapshot.frozen\n").unwrap();
        assert_eq!(at(&f, "snapshot.dumped"), Ok(()));
        assert_eq!(at(&f, "snapshot.frozen").unwrap_err().to_string(), "injected fault at snapshot.frozen");
        assert_eq!(at(&f, "snapshot.frozen"), Ok(()));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
