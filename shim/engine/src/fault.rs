//! Fault injection for the system tests: each step of a statepoint operation that must be undone
//! on failure is a named point, and `/run/planarian/fault` holding a point's name makes that step
//! fail once (the file is removed as it fires, so the recovery that follows runs for real).
//! `pause:NAME` instead makes that step wait, once, for as long as `/run/planarian/paused`
//! (written as it pauses) exists: a test does there what the machine might do at that moment.
//! `hold:NAME` asks a step that does work in the background (a page server's transfer) to hold
//! that work, not the rest, as long as the paused file exists ([`hold`]).
//! The file may hold several of these, one a line: each is taken once, by its point, and the
//! file removed with the last (a test arms two steps of one operation, the second of which may
//! come on another thread).
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
    at(Path::new(FILE), Path::new(PAUSED), name)
}

const PAUSED: &str = "/run/planarian/paused";

/// How long a pause lasts at most (a test that died does not hold the sandbox for good).
const PAUSE_LIMIT: std::time::Duration = std::time::Duration::from_secs(600);

/// The directive of the fault file (its line without `name`: one of `kinds`) that names point
/// `name`, taken: the line removed, and the file with the last one.
fn take(file: &Path, name: &str, kinds: &[&str]) -> Option<String> {
    // (two threads of one operation take theirs one after the other)
    static TAKING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = TAKING.lock().unwrap_or_else(|e| e.into_inner());
    let text = std::fs::read_to_string(file).ok()?;
    let lines: Vec<&str> = text.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
    let i = lines.iter().position(|l| l.strip_suffix(name).is_some_and(|kind| kinds.contains(&kind)))?;
    let rest: Vec<&str> = lines.iter().enumerate().filter(|(j, _)| *j != i).map(|(_, l)| *l).collect();
    let taken = match rest.is_empty() {
        true => std::fs::remove_file(file).is_ok(),
        false => sys::write_atomic(file, format!("{}\n", rest.join("\n")).as_bytes(), 0o644).is_ok(),
    };
    taken.then(|| lines[i].strip_suffix(name).unwrap_or_default().to_string())
}

fn at(file: &Path, paused: &Path, name: &str) -> Result<(), Injected> {
    match take(file, name, &["", "kill:", "pause:"]).as_deref() {
        Some("") => Err(Injected { point: name.to_string() }),
        // planarian killed at this point (SIGKILL: nothing of its own runs after it).
        Some("kill:") => {
            let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL);
            Ok(())
        }
        Some("pause:") => {
            // (whole or not at all: a test that sees the file reads the point's name in it)
            if sys::write_atomic(paused, name.as_bytes(), 0o644).is_ok() {
                let since = std::time::Instant::now();
                while paused.exists() && since.elapsed() < PAUSE_LIMIT {
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

/// Whether the fault file says `hold:NAME` (taken, once): then the paused file is written and
/// returned, and the caller holds its background work for as long as it exists.
pub fn hold(name: &str) -> Option<std::path::PathBuf> {
    hold_at(Path::new(FILE), Path::new(PAUSED), name)
}

fn hold_at(file: &Path, paused: &Path, name: &str) -> Option<std::path::PathBuf> {
    take(file, name, &["hold:"])?;
    sys::write_atomic(paused, name.as_bytes(), 0o644).ok()?;
    Some(paused.to_path_buf())
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
        let scratch = tempfile::tempdir().unwrap();
        let dir = scratch.path().join("fault");
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("fault");
        let paused = dir.join("paused");
        assert_eq!(at(&f, &paused, "snapshot.frozen"), Ok(()));
        std::fs::write(&f, "snapshot.frozen\n").unwrap();
        assert_eq!(at(&f, &paused, "snapshot.dumped"), Ok(()));
        assert_eq!(at(&f, &paused, "snapshot.frozen").unwrap_err().to_string(), "injected fault at snapshot.frozen");
        assert_eq!(at(&f, &paused, "snapshot.frozen"), Ok(()));
    }

    #[test]
    fn several_directives_each_once_and_the_file_gone_with_the_last() {
        let scratch = tempfile::tempdir().unwrap();
        let (f, paused) = (scratch.path().join("fault"), scratch.path().join("paused"));
        std::fs::write(&f, "rollback.in-place.compared\nrollback.in-place.put-back\n").unwrap();
        assert_eq!(at(&f, &paused, "rollback.in-place.put-back").unwrap_err().point, "rollback.in-place.put-back");
        assert_eq!(std::fs::read_to_string(&f).unwrap(), "rollback.in-place.compared\n");
        assert_eq!(at(&f, &paused, "rollback.in-place.put-back"), Ok(()));
        // (a point's name is the whole last field: not a suffix of another's)
        assert_eq!(at(&f, &paused, "compared"), Ok(()));
        assert_eq!(at(&f, &paused, "rollback.in-place.compared").unwrap_err().point, "rollback.in-place.compared");
        assert!(!f.exists());
        // A directive is read with its kind: a hold is not a failure, nor a failure a hold.
        std::fs::write(&f, "hold:lazy.background\n").unwrap();
        assert_eq!(at(&f, &paused, "lazy.background"), Ok(()));
        assert!(f.exists());
        std::fs::write(&f, "lazy.background\n").unwrap();
        assert_eq!(hold_at(&f, &paused, "lazy.background"), None);
        assert!(f.exists());
    }

    #[test]
    fn a_hold_is_taken_once_by_its_point_and_lasts_while_the_paused_file_does() {
        let scratch = tempfile::tempdir().unwrap();
        let (f, paused) = (scratch.path().join("fault"), scratch.path().join("paused"));
        std::fs::write(&f, "hold:lazy.background\n").unwrap();
        assert_eq!(hold_at(&f, &paused, "lazy.other"), None);
        assert_eq!(hold_at(&f, &paused, "lazy.background"), Some(paused.clone()));
        assert_eq!(std::fs::read_to_string(&paused).unwrap(), "lazy.background");
        assert!(!f.exists());
        assert_eq!(hold_at(&f, &paused, "lazy.background"), None);
    }

    #[test]
    fn a_pause_waits_until_the_paused_file_is_removed_once() {
        let scratch = tempfile::tempdir().unwrap();
        let dir = scratch.path().join("pause");
        std::fs::create_dir_all(&dir).unwrap();
        let (f, paused) = (dir.join("fault"), dir.join("paused"));
        std::fs::write(&f, "pause:rollback.in-place.files\n").unwrap();
        assert_eq!(at(&f, &paused, "snapshot.frozen"), Ok(()));
        let released = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                while !paused.exists() {
                    std::thread::sleep(std::time::Duration::from_millis(5));
                }
                assert_eq!(std::fs::read_to_string(&paused).unwrap(), "rollback.in-place.files");
                released.store(true, std::sync::atomic::Ordering::SeqCst);
                std::fs::remove_file(&paused).unwrap();
            });
            assert_eq!(at(&f, &paused, "rollback.in-place.files"), Ok(()));
            assert!(released.load(std::sync::atomic::Ordering::SeqCst), "returned before it was released");
        });
        assert!(!f.exists());
        // Once: the next time the point does not wait.
        assert_eq!(at(&f, &paused, "rollback.in-place.files"), Ok(()));
    }
}
