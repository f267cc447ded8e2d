//! The OCI bundle of a container: its `config.json`, read once per verb into the typed subset
//! planarian needs ([`Spec`]), with the document itself kept for the rewrites that must preserve
//! every field the types do not model (the root path, annotations).

use super::{Error, Result};
use serde::Deserialize;
use serde_json::Value;
use std::path::{Path, PathBuf};
use sys::Context;

/// The parts of an OCI config.json that planarian needs.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Spec {
    pub root: PathBuf,
    /// Bind mounts as (destination, source).
    pub binds: Vec<(String, String)>,
    /// The other mounts as (destination, type).
    pub mounts: Vec<(String, String)>,
    pub masked_paths: Vec<String>,
    /// The network namespace's path, when the container joins an existing one.
    pub netns_path: Option<PathBuf>,
    pub cgroups_path: Option<String>,
    pub terminal: bool,
    /// String annotations, in the document's order.
    pub annotations: Vec<(String, String)>,
}

// The document as serde reads it: only these fields, every one optional.
#[derive(Deserialize, Default)]
#[serde(default)]
struct Doc {
    root: Option<Root>,
    mounts: Vec<MountEntry>,
    linux: Option<Linux>,
    process: Option<Process>,
    annotations: serde_json::Map<String, Value>,
}

#[derive(Deserialize)]
struct Root {
    path: Option<String>,
}

#[derive(Deserialize)]
struct MountEntry {
    destination: Option<String>,
    #[serde(rename = "type")]
    kind: Option<String>,
    source: Option<String>,
    #[serde(default)]
    options: Vec<String>,
}

#[derive(Deserialize, Default)]
#[serde(default, rename_all = "camelCase")]
struct Linux {
    namespaces: Vec<Namespace>,
    masked_paths: Vec<String>,
    cgroups_path: Option<String>,
}

#[derive(Deserialize)]
struct Namespace {
    #[serde(rename = "type")]
    kind: String,
    path: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct Process {
    terminal: bool,
}

impl Spec {
    /// The typed subset of a config.json document (`bundle` anchors a relative root path).
    pub fn from_value(v: &Value, bundle: &Path) -> Result<Spec, serde_json::Error> {
        let d = Doc::deserialize(v)?;
        let root = d.root.and_then(|r| r.path).unwrap_or_else(|| "rootfs".into());
        let root = if Path::new(&root).is_absolute() { PathBuf::from(root) } else { bundle.join(root) };
        let (binds, mounts): (Vec<MountEntry>, Vec<MountEntry>) = d
            .mounts
            .into_iter()
            .partition(|m| m.kind.as_deref() == Some("bind") || m.options.iter().any(|o| o == "bind" || o == "rbind"));
        let binds = binds.into_iter().filter_map(|m| Some((m.destination?, m.source?))).collect();
        let mounts = mounts.into_iter().filter_map(|m| Some((m.destination?, m.kind.unwrap_or_default()))).collect();
        let linux = d.linux.unwrap_or_default();
        let netns_path = linux
            .namespaces
            .iter()
            .find(|n| n.kind == "network")
            .and_then(|n| n.path.as_deref())
            .filter(|p| !p.is_empty())
            .map(PathBuf::from);
        Ok(Spec {
            root,
            binds,
            mounts,
            masked_paths: linux.masked_paths,
            netns_path,
            cgroups_path: linux.cgroups_path,
            terminal: d.process.unwrap_or_default().terminal,
            annotations: d.annotations.into_iter().filter_map(|(k, v)| Some((k, v.as_str()?.to_string()))).collect(),
        })
    }

    /// The configuration for this container: `cfg` with its `io.planarian.*` annotations applied.
    pub fn configure(&self, cfg: &crate::config::Config) -> Result<crate::config::Config, crate::config::ConfigError> {
        cfg.with_annotations_of(self.annotations.iter().map(|(k, v)| (k, v)), None)
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

/// A container's bundle: its directory, its config.json as a document and as a [`Spec`].
#[derive(Debug, Clone)]
pub struct Bundle {
    pub dir: PathBuf,
    pub spec: Spec,
    doc: Value,
}

impl Bundle {
    /// Reads `DIR/config.json` (once).
    pub fn load(dir: &Path) -> Result<Bundle> {
        let path = dir.join("config.json");
        let data = std::fs::read(&path).at("read", &path)?;
        let doc: Value =
            serde_json::from_slice(&data).map_err(|source| Error::Json { what: path.display().to_string(), source })?;
        let spec =
            Spec::from_value(&doc, dir).map_err(|source| Error::Json { what: path.display().to_string(), source })?;
        Ok(Bundle { dir: dir.to_path_buf(), spec, doc })
    }

    /// Points the config's root at `path` (Podman writes its overlay path there on every start
    /// and restore), every other field kept as it was.
    pub fn point_root_at(&mut self, path: &Path) -> Result<()> {
        if self.spec.root == path {
            return Ok(());
        }
        self.doc["root"]["path"] = Value::String(path.display().to_string());
        self.spec.root = path.to_path_buf();
        self.save()
    }

    /// Sets annotations in the config (values as they are: Podman saves the config again).
    pub fn set_annotations(&mut self, settings: impl IntoIterator<Item = (String, Value)>) -> Result<()> {
        let path = self.dir.join("config.json");
        let annotations = self
            .doc
            .as_object_mut()
            .ok_or_else(|| Error::NotAnObject(path.clone()))?
            .entry("annotations")
            .or_insert_with(|| serde_json::json!({}));
        for (k, v) in settings {
            annotations[k] = v;
        }
        self.spec = Spec::from_value(&self.doc, &self.dir)
            .map_err(|source| Error::Json { what: path.display().to_string(), source })?;
        self.save()
    }

    /// Why this config, of container `id`, cannot be made another container's by renaming
    /// (what only `podman container init` makes for each container, or what another container
    /// holds), if it cannot: SELinux labels (each container has its own); a mount of a volume (a
    /// clone's anonymous volumes are its own), an overlay mount (its upper directory is in the
    /// container's own directory), or any file of that directory Podman's restore does not make
    /// again (it makes `/etc/hosts`, `resolv.conf`, `hostname`, `.containerenv`, `passwd`,
    /// `group`, `localtime` and `/dev/shm`); a namespace of another process joined by its path.
    pub fn not_derivable(&self, id: &str) -> Option<String> {
        let given = |v: &Value| v.as_str().is_some_and(|s| !s.is_empty());
        if given(&self.doc["process"]["selinuxLabel"]) || given(&self.doc["linux"]["mountLabel"]) {
            return Some("SELinux labels are each container's own".into());
        }
        const REMADE: [&str; 8] =
            ["hosts", "resolv.conf", "hostname", ".containerenv", "passwd", "group", "shm", "localtime"];
        for m in self.doc["mounts"].as_array().into_iter().flatten() {
            let (kind, source) = (m["type"].as_str().unwrap_or(""), Path::new(m["source"].as_str().unwrap_or("")));
            let destination = m["destination"].as_str().unwrap_or("");
            let volume = source.components().any(|c| c.as_os_str() == "volumes" || c.as_os_str() == "_data");
            let own = source.to_str().is_some_and(|s| s.contains(id))
                && !source.file_name().and_then(|n| n.to_str()).is_some_and(|n| REMADE.contains(&n));
            let what = match (kind == "overlay", volume, own) {
                (true, _, _) => "an overlay",
                (_, true, _) => "a volume",
                (_, _, true) => "a file of the container's own",
                _ => continue,
            };
            return Some(format!("its mount of {destination} is {what}"));
        }
        let joined = self.doc["linux"]["namespaces"]
            .as_array()
            .into_iter()
            .flatten()
            .find_map(|n| n["path"].as_str().filter(|p| p.starts_with("/proc/")).and(n["type"].as_str()));
        joined.map(|kind| format!("it joins another container's {kind} namespace"))
    }

    /// The config of bundle `from` written into directory `to` as another container's: each
    /// `(old, new)` of `renames` replaced throughout (IDs and the paths they are in), the
    /// annotations `dropped` left out.
    pub fn derive(from: &Path, to: &Path, renames: &[(&str, &str)], dropped: &[&str]) -> Result<Bundle> {
        let path = from.join("config.json");
        let mut text = std::fs::read_to_string(&path).at("read", &path)?;
        for (old, new) in renames.iter().filter(|(old, _)| !old.is_empty()) {
            text = text.replace(old, new);
        }
        let mut doc: Value =
            serde_json::from_str(&text).map_err(|source| Error::Json { what: path.display().to_string(), source })?;
        if let Some(a) = doc.get_mut("annotations").and_then(Value::as_object_mut) {
            a.retain(|k, _| !dropped.contains(&k.as_str()));
        }
        let spec =
            Spec::from_value(&doc, to).map_err(|source| Error::Json { what: path.display().to_string(), source })?;
        let b = Bundle { dir: to.to_path_buf(), spec, doc };
        b.save()?;
        Ok(b)
    }

    fn save(&self) -> Result<()> {
        let data =
            serde_json::to_vec(&self.doc).map_err(|source| Error::Json { what: "config.json".into(), source })?;
        Ok(sys::write_atomic(&self.dir.join("config.json"), &data, 0o644)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn podman_like_spec() -> Value {
        serde_json::json!({
            "ociVersion": "1.0.2-dev",
            "root": {"path": "/var/lib/containers/storage/overlay/abc/merged"},
            "process": {"terminal": false, "args": ["sh"]},
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
            "annotations": {"io.planarian.checkpoint.full_dump_interval": "3", "io.podman.x": "y"}
        })
    }

    #[test]
    fn reads_what_checkpoint_needs_from_a_podman_spec() {
        let s = Spec::from_value(&podman_like_spec(), Path::new("/b")).unwrap();
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
        assert_eq!(s.annotations.len(), 2);
        assert_eq!(s.configure(&Default::default()).unwrap().checkpoint.full_dump_interval, 3);
    }

    #[test]
    fn what_only_a_containers_own_init_makes_is_seen() {
        let scratch = tempfile::tempdir().unwrap();
        let id = "c".repeat(64);
        let why = |v: &Value| {
            std::fs::write(scratch.path().join("config.json"), serde_json::to_vec(v).unwrap()).unwrap();
            Bundle::load(scratch.path()).unwrap().not_derivable(&id)
        };
        let base = || {
            let mut v = podman_like_spec();
            v["mounts"][2]["source"] = Value::String(format!("/run/overlay-containers/{id}/userdata/hosts"));
            v
        };
        assert_eq!(why(&base()), None);
        let mut v = base();
        v["linux"]["mountLabel"] = Value::String("system_u:object_r:container_file_t:s0:c1,c2".into());
        assert!(why(&v).unwrap().contains("SELinux"));
        let mut v = base();
        v["process"]["selinuxLabel"] = Value::String("system_u:system_r:container_t:s0:c1,c2".into());
        assert!(why(&v).unwrap().contains("SELinux"));
        for (source, kind, what) in [
            ("/var/lib/containers/storage/volumes/v/_data", "bind", "a volume"),
            ("/srv/podman-volumes/v/_data", "bind", "a volume"),
            (
                &format!("/var/lib/containers/storage/overlay-containers/{id}/userdata/notify"),
                "bind",
                "a file of the container's own",
            ),
            ("/srv/data", "overlay", "an overlay"),
        ] {
            let mut v = base();
            v["mounts"][3]["source"] = Value::String(source.to_string());
            v["mounts"][3]["type"] = Value::String(kind.to_string());
            assert_eq!(why(&v), Some(format!("its mount of /data is {what}")), "{source}");
        }
        let mut v = base();
        v["linux"]["namespaces"][0]["path"] = Value::String("/proc/4242/ns/pid".into());
        assert_eq!(why(&v).as_deref(), Some("it joins another container's pid namespace"));
    }

    #[test]
    fn a_config_derived_for_another_container_has_its_names_throughout() {
        let scratch = tempfile::tempdir().unwrap();
        let (from, to) = (scratch.path().join("src"), scratch.path().join("new"));
        std::fs::create_dir_all(&from).unwrap();
        std::fs::create_dir_all(&to).unwrap();
        let src_id = "0123456789ab".to_string() + &"c".repeat(52);
        let mut v = podman_like_spec();
        v["mounts"][2]["source"] = Value::String(format!("/run/overlay-containers/{src_id}/userdata/hosts"));
        v["linux"]["cgroupsPath"] = Value::String(format!("machine.slice:libpod:{src_id}"));
        v["hostname"] = Value::String("0123456789ab".into());
        v["annotations"]["io.planarian.mcp.branch"] = Value::String("db_src".into());
        std::fs::write(from.join("config.json"), serde_json::to_vec(&v).unwrap()).unwrap();
        let new_id = "fedcba987654".to_string() + &"d".repeat(52);
        let renames = [(src_id.as_str(), new_id.as_str()), ("abc", "xyz"), ("0123456789ab", "fedcba987654")];
        let b = Bundle::derive(&from, &to, &renames, &["io.planarian.mcp.branch"]).unwrap();
        assert_eq!(b.spec.root, Path::new("/var/lib/containers/storage/overlay/xyz/merged"));
        assert_eq!(b.spec.binds[1].1, format!("/run/overlay-containers/{new_id}/userdata/hosts"));
        assert_eq!(b.spec.cgroups_path, Some(format!("machine.slice:libpod:{new_id}")));
        let written: Value = serde_json::from_slice(&std::fs::read(to.join("config.json")).unwrap()).unwrap();
        assert_eq!(written["hostname"], "fedcba987654");
        assert!(written["annotations"].get("io.planarian.mcp.branch").is_none());
        assert_eq!(written["annotations"]["io.podman.x"], "y", "{written}");
        let text = std::fs::read_to_string(to.join("config.json")).unwrap();
        assert!(!text.contains("0123456789ab") && !text.contains("/abc/"), "{text}");
        assert_eq!(
            serde_json::from_slice::<Value>(&std::fs::read(from.join("config.json")).unwrap()).unwrap(),
            v,
            "the source's is untouched"
        );
    }

    #[test]
    fn network_none_has_no_netns_path_and_relative_root_is_in_the_bundle() {
        let v = serde_json::json!({"root": {"path": "rootfs"}, "linux": {"namespaces": [{"type": "network"}]}});
        let s = Spec::from_value(&v, Path::new("/b")).unwrap();
        assert_eq!(s.netns_path, None);
        assert_eq!(s.root, Path::new("/b/rootfs"));
        assert!(Spec::from_value(&serde_json::json!({"mounts": 3}), Path::new("/b")).is_err());
    }

    #[test]
    fn systemd_cgroup_paths() {
        let s = Spec { cgroups_path: Some("machine.slice:libpod:abc".into()), ..Default::default() };
        assert_eq!(s.cgroup_relpath().as_deref(), Some("/machine.slice/libpod-abc.scope"));
        let s = Spec { cgroups_path: Some("user-1000.slice:libpod:abc".into()), ..Default::default() };
        assert_eq!(s.cgroup_relpath().as_deref(), Some("/user.slice/user-1000.slice/libpod-abc.scope"));
    }

    #[test]
    fn rewrites_keep_every_field_and_their_order() {
        let scratch = tempfile::tempdir().unwrap();
        let dir = scratch.path().join("bundle");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("config.json"), podman_like_spec().to_string()).unwrap();
        let mut b = Bundle::load(&dir).unwrap();
        b.point_root_at(Path::new("/tank/ctr")).unwrap();
        b.set_annotations([("io.planarian.mcp.disabled".to_string(), serde_json::json!("fork"))]).unwrap();
        let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["root"]["path"], "/tank/ctr");
        assert_eq!(v["process"]["args"][0], "sh");
        assert_eq!(v["annotations"]["io.planarian.mcp.disabled"], "fork");
        let keys: Vec<&String> = v.as_object().unwrap().keys().collect();
        assert_eq!(keys, ["ociVersion", "root", "process", "mounts", "linux", "annotations"]);
        let again = Bundle::load(&dir).unwrap();
        assert_eq!(again.spec.root, Path::new("/tank/ctr"));
    }
}
