//! crun's knowledge of a container: its state (read from crun's own record when it can be, else
//! by asking `crun state`), and the record planarian writes after a restore so that later crun
//! verbs know the restored container.

use super::{Bundle, Error, Globals, Result, Spec};
use serde_json::Value;
use std::path::{Path, PathBuf};
use sys::Context;

/// crun's state directory when Podman passes no `--root`.
pub const CRUN_ROOT: &str = "/run/crun";

#[derive(Debug, Clone)]
pub struct Container {
    pub id: String,
    pub status: String,
    pub pid: Option<i32>,
    /// The bundle crun was given (Podman's userdata directory).
    pub bundle: PathBuf,
    pub spec: Spec,
}

impl Container {
    /// Loads a container crun knows, by full ID.
    pub fn load(crun: &Path, globals: &Globals, id: &str) -> Result<Container> {
        let root = globals.root.as_deref();
        if let Some(c) = Self::load_running(root.unwrap_or(Path::new(CRUN_ROOT)), id) {
            return Ok(c);
        }
        let st = match (super::crun::Crun { bin: crun, globals }.state(id)) {
            Err(Error::CrunStateFailed { .. }) => return Err(Error::NotKnownToCrun(id.to_string())),
            r => r?,
        };
        let bundle = st.bundle;
        Ok(Container { id: id.to_string(), status: st.status, pid: st.pid, spec: Bundle::load(&bundle)?.spec, bundle })
    }

    /// A started container whose init still runs, read from crun's own record the way `crun
    /// state` decides it (the recorded init PID with the recorded start time; no exec fifo, which
    /// only a created container has) without running crun. `None` for anything else: the caller
    /// asks crun.
    fn load_running(root: &Path, id: &str) -> Option<Container> {
        if id.is_empty() || !id.bytes().all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b)) || id.starts_with('.')
        {
            return None;
        }
        let dir = root.join(id);
        if dir.join("exec.fifo").exists() {
            return None;
        }
        let st: Value = serde_json::from_slice(&std::fs::read(dir.join("status")).ok()?).ok()?;
        let pid = i32::try_from(st["pid"].as_i64()?).ok().filter(|p| *p > 0)?;
        if sys::proc::start_time(pid)? != st["process-start-time"].as_u64()? {
            return None;
        }
        let bundle = PathBuf::from(st["bundle"].as_str()?);
        let spec = Bundle::load(&bundle).ok()?.spec;
        Some(Container { id: id.to_string(), status: "running".into(), pid: Some(pid), bundle, spec })
    }

    /// Whether crun's record (under `root`, default [`CRUN_ROOT`]) still names the init this was
    /// loaded with, that init still running: read as [`Container::load`] reads a running one,
    /// without its bundle. False for anything else (a container restored or restarted since,
    /// or one whose record is not there), which the caller loads again.
    pub fn is_current(&self, root: Option<&Path>) -> bool {
        let Some(pid) = self.pid.filter(|_| self.status == "running") else { return false };
        let dir = root.unwrap_or(Path::new(CRUN_ROOT)).join(&self.id);
        let Some(st) = std::fs::read(dir.join("status")).ok().and_then(|b| serde_json::from_slice::<Value>(&b).ok())
        else {
            return false;
        };
        st["pid"].as_i64() == Some(i64::from(pid))
            && st["bundle"].as_str() == self.bundle.to_str()
            && st["process-start-time"].as_u64().is_some_and(|t| sys::proc::start_time(pid) == Some(t))
    }

    /// The running container's init PID, or a clear error.
    pub fn running_pid(&self) -> Result<i32> {
        match (self.status.as_str(), self.pid) {
            ("running" | "paused", Some(pid)) => Ok(pid),
            (s, _) => Err(Error::NotRunning { id: self.id.clone(), status: s.to_string() }),
        }
    }
}

/// The upper (writable) directory of the overlay mounted as a process's root, if it is one.
pub fn overlay_upperdir_of(pid: i32) -> Result<Option<PathBuf>> {
    let mounts = sys::proc::Proc::of(pid).mounts()?;
    Ok(sys::proc::overlay_root_upperdir(&mounts))
}

/// Whether any overlay on this host currently uses `upper` as its upper directory.
pub fn upperdir_mounted(upper: &Path) -> bool {
    sys::proc::Proc::own().mounts().is_ok_and(|ms| sys::proc::upperdir_in_use(&ms, upper))
}

/// Waits until no overlay uses `upper` as its upper directory, or until `deadline`; whether none
/// does.
pub fn wait_upperdir_unmounted(upper: &Path, deadline: std::time::Instant) -> bool {
    wait_mounts(deadline, |ms| !sys::proc::upperdir_in_use(ms, upper))
}

/// Waits until this process's mounts satisfy `done`, or until `deadline`; whether they do. The
/// kernel wakes a poll of `/proc/self/mountinfo` at every mount and unmount (proc(5)), so the
/// wait costs nothing in between.
fn wait_mounts(deadline: std::time::Instant, done: impl Fn(&[sys::proc::Mount]) -> bool) -> bool {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    use std::io::{Read, Seek};
    use std::os::fd::AsFd;
    let now = || sys::proc::Proc::own().mounts().is_ok_and(|ms| done(&ms));
    // (opened before the first read: a change after the open wakes the poll at once)
    let Ok(mut f) = std::fs::File::open("/proc/self/mountinfo") else { return now() };
    loop {
        let mut text = String::new();
        if f.rewind().and_then(|_| f.read_to_string(&mut text)).is_err() {
            return now();
        }
        if done(&sys::proc::parse_mountinfo(&text)) {
            return true;
        }
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return false;
        }
        // (rounded up: woken a little early, it would look once more and wait again)
        let ms = left.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32;
        let mut fds = [PollFd::new(f.as_fd(), PollFlags::POLLPRI)];
        match poll(&mut fds, PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX)) {
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(_) => return now(),
        }
    }
}

/// Writes crun's record of a running container (`<root>/<id>/status` and the config), as crun
/// itself does after a restore, so later crun verbs know it.
pub fn register_with_crun(globals: &Globals, id: &str, pid: i32, bundle: &Path, spec: &Spec) -> Result<()> {
    let descriptors: Vec<String> = (0..3).map(|i| sys::proc::Proc::of(pid).fd_target(i)).collect();
    let root = globals.root.clone().unwrap_or_else(|| PathBuf::from(CRUN_ROOT));
    let dir = root.join(id);
    std::fs::create_dir_all(&dir).at("create", &dir)?;
    let status = serde_json::json!({
        "pid": pid,
        "process-start-time": sys::proc::start_time(pid).unwrap_or(0),
        "cgroup-path": spec.cgroup_relpath().unwrap_or_default(),
        "scope": "",
        "rootfs": spec.root.display().to_string(),
        "systemd-cgroup": globals.systemd_cgroup,
        "bundle": bundle.display().to_string(),
        "created": crate::log::rfc3339(std::time::SystemTime::now()),
        "owner": "root",
        "detached": true,
        "external_descriptors": serde_json::to_string(&descriptors).unwrap_or_default(),
    });
    std::fs::copy(bundle.join("config.json"), dir.join("config.json")).at("copy config.json to", &dir)?;
    let text =
        serde_json::to_string_pretty(&status).map_err(|source| Error::Json { what: "crun status".into(), source })?;
    Ok(sys::write_atomic(&dir.join("status"), text.as_bytes(), 0o700)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wait_for_mounts_ends_once_they_are_so_or_at_its_deadline() {
        use std::time::{Duration, Instant};
        // (this process has mounts: true at once, whatever the deadline)
        assert!(wait_mounts(Instant::now(), |ms| !ms.is_empty()));
        assert!(wait_upperdir_unmounted(Path::new("/no/such/upper"), Instant::now()));
        let t = Instant::now();
        assert!(!wait_mounts(t + Duration::from_millis(50), |_| false));
        assert!(t.elapsed() >= Duration::from_millis(50), "not before its deadline");
    }

    #[test]
    fn a_running_container_from_cruns_record() {
        let scratch = tempfile::tempdir().unwrap();
        let root = scratch.path().join("crunroot");
        let (id, bundle) = ("c0ffee", root.join("bundle"));
        std::fs::create_dir_all(root.join(id)).unwrap();
        std::fs::create_dir_all(&bundle).unwrap();
        std::fs::write(bundle.join("config.json"), r#"{"root":{"path":"rootfs"},"process":{"terminal":true}}"#)
            .unwrap();
        let me = std::process::id() as i32;
        let status = |start: u64| {
            let v = serde_json::json!({"pid": me, "process-start-time": start, "bundle": bundle});
            std::fs::write(root.join(id).join("status"), v.to_string()).unwrap();
        };
        let start = sys::proc::start_time(me).unwrap();
        status(start);
        let c = Container::load_running(&root, id).expect("read from the record");
        assert_eq!((c.status.as_str(), c.pid), ("running", Some(me)));
        assert!(c.spec.terminal && c.spec.root == bundle.join("rootfs"));
        // Still current while the record names the same init; not once it names another (a
        // restore or a restart since), nor without a record.
        assert!(c.is_current(Some(&root)));
        status(start + 1);
        assert!(!c.is_current(Some(&root)));
        status(start);
        assert!(!Container { pid: Some(me + 1), ..c.clone() }.is_current(Some(&root)));
        assert!(!c.is_current(Some(&scratch.path().join("elsewhere"))));
        // A PID reused by another process, a created container, a path for an ID: ask crun.
        status(start + 1);
        assert!(Container::load_running(&root, id).is_none());
        status(start);
        std::fs::write(root.join(id).join("exec.fifo"), "").unwrap();
        assert!(Container::load_running(&root, id).is_none());
        assert!(Container::load_running(&root, "../c0ffee").is_none());
        assert!(Container::load_running(&root, "missing").is_none());
    }

    #[test]
    fn not_running_is_one_clear_line() {
        let c = Container {
            id: "abc".into(),
            status: "stopped".into(),
            pid: None,
            bundle: PathBuf::new(),
            spec: Spec::default(),
        };
        assert_eq!(c.running_pid().unwrap_err().to_string(), "container abc is not running (it is stopped)");
    }
}
