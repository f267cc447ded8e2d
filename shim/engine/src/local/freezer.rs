//! Freezing a container's cgroup so nothing drifts during a statepoint (cgroup v2 `cgroup.freeze`,
//! or the v1 freezer controller).

use super::{Error, Result};

/// Present in a container's store while planarian holds its cgroup frozen; names the cgroup.
pub const MARKER: &str = "frozen-by-planarian";
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
}

impl<'a> FreezeGuard<'a> {
    pub fn freeze(freezer: &'a Freezer, marker: PathBuf) -> Result<FreezeGuard<'a>> {
        if freezer.is_frozen() {
            return Ok(FreezeGuard { freezer, marker, froze: false });
        }
        std::fs::write(&marker, freezer.dir().display().to_string()).at("write", &marker)?;
        // From here on, dropping the guard thaws (a freeze that failed half-way included).
        let guard = FreezeGuard { freezer, marker, froze: true };
        freezer.freeze()?;
        Ok(guard)
    }

    /// Whether the cgroup was frozen by this guard (and is still frozen, as it must be).
    pub fn holds(&self) -> bool {
        !self.froze || self.freezer.is_frozen()
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
