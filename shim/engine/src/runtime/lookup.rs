//! Finding a container by the name or ID a user gives, without asking Podman.
//!
//! `podman container inspect` starts the whole engine (its database, storage, network config):
//! half a second here, on the path of every snapshot an agent takes. What a snapshot needs is on
//! disk already: containers/storage's own record of containers (`containers.json`, names kept
//! current by `podman rename`) maps the name to the ID, crun's state gives the init process, and
//! that process's conmon was started with `-r RUNTIME`. Whenever one of these cannot answer, the
//! caller asks Podman as before.

use std::path::{Path, PathBuf};

/// Where containers/storage keeps its data: `graphroot` of storage.conf (the file Podman reads:
/// `$CONTAINERS_STORAGE_CONF`, else /etc/containers/storage.conf, else the distribution's), or
/// the default.
fn graphroot() -> PathBuf {
    let files: Vec<PathBuf> = match std::env::var_os("CONTAINERS_STORAGE_CONF") {
        Some(f) => vec![f.into()],
        None => vec!["/etc/containers/storage.conf".into(), "/usr/share/containers/storage.conf".into()],
    };
    for f in files {
        let Ok(text) = std::fs::read_to_string(&f) else { continue };
        let Ok(t) = text.parse::<toml::Table>() else { break };
        if let Some(g) =
            t.get("storage").and_then(|s| s.get("graphroot")).and_then(|g| g.as_str()).filter(|g| !g.is_empty())
        {
            return PathBuf::from(g);
        }
        break;
    }
    PathBuf::from("/var/lib/containers/storage")
}

/// What containers/storage records of a container.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    pub id: String,
    /// Its (first) name, as Podman shows it.
    pub name: String,
    /// The writable layer's directory, as Podman's `GraphDriver.Data.UpperDir` says it (overlay
    /// driver only).
    pub upperdir: Option<PathBuf>,
}

/// The container `name` (a name, a full ID, or an unambiguous ID prefix) in containers/storage's
/// records under `graphroot`; `None` when they do not say.
pub fn storage_entry_in(graphroot: &Path, name: &str) -> Option<Entry> {
    scan(graphroot, name).1
}

/// Whether containers/storage's records could be read at all under `graphroot` (else they say
/// nothing of any name), and the container `name` in them.
fn scan(graphroot: &Path, name: &str) -> (bool, Option<Entry>) {
    let entry = |driver: &str, c: &serde_json::Value, id: &str| Entry {
        id: id.to_string(),
        name: c["names"].as_array().and_then(|ns| ns.first()?.as_str()).unwrap_or(id).to_string(),
        upperdir: c["layer"]
            .as_str()
            .filter(|_| driver == "overlay")
            .map(|l| graphroot.join(driver).join(l).join("diff")),
    };
    let (mut found, mut readable): (Vec<Entry>, bool) = (Vec::new(), false);
    let Ok(dirs) = std::fs::read_dir(graphroot) else { return (false, None) };
    for dir in dirs.flatten() {
        let file_name = dir.file_name();
        let Some(driver) = file_name.to_str().and_then(|n| n.strip_suffix("-containers")) else { continue };
        let Ok(data) = std::fs::read(dir.path().join("containers.json")) else { continue };
        let Ok(serde_json::Value::Array(list)) = serde_json::from_slice(&data) else { continue };
        readable = true;
        for c in &list {
            let Some(id) = c["id"].as_str() else { continue };
            let named = c["names"].as_array().is_some_and(|ns| ns.iter().any(|n| n.as_str() == Some(name)));
            if named || id == name {
                return (true, Some(entry(driver, c, id)));
            }
            if name.len() >= 3 && id.starts_with(name) && !found.iter().any(|f| f.id == id) {
                found.push(entry(driver, c, id));
            }
        }
    }
    match <[Entry; 1]>::try_from(found) {
        Ok([one]) => (true, Some(one)),
        Err(_) => (readable, None),
    }
}

pub fn storage_entry(name: &str) -> Option<Entry> {
    storage_entry_in(&graphroot(), name)
}

/// Whether a container has name (or ID, or ID prefix) `name`, by containers/storage's records,
/// which hold every container's names (Podman's too); `None` when there are none to read.
pub fn name_taken(name: &str) -> Option<bool> {
    match scan(&graphroot(), name) {
        (_, Some(_)) => Some(true),
        (true, None) => Some(false),
        (false, None) => None,
    }
}

pub fn storage_id(name: &str) -> Option<String> {
    storage_entry(name).map(|e| e.id)
}

/// Whether the container whose init process is `pid` runs under planarian: its parent is the
/// conmon Podman (or CRI-O) started with `-r RUNTIME` (after a restore too: CRIU restores the
/// tree as conmon's child), or containerd's runc shim whose `BinaryName` is planarian. `None`
/// when that cannot be read.
pub fn runtime_is_planarian(pid: i32) -> Option<bool> {
    let ppid = sys::proc::parent_pid(pid)?;
    let cmdline = sys::proc::Proc::of(ppid).read_bytes("cmdline").ok()?;
    let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
    use std::os::unix::ffi::OsStrExt;
    let runtime = if args.first().is_some_and(|a| a.ends_with(b"conmon")) {
        let r = args.windows(2).find(|w| w[0] == b"-r" || w[0] == b"--runtime").map(|w| w[1])?;
        PathBuf::from(std::ffi::OsStr::from_bytes(r))
    } else if args.first().is_some_and(|a| a.ends_with(SHIM.as_bytes())) {
        // (the shim runs in the task's bundle, where it keeps the runtime it was given)
        let bundle = sys::proc::Proc::of(ppid).link("cwd").ok()?;
        match std::fs::read_to_string(bundle.join("runtime")) {
            Ok(r) if !r.trim().is_empty() => PathBuf::from(r.trim()),
            _ => PathBuf::from(shim_binary(&bundle)?),
        }
    } else {
        return None;
    };
    Some(runtime.file_name().is_some_and(|n| n == "planarian") || same_file(&runtime, &std::env::current_exe().ok()?))
}

/// containerd's runc shim (`io.containerd.runc.v2`).
pub const SHIM: &str = "containerd-shim-runc-v2";

/// Where containerd's runc shim keeps its runtime's state (`Root` in the handler's options),
/// one directory per containerd namespace (`k8s.io` for the CRI).
const CONTAINERD_RUNC_ROOT: &str = "/run/containerd/runc";

/// The runtime binary (`BinaryName`) of the runc shim serving the task whose bundle is
/// `bundle`, as the shim keeps its options there (`options.json`); runc when it names none.
fn shim_binary(bundle: &Path) -> Option<String> {
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(bundle.join("options.json")).ok()?).ok()?;
    let binary = v["binary_name"].as_str().or(v["BinaryName"].as_str()).filter(|b| !b.is_empty()).unwrap_or("runc");
    Some(binary.to_string())
}

/// A container no Podman knows that a CRI engine runs through planarian — containerd's runc
/// shim, whose runtime state lives under `/run/containerd/runc/NAMESPACE` — found by its full
/// ID: the `--root` its runtime was given. (CRI-O's containers are named by their ID with the
/// handler's `runtime_root` as `--root`.)
pub fn cri_root(name: &str) -> Option<PathBuf> {
    if name.len() != 64 || !name.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let namespaces = std::fs::read_dir(CONTAINERD_RUNC_ROOT).ok()?;
    namespaces.flatten().map(|ns| ns.path()).find(|root| root.join(name).join("status").is_file())
}

fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(x), Ok(y)) => x.dev() == y.dev() && x.ino() == y.ino(),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_ids_and_prefixes_from_containers_json() {
        let scratch = tempfile::tempdir().unwrap();
        let root = scratch.path().join("lookup");
        let dir = root.join("overlay-containers");
        std::fs::create_dir_all(&dir).unwrap();
        let (a, b) = ("ab12".repeat(16), "ab13".repeat(16));
        std::fs::write(
            dir.join("containers.json"),
            format!(r#"[{{"id":"{a}","names":["agent"],"layer":"x"}},{{"id":"{b}","names":["agent-b","other"]}}]"#),
        )
        .unwrap();
        assert_eq!(storage_entry_in(&root, "agent").map(|e| e.id).as_deref(), Some(a.as_str()));
        assert_eq!(storage_entry_in(&root, "other").map(|e| e.id).as_deref(), Some(b.as_str()));
        assert_eq!(storage_entry_in(&root, &b).map(|e| e.id).as_deref(), Some(b.as_str()));
        assert_eq!(storage_entry_in(&root, "ab12a").map(|e| e.id).as_deref(), Some(a.as_str()));
        // Ambiguous or too short a prefix, an unknown name, no storage at all: Podman decides.
        assert_eq!(storage_entry_in(&root, "ab1").map(|e| e.id), None);
        assert_eq!(storage_entry_in(&root, "ab").map(|e| e.id), None);
        assert_eq!(storage_entry_in(&root, "nobody").map(|e| e.id), None);
        assert_eq!(storage_entry_in(&root.join("missing"), "agent"), None);
        // Whether the records could be read at all: an unknown name is free only then.
        assert_eq!(scan(&root, "nobody"), (true, None));
        assert_eq!(scan(&root.join("missing"), "nobody"), (false, None));
        // What Podman's inspect says of them: the first name, the overlay's upper directory.
        let other = storage_entry_in(&root, "other").unwrap();
        assert_eq!((other.name.as_str(), other.upperdir), ("agent-b", None));
        assert_eq!(storage_entry_in(&root, "agent").unwrap().upperdir, Some(root.join("overlay/x/diff")));
    }

    #[test]
    fn a_process_not_under_conmon_says_nothing() {
        // The test runner's parent is not conmon.
        assert_eq!(runtime_is_planarian(std::process::id() as i32), None);
        assert_eq!(runtime_is_planarian(i32::MAX), None);
    }
}
