//! What planarian knows of a container: crun's state and the OCI config in its bundle.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

#[derive(Debug, Clone)]
pub struct Container {
    pub id: String,
    pub status: String,
    pub pid: Option<i32>,
    pub spec: Spec,
}

/// The parts of an OCI config.json that checkpoint/restore need.
#[derive(Debug, Clone, Default)]
pub struct Spec {
    pub root: PathBuf,
    /// Bind mounts as (destination, source).
    pub binds: Vec<(String, String)>,
    pub masked_paths: Vec<String>,
    /// The network namespace's path, when the container joins an existing one.
    pub netns_path: Option<PathBuf>,
    pub cgroups_path: Option<String>,
    pub terminal: bool,
    pub annotations: Vec<(String, String)>,
}

impl Spec {
    pub fn load(bundle: &Path) -> Result<Spec, String> {
        let path = bundle.join("config.json");
        let data = std::fs::read(&path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        let v: Value = serde_json::from_slice(&data).map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(Spec::from_value(&v, bundle))
    }

    pub fn from_value(v: &Value, bundle: &Path) -> Spec {
        let root = v["root"]["path"].as_str().unwrap_or("rootfs");
        let root = if Path::new(root).is_absolute() { PathBuf::from(root) } else { bundle.join(root) };
        let binds = v["mounts"]
            .as_array()
            .map(|ms| {
                ms.iter()
                    .filter(|m| {
                        m["type"].as_str() == Some("bind")
                            || m["options"].as_array().is_some_and(|o| o.iter().any(|x| x == "bind" || x == "rbind"))
                    })
                    .filter_map(|m| Some((m["destination"].as_str()?.to_string(), m["source"].as_str()?.to_string())))
                    .collect()
            })
            .unwrap_or_default();
        let strings = |x: &Value| -> Vec<String> {
            x.as_array().map(|a| a.iter().filter_map(|s| s.as_str().map(String::from)).collect()).unwrap_or_default()
        };
        let netns_path = v["linux"]["namespaces"].as_array().and_then(|ns| {
            ns.iter()
                .find(|n| n["type"] == "network")
                .and_then(|n| n["path"].as_str())
                .filter(|p| !p.is_empty())
                .map(PathBuf::from)
        });
        Spec {
            root,
            binds,
            masked_paths: strings(&v["linux"]["maskedPaths"]),
            netns_path,
            cgroups_path: v["linux"]["cgroupsPath"].as_str().map(String::from),
            terminal: v["process"]["terminal"].as_bool().unwrap_or(false),
            annotations: v["annotations"]
                .as_object()
                .map(|m| m.iter().filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string()))).collect())
                .unwrap_or_default(),
        }
    }

    /// The configuration for this container: `cfg` with its `io.planarian.*` annotations applied.
    pub fn configure(&self, cfg: &crate::config::Config) -> Result<crate::config::Config, String> {
        cfg.with_annotations(self.annotations.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .map_err(|e| e.to_string())
    }

    /// The cgroup path (relative to the cgroup root) the container's processes live in, for the
    /// cgroupfs manager (`/a/b`) and the systemd one (`slice:prefix:name`).
    pub fn cgroup_relpath(&self) -> Option<String> {
        let p = self.cgroups_path.as_deref()?;
        let parts: Vec<&str> = p.split(':').collect();
        if parts.len() == 3 && !p.starts_with('/') {
            let (slice, prefix, name) = (parts[0], parts[1], parts[2]);
            let mut path = String::new();
            // Nested slices: a-b.slice lives in a.slice/a-b.slice.
            let stem = slice.trim_end_matches(".slice");
            let mut acc = String::new();
            for (i, part) in stem.split('-').enumerate() {
                if i > 0 {
                    acc.push('-');
                }
                acc.push_str(part);
                path.push('/');
                path.push_str(&acc);
                path.push_str(".slice");
            }
            path.push_str(&format!("/{prefix}-{name}.scope"));
            return Some(path);
        }
        Some(format!("/{}", p.trim_start_matches('/')))
    }
}

impl Container {
    /// Loads a container crun knows, by full ID.
    pub fn load(crun: &Path, root: Option<&Path>, id: &str) -> Result<Container, String> {
        if let Some(c) = Self::load_running(root.unwrap_or(Path::new(CRUN_ROOT)), id) {
            return Ok(c);
        }
        let mut cmd = Command::new(crun);
        if let Some(r) = root {
            cmd.arg("--root").arg(r);
        }
        let out = cmd.args(["state", id]).output().map_err(|e| format!("cannot run {}: {e}", crun.display()))?;
        if !out.status.success() {
            return Err(format!("container {id} is not known to crun (is it running?)"));
        }
        let st: Value = serde_json::from_slice(&out.stdout).map_err(|e| format!("crun state {id}: {e}"))?;
        let bundle = PathBuf::from(st["bundle"].as_str().ok_or_else(|| format!("crun state {id}: no bundle"))?);
        let spec = Spec::load(&bundle)?;
        Ok(Container {
            id: id.to_string(),
            status: st["status"].as_str().unwrap_or("unknown").to_string(),
            pid: st["pid"].as_i64().filter(|p| *p > 0).map(|p| p as i32),
            spec,
        })
    }

    /// A started container whose init still runs, read from crun's own record the way `crun
    /// state` decides it (the recorded init PID with the recorded start time; no exec fifo, which
    /// only a created container has) without running crun. `None` for anything else: the caller
    /// asks crun.
    fn load_running(root: &Path, id: &str) -> Option<Container> {
        if id.is_empty() || !id.bytes().all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b)) || id.starts_with('.') {
            return None;
        }
        let dir = root.join(id);
        if dir.join("exec.fifo").exists() {
            return None;
        }
        let st: Value = serde_json::from_slice(&std::fs::read(dir.join("status")).ok()?).ok()?;
        let pid = i32::try_from(st["pid"].as_i64()?).ok().filter(|p| *p > 0)?;
        if start_time(pid)? != st["process-start-time"].as_u64()? {
            return None;
        }
        let spec = Spec::load(Path::new(st["bundle"].as_str()?)).ok()?;
        Some(Container { id: id.to_string(), status: "running".into(), pid: Some(pid), spec })
    }

    /// The running container's init PID, or a clear error.
    pub fn running_pid(&self) -> Result<i32, String> {
        match (self.status.as_str(), self.pid) {
            ("running" | "paused", Some(pid)) => Ok(pid),
            (s, _) => Err(format!("container {} is not running (it is {s})", self.id)),
        }
    }
}

/// The upper (writable) directory of the overlay mounted as a process's root, if it is one.
pub fn overlay_upperdir_of(pid: i32) -> Result<Option<PathBuf>, String> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).map_err(|e| format!("cannot read /proc/{pid}/mountinfo: {e}"))?;
    Ok(text.lines().find_map(|l| {
        let fields: Vec<&str> = l.split(' ').collect();
        if fields.get(4) != Some(&"/") {
            return None;
        }
        let sep = fields.iter().position(|f| *f == "-")?;
        if fields.get(sep + 1) != Some(&"overlay") {
            return None;
        }
        fields.get(sep + 3)?.split(',').find_map(|o| o.strip_prefix("upperdir=")).map(PathBuf::from)
    }))
}

/// Whether any overlay on this host currently uses `upper` as its upper directory.
pub fn upperdir_mounted(upper: &Path) -> bool {
    let needle = format!("upperdir={}", upper.display());
    std::fs::read_to_string("/proc/self/mountinfo")
        .map(|t| t.lines().any(|l| l.split(',').any(|o| o == needle || o.starts_with(&format!("{needle} ")))))
        .unwrap_or(false)
}

/// crun's state directory when Podman passes no `--root`.
pub const CRUN_ROOT: &str = "/run/crun";

/// Field `n` (1-based, as in proc(5)) of /proc/PID/stat, for a field after the command name.
pub fn stat_field(pid: i32, n: usize) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces and parentheses: fields follow its last ')'.
    let after = &s[s.rfind(')')? + 2..];
    after.split(' ').nth(n.checked_sub(3)?)?.parse().ok()
}

/// Field 22 of /proc/PID/stat: the start time in clock ticks since boot.
pub fn start_time(pid: i32) -> Option<u64> {
    stat_field(pid, 22)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_by_their_proc5_numbers() {
        let me = std::process::id() as i32;
        assert_eq!(stat_field(me, 4), Some(u64::from(std::os::unix::process::parent_id())));
        assert_eq!(stat_field(me, 22), start_time(me));
        assert_eq!(stat_field(me, 2), None);
    }

    #[test]
    fn a_running_container_from_cruns_record() {
        let root = std::env::temp_dir().join(format!("planarian-crunroot-{}", std::process::id()));
        let (id, bundle) = ("c0ffee", root.join("bundle"));
        std::fs::create_dir_all(root.join(id)).unwrap();
        std::fs::create_dir_all(&bundle).unwrap();
        std::fs::write(bundle.join("config.json"), r#"{"root":{"path":"rootfs"},"process":{"terminal":true}}"#).unwrap();
        let me = std::process::id() as i32;
        let status = |start: u64| {
            let v = serde_json::json!({"pid": me, "process-start-time": start, "bundle": bundle});
            std::fs::write(root.join(id).join("status"), v.to_string()).unwrap();
        };
        status(start_time(me).unwrap());
        let c = Container::load_running(&root, id).expect("read from the record");
        assert_eq!((c.status.as_str(), c.pid), ("running", Some(me)));
        assert!(c.spec.terminal && c.spec.root == bundle.join("rootfs"));
        // A PID reused by another process, a created container, a path for an ID: ask crun.
        status(start_time(me).unwrap() + 1);
        assert!(Container::load_running(&root, id).is_none());
        status(start_time(me).unwrap());
        std::fs::write(root.join(id).join("exec.fifo"), "").unwrap();
        assert!(Container::load_running(&root, id).is_none());
        assert!(Container::load_running(&root, "../c0ffee").is_none());
        assert!(Container::load_running(&root, "missing").is_none());
        std::fs::remove_dir_all(&root).unwrap();
    }

    fn podman_like_spec() -> Value {
        serde_json::json!({
            "root": {"path": "/var/lib/containers/storage/overlay/abc/merged"},
            "process": {"terminal": false},
            "mounts": [
                {"destination": "/proc", "type": "proc", "source": "proc"},
                {"destination": "/dev/shm", "type": "bind", "source": "/ud/shm", "options": ["bind", "rprivate"]},
                {"destination": "/etc/hosts", "type": "bind", "source": "/run/ud/hosts", "options": ["bind"]},
                {"destination": "/data", "type": "none", "source": "/srv/data", "options": ["rbind"]}
            ],
            "linux": {
                "namespaces": [{"type": "pid"}, {"type": "network", "path": "/run/netns/netns-1"}],
                "maskedPaths": ["/proc/kcore", "/sys/firmware"],
                "cgroupsPath": "/libpod_parent/libpod-abc"
            },
            "annotations": {"io.planarian.checkpoint.full_dump_interval": "3"}
        })
    }

    #[test]
    fn reads_what_checkpoint_needs_from_a_podman_spec() {
        let s = Spec::from_value(&podman_like_spec(), Path::new("/b"));
        assert_eq!(s.root, Path::new("/var/lib/containers/storage/overlay/abc/merged"));
        assert_eq!(
            s.binds,
            vec![
                ("/dev/shm".to_string(), "/ud/shm".to_string()),
                ("/etc/hosts".to_string(), "/run/ud/hosts".to_string()),
                ("/data".to_string(), "/srv/data".to_string())
            ]
        );
        assert_eq!(s.netns_path.as_deref(), Some(Path::new("/run/netns/netns-1")));
        assert_eq!(s.cgroup_relpath().as_deref(), Some("/libpod_parent/libpod-abc"));
        assert_eq!(s.masked_paths.len(), 2);
        assert_eq!(s.annotations.len(), 1);
    }

    #[test]
    fn network_none_has_no_netns_path_and_relative_root_is_in_the_bundle() {
        let v = serde_json::json!({"root": {"path": "rootfs"}, "linux": {"namespaces": [{"type": "network"}]}});
        let s = Spec::from_value(&v, Path::new("/b"));
        assert_eq!(s.netns_path, None);
        assert_eq!(s.root, Path::new("/b/rootfs"));
    }

    #[test]
    fn systemd_cgroup_paths() {
        let s = Spec { cgroups_path: Some("machine.slice:libpod:abc".into()), ..Default::default() };
        assert_eq!(s.cgroup_relpath().as_deref(), Some("/machine.slice/libpod-abc.scope"));
        let s = Spec { cgroups_path: Some("user-1000.slice:libpod:abc".into()), ..Default::default() };
        assert_eq!(s.cgroup_relpath().as_deref(), Some("/user.slice/user-1000.slice/libpod-abc.scope"));
    }

    #[test]
    fn start_time_of_self() {
        assert!(start_time(std::process::id() as i32).is_some());
    }
}
