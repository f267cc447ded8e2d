//! Fault injection for the system tests: each step of a statepoint operation that must be undone
//! on failure is a named point, and `/run/planarian/fault` holding a point's name makes that step
//! fail once (the file is removed as it fires, so the recovery that follows runs for real).
//! A file rather than an environment variable: `restore` runs under conmon, which Podman starts
//! with an environment of its own. Only statepoint operations look; pass-through verbs never do.

use std::path::Path;

const FILE: &str = "/run/planarian/fault";

/// Fails with "injected fault at NAME" when the fault file names this point.
pub fn point(name: &str) -> Result<(), String> {
    at(Path::new(FILE), name)
}

fn at(file: &Path, name: &str) -> Result<(), String> {
    match std::fs::read_to_string(file) {
        Ok(text) if text.trim() == name && std::fs::remove_file(file).is_ok() => Err(format!("injected fault at {name}")),
        _ => Ok(()),
    }
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
        assert_eq!(at(&f, "snapshot.frozen"), Err("injected fault at snapshot.frozen".into()));
        assert_eq!(at(&f, "snapshot.frozen"), Ok(()));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
