//! Freezing a container's cgroup so nothing drifts during a statepoint (cgroup v2 `cgroup.freeze`,
//! or the v1 freezer controller).

use super::{Error, Result};

/// Present in a container's store while planarian holds its cgroup frozen; names the cgroup.
pub const MARKER: &str = "frozen-by-planarian";
/// In a container's store: locked (`flock`, exclusive) while planarian holds its cgroup frozen,
/// and by the runtime's `pause` and `resume` for their run ([`lock`]), so that neither cuts
/// into the other: a thaw at the end of planarian's window would undo a pause made inside it.
pub const LOCK: &str = "freeze.lock";
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use sys::Context;

#[derive(Debug, Clone)]
pub struct Freezer {
    dir: PathBuf,
    v2: bool,
}

impl Freezer {
    /// The freezer of the cgroup `pid` lives in.
    pub fn of_pid(pid: i32) -> Result<Freezer> {
        let text = sys::proc::Proc::of(pid).read("cgroup")?;
        if let Some(rel) = text.lines().find_map(|l| l.strip_prefix("0::")) {
            let dir = Path::new("/sys/fs/cgroup").join(rel.trim().trim_start_matches('/'));
            if dir.join("cgroup.freeze").exists() {
                return Ok(Freezer { dir, v2: true });
            }
        }
        if let Some(rel) = text.lines().find_map(|l| {
            let mut f = l.splitn(3, ':');
            let (_, ctrl, path) = (f.next()?, f.next()?, f.next()?);
            ctrl.split(',').any(|c| c == "freezer").then_some(path)
        }) {
            let dir = Path::new("/sys/fs/cgroup/freezer").join(rel.trim().trim_start_matches('/'));
            return Ok(Freezer { dir, v2: false });
        }
        Err(Error::NoFreezer(pid))
    }

    /// The freezer of the cgroup at `dir` (as a marker names it).
    pub fn at(dir: PathBuf) -> Freezer {
        let v2 = dir.join("cgroup.freeze").exists();
        Freezer { dir, v2 }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn is_frozen(&self) -> bool {
        if self.v2 {
            std::fs::read_to_string(self.dir.join("cgroup.events"))
                .map(|t| t.lines().any(|l| l == "frozen 1"))
                .unwrap_or(false)
        } else {
            std::fs::read_to_string(self.dir.join("freezer.state")).map(|t| t.trim() == "FROZEN").unwrap_or(false)
        }
    }

    pub fn freeze(&self) -> Result<()> {
        self.set(true)?;
        let end = Instant::now() + Duration::from_secs(10);
        while !self.is_frozen() {
            if Instant::now() > end {
                let _ = self.set(false);
                return Err(Error::DidNotFreeze(self.dir.clone()));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(())
    }

    pub fn thaw(&self) -> Result<()> {
        self.set(false)
    }

    fn set(&self, frozen: bool) -> Result<()> {
        let (file, value) = if self.v2 {
            ("cgroup.freeze", if frozen { "1" } else { "0" })
        } else {
            ("freezer.state", if frozen { "FROZEN" } else { "THAWED" })
        };
        Ok(std::fs::write(self.dir.join(file), value).at("write", self.dir.join(file))?)
    }
}

/// A container frozen for a statepoint's window, and thawed again when this is dropped, on every
/// path out (an error, a panic): a sandbox is never left frozen by a failed snapshot. A marker
/// file names the cgroup while it is frozen, so that a planarian killed mid-window is undone by
/// the next operation ([`FreezeGuard::recover`]). A cgroup that was already frozen (a paused
/// container) is left as it was.
pub struct FreezeGuard<'a> {
    freezer: &'a Freezer,
    marker: PathBuf,
    froze: bool,
    /// The store's [`LOCK`], held for the window (frozen by this guard or not: a `resume` that
    /// came in a paused container's window would let it run under planarian's hands).
    _lock: Held,
}

/// The freeze lock ([`LOCK`]) of the store at `dir`, exclusive: it waits while planarian holds
/// the container frozen, or another `pause` or `resume` runs.
pub fn lock(dir: &Path) -> Result<std::fs::File> {
    let path = dir.join(LOCK);
    let f = std::fs::File::options().create(true).truncate(false).write(true).open(&path).at("open", &path)?;
    f.lock().at("lock", &path)?;
    Ok(f)
}

/// The freeze locks this process holds: each one's path, open file and how many guards share
/// it. A window inside another of the same process (a rollback's safety statepoint) shares its
/// lock: `flock` belongs to the open file, and a second open would wait for the first forever.
static HELD: std::sync::Mutex<Vec<(PathBuf, std::fs::File, usize)>> = std::sync::Mutex::new(Vec::new());

/// One share of a freeze lock this process holds ([`HELD`]); the last one lets it go.
struct Held(PathBuf);

impl Held {
    fn take(dir: &Path) -> Result<Held> {
        let path = dir.join(LOCK);
        let held = || HELD.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(e) = held().iter_mut().find(|e| e.0 == path) {
            e.2 += 1;
            return Ok(Held(path));
        }
        // (waited for outside the list: another thread's window on another store goes on)
        let f = lock(dir)?;
        held().push((path.clone(), f, 1));
        Ok(Held(path))
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut held = HELD.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = held.iter().position(|e| e.0 == self.0) {
            held[i].2 -= 1;
            if held[i].2 == 0 {
                held.swap_remove(i);
            }
        }
    }
}

impl<'a> FreezeGuard<'a> {
    pub fn freeze(freezer: &'a Freezer, marker: PathBuf) -> Result<FreezeGuard<'a>> {
        let lock = Held::take(marker.parent().unwrap_or(Path::new("/")))?;
        // (frozen already: paused, or by a window this one is inside)
        if freezer.is_frozen() {
            return Ok(FreezeGuard { freezer, marker, froze: false, _lock: lock });
        }
        std::fs::write(&marker, freezer.dir().display().to_string()).at("write", &marker)?;
        // From here on, dropping the guard thaws (a freeze that failed half-way included).
        let guard = FreezeGuard { freezer, marker, froze: true, _lock: lock };
        freezer.freeze()?;
        Ok(guard)
    }

    /// Whether the cgroup is still frozen, as it must be through the window.
    pub fn holds(&self) -> bool {
        self.freezer.is_frozen()
    }
}

impl Drop for FreezeGuard<'_> {
    fn drop(&mut self) {
        if self.froze {
            let _ = self.freezer.thaw();
            let _ = std::fs::remove_file(&self.marker);
        }
    }
}

impl FreezeGuard<'_> {
    /// Thaws the cgroup a planarian killed mid-window left frozen, as its marker names it, and
    /// removes the marker. Whether there was one.
    pub fn recover(marker: &Path) -> bool {
        let Ok(dir) = std::fs::read_to_string(marker) else { return false };
        let _ = Freezer::at(PathBuf::from(dir.trim())).thaw();
        let _ = std::fs::remove_file(marker);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether another open file (as another process's) could lock the freeze lock in `dir` now.
    fn free(dir: &Path) -> bool {
        let f = std::fs::File::options().create(true).truncate(false).write(true).open(dir.join(LOCK)).unwrap();
        f.try_lock().is_ok()
    }

    #[test]
    fn a_window_inside_another_shares_its_lock_and_the_last_lets_it_go() {
        let dir = tempfile::tempdir().unwrap();
        let outer = Held::take(dir.path()).unwrap();
        // (a second open file would wait for the first forever: this returns at once)
        let inner = Held::take(dir.path()).unwrap();
        assert!(!free(dir.path()));
        drop(outer);
        assert!(!free(dir.path()), "the inner window still holds it");
        drop(inner);
        assert!(free(dir.path()));
    }
}
