//! Freezing a container's cgroup so nothing drifts during a statepoint (cgroup v2 `cgroup.freeze`,
//! or the v1 freezer controller).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
pub struct Freezer {
    dir: PathBuf,
    v2: bool,
}

impl Freezer {
    /// The freezer of the cgroup `pid` lives in.
    pub fn of_pid(pid: i32) -> Result<Freezer, String> {
        let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).map_err(|e| format!("cannot read /proc/{pid}/cgroup: {e}"))?;
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
        Err(format!("no cgroup freezer found for process {pid}"))
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

    pub fn freeze(&self) -> Result<(), String> {
        self.set(true)?;
        let end = Instant::now() + Duration::from_secs(10);
        while !self.is_frozen() {
            if Instant::now() > end {
                let _ = self.set(false);
                return Err(format!("the container's cgroup {} did not freeze within 10 s", self.dir.display()));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(())
    }

    pub fn thaw(&self) -> Result<(), String> {
        self.set(false)
    }

    fn set(&self, frozen: bool) -> Result<(), String> {
        let (file, value) = if self.v2 {
            ("cgroup.freeze", if frozen { "1" } else { "0" })
        } else {
            ("freezer.state", if frozen { "FROZEN" } else { "THAWED" })
        };
        std::fs::write(self.dir.join(file), value)
            .map_err(|e| format!("cannot write {} to {}: {e}", value, self.dir.join(file).display()))
    }
}
