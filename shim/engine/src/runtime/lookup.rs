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
        if let Some(g) = t.get("storage").and_then(|s| s.get("graphroot")).and_then(|g| g.as_str()).filter(|g| !g.is_empty()) {
            return PathBuf::from(g);
        }
        break;
    }
    PathBuf::from("/var/lib/containers/storage")
}

/// The ID of the container `name` (a name, a full ID, or an unambiguous ID prefix) in
/// containers/storage's records under `graphroot`; `None` when they do not say.
pub fn storage_id_in(graphroot: &Path, name: &str) -> Option<String> {
    let mut found: Vec<String> = Vec::new();
    for dir in std::fs::read_dir(graphroot).ok()?.flatten() {
        if !dir.file_name().to_string_lossy().ends_with("-containers") {
            continue;
        }
        let Ok(data) = std::fs::read(dir.path().join("containers.json")) else { continue };
        let Ok(serde_json::Value::Array(list)) = serde_json::from_slice(&data) else { continue };
        for c in &list {
            let Some(id) = c["id"].as_str() else { continue };
            let named = c["names"].as_array().is_some_and(|ns| ns.iter().any(|n| n.as_str() == Some(name)));
            if named || id == name {
                return Some(id.to_string());
            }
            if name.len() >= 3 && id.starts_with(name) && !found.iter().any(|f| f == id) {
                found.push(id.to_string());
            }
        }
    }
    match &found[..] {
        [one] => Some(one.clone()),
        _ => None,
    }
}

pub fn storage_id(name: &str) -> Option<String> {
    storage_id_in(&graphroot(), name)
}

/// Whether the container whose init process is `pid` runs under planarian: its parent is the
/// conmon Podman started with `-r RUNTIME` (after a restore too: CRIU restores the tree as
/// conmon's child). `None` when that cannot be read.
pub fn runtime_is_planarian(pid: i32) -> Option<bool> {
    let ppid = sys::proc::parent_pid(pid)?;
    let cmdline = std::fs::read(format!("/proc/{ppid}/cmdline")).ok()?;
    let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
    if !args.first().is_some_and(|a| a.ends_with(b"conmon")) {
        return None;
    }
    let runtime = args.windows(2).find(|w| w[0] == b"-r" || w[0] == b"--runtime").map(|w| w[1])?;
    use std::os::unix::ffi::OsStrExt;
    let runtime = Path::new(std::ffi::OsStr::from_bytes(runtime));
    Some(runtime.file_name().is_some_and(|n| n == "planarian") || same_file(runtime, &std::env::current_exe().ok()?))
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
        let root = std::env::temp_dir().join(format!("planarian-lookup-{}", std::process::id()));
        let dir = root.join("overlay-containers");
        std::fs::create_dir_all(&dir).unwrap();
        let (a, b) = ("ab12".repeat(16), "ab13".repeat(16));
        std::fs::write(
            dir.join("containers.json"),
            format!(r#"[{{"id":"{a}","names":["agent"],"layer":"x"}},{{"id":"{b}","names":["agent-b","other"]}}]"#),
        )
        .unwrap();
        assert_eq!(storage_id_in(&root, "agent").as_deref(), Some(a.as_str()));
        assert_eq!(storage_id_in(&root, "other").as_deref(), Some(b.as_str()));
        assert_eq!(storage_id_in(&root, &b).as_deref(), Some(b.as_str()));
        assert_eq!(storage_id_in(&root, "ab12a").as_deref(), Some(a.as_str()));
        // Ambiguous or too short a prefix, an unknown name, no storage at all: Podman decides.
        assert_eq!(storage_id_in(&root, "ab1"), None);
        assert_eq!(storage_id_in(&root, "ab"), None);
        assert_eq!(storage_id_in(&root, "nobody"), None);
        assert_eq!(storage_id_in(&root.join("missing"), "agent"), None);
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn a_process_not_under_conmon_says_nothing() {
        // The test runner's parent is not conmon.
        assert_eq!(runtime_is_planarian(std::process::id() as i32), None);
        assert_eq!(runtime_is_planarian(i32::MAX), None);
    }
}
