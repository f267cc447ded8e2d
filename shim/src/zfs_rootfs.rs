//! The files of a statepoint on ZFS: every container whose rootfs is a dataset gets zero-copy
//! snapshots, rollbacks and forks.
//!
//! A container is mapped to a dataset (`<store>/containers/<id>/zfs.json`) when it is created:
//! * its rootfs already is a mounted dataset (`podman run --rootfs /tank/sb`, Podman's zfs
//!   storage driver): that dataset, which planarian does not own;
//! * a parent dataset is configured and the rootfs is Podman's overlay: the container gets
//!   `<parent>/ctr-<id>`, a clone of `<parent>/image-<key>@base` — the image's layers copied into
//!   ZFS once per image — plus what its writable layer already held; the OCI config's root path
//!   is pointed at the clone on every create and restore, so the container runs on it while
//!   Podman keeps managing the container as usual.
//!
//! Statepoint `spN` of container C is the snapshot `@planarian-<C:12>-spN`, found by that name
//! wherever it lives in the pool (a promote moves snapshots between datasets):
//! * snapshot: `syncfs` (FUSE may hold written pages) and `zfs snapshot`, container frozen;
//! * rollback to any statepoint S: clone S, promote the clone, swap it in under the container's
//!   dataset name and mount point; the previous dataset, renamed `<ds>.planarian-old-N`, keeps
//!   the snapshots newer than S (so every statepoint stays restorable) and is destroyed once it
//!   holds none. Until the restore succeeded every step can be undone;
//! * fork: the new container's dataset is a clone of S;
//! * removing a statepoint: `zfs destroy -d` (kept while a clone depends on it);
//! * removing the container (Podman deletes its bundle): its datasets go; forks depending on its
//!   snapshots are promoted first, so they keep working.

use crate::config::Config;
use crate::store::ContainerStore;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::path::{Path, PathBuf};
use zfs::{Kind, Zfs};

const MAPPING: &str = "zfs.json";

/// Which dataset a container's rootfs is.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "kebab-case")]
pub struct Mapping {
    pub dataset: String,
    /// Created by planarian (destroyed with the container), or the user's own.
    pub owned: bool,
    /// The container's bundle: when Podman removes it, the container is gone.
    pub bundle: PathBuf,
    /// The per-image base the dataset was cloned from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_base: Option<String>,
}

pub fn zfs_from(cfg: &Config) -> Result<Zfs, String> {
    crate::tools::locate("zfs", cfg.runtime.zfs_path.as_deref(), "[runtime] zfs_path")
        .map(Zfs::new)
        .map_err(|e| e.to_string())
}

fn ze(e: zfs::Error) -> String {
    e.to_string()
}

pub fn mapping(store: &ContainerStore) -> Option<Mapping> {
    let data = std::fs::read(store.dir.join(MAPPING)).ok()?;
    serde_json::from_slice(&data).ok()
}

fn save_mapping(store: &ContainerStore, m: &Mapping) -> Result<(), String> {
    std::fs::create_dir_all(&store.dir).map_err(|e| format!("cannot create {}: {e}", store.dir.display()))?;
    crate::install::write_atomic(&store.dir.join(MAPPING), serde_json::to_string_pretty(m).unwrap().as_bytes(), 0o644)
}

fn short(id: &str) -> &str {
    &id[..id.len().min(12)]
}

/// The snapshot name (after `@`) of statepoint `sp` of container `id`.
pub fn snapshot_name(id: &str, sp: &str) -> String {
    format!("planarian-{}-{sp}", short(id))
}

/// Where a dataset is mounted, or an error when it is not.
fn mountpoint(zfs: &Zfs, ds: &str) -> Result<PathBuf, String> {
    let mp = zfs.get(ds, "mountpoint").map_err(ze)?.value;
    if !mp.starts_with('/') {
        return Err(format!("dataset {ds} has no mount point (mountpoint={mp}); give its parent one"));
    }
    if zfs.get(ds, "mounted").map_err(ze)?.value != "yes" {
        zfs.mount(ds).map_err(ze)?;
    }
    Ok(PathBuf::from(mp))
}

// ---------------------------------------------------------------------------------------------
// create / restore: the container runs on its dataset

/// Arguments of `create` as Podman sends them: the bundle (default: the working directory) and
/// the container ID (the last operand).
pub fn create_args(args: &[std::ffi::OsString]) -> (PathBuf, Option<String>) {
    let mut bundle = PathBuf::from(".");
    let mut id = None;
    let mut i = 0;
    while i < args.len() {
        let a = args[i].to_string_lossy();
        if let Some(v) = a.strip_prefix("--bundle=") {
            bundle = PathBuf::from(v);
        } else if a == "--bundle" || a == "-b" {
            if let Some(v) = args.get(i + 1) {
                bundle = PathBuf::from(v);
            }
            i += 1;
        } else if matches!(a.as_ref(), "--pid-file" | "--console-socket" | "--preserve-fds") {
            i += 1;
        } else if !a.starts_with('-') {
            id = Some(a.into_owned());
        }
        i += 1;
    }
    (bundle, id)
}

pub(crate) fn read_spec(bundle: &Path) -> Result<Value, String> {
    let path = bundle.join("config.json");
    let data = std::fs::read(&path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    serde_json::from_slice(&data).map_err(|e| format!("{}: {e}", path.display()))
}

fn root_of(spec: &Value, bundle: &Path) -> PathBuf {
    let root = spec["root"]["path"].as_str().unwrap_or("rootfs");
    if Path::new(root).is_absolute() {
        PathBuf::from(root)
    } else {
        bundle.join(root)
    }
}

fn point_root_at(bundle: &Path, mut spec: Value, path: &Path) -> Result<(), String> {
    if root_of(&spec, bundle) == path {
        return Ok(());
    }
    spec["root"]["path"] = Value::String(path.display().to_string());
    crate::install::write_atomic(&bundle.join("config.json"), serde_json::to_string(&spec).unwrap().as_bytes(), 0o644)
}

/// Points a mapped container's OCI config at its dataset (Podman writes its overlay path there
/// on every start and restore). A container without a mapping is left alone.
pub fn prepare_bundle(cfg: &Config, id: &str, bundle: &Path) -> Result<(), String> {
    let store = ContainerStore::new(&cfg.store.path, id);
    let Some(map) = mapping(&store) else { return Ok(()) };
    let spec = read_spec(bundle)?;
    let zfs = zfs_from(cfg)?;
    let mp = mountpoint(&zfs, &map.dataset)?;
    point_root_at(bundle, spec, &mp)
}

/// The `create` hook: maps a new container to its dataset (see the module text) and points its
/// config at it. Containers that are neither on ZFS nor under a configured parent dataset are
/// untouched (the copy-based path).
pub fn on_create(cfg: &Config, args: &[std::ffi::OsString]) -> Result<(), String> {
    let (bundle, Some(id)) = create_args(args) else { return Ok(()) };
    let store = ContainerStore::new(&cfg.store.path, &id);
    if store.dir.join(MAPPING).exists() {
        return prepare_bundle(cfg, &id, &bundle);
    }
    // An unreadable bundle is crun's to report, in crun's words.
    let Ok(spec) = read_spec(&bundle) else { return Ok(()) };
    let root = root_of(&spec, &bundle);
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").map_err(|e| format!("cannot read mountinfo: {e}"))?;
    if let Some(ds) = zfs::dataset_mounted_at(&mountinfo, &root) {
        let bundle = std::fs::canonicalize(&bundle).unwrap_or(bundle);
        return save_mapping(&store, &Mapping { dataset: ds, owned: false, bundle, image_base: None });
    }
    // Only the ZFS settings matter here; a bad annotation of another kind is reported by the
    // verb that uses it, not by refusing to create the container.
    let annotations: Vec<(String, String)> = spec["annotations"]
        .as_object()
        .map(|m| {
            m.iter()
                .filter(|(k, _)| k.starts_with("io.planarian.zfs."))
                .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string())))
                .collect()
        })
        .unwrap_or_default();
    let cfg = cfg.with_annotations(annotations.iter().map(|(k, v)| (k.as_str(), v.as_str()))).map_err(|e| e.to_string())?;
    let Some(parent) = cfg.zfs.parent_dataset.clone() else { return Ok(()) };
    let Some(layers) = overlay_layers(&mountinfo, &root) else { return Ok(()) };
    let zfs = zfs_from(&cfg)?;
    let base = ensure_image_base(&zfs, &cfg, &parent, &layers.lower)?;
    let ds = format!("{parent}/ctr-{id}");
    if zfs.exists(&ds).map_err(ze)? {
        // A leftover of a container with this ID whose mapping is gone: not ours to guess about.
        return Err(format!("dataset {ds} already exists; remove it (zfs destroy -r {ds}) or unset the parent dataset"));
    }
    zfs.clone_snapshot(&base, &ds, &[]).map_err(|e| format!("cannot give container {} its dataset: {e}", short(&id)))?;
    let r = (|| {
        let mp = mountpoint(&zfs, &ds)?;
        apply_layer(&layers.upper, &mp)?;
        let bundle = std::fs::canonicalize(&bundle).unwrap_or(bundle.clone());
        save_mapping(&store, &Mapping { dataset: ds.clone(), owned: true, bundle: bundle.clone(), image_base: Some(base.clone()) })?;
        point_root_at(&bundle, spec, &mp)
    })();
    if r.is_err() {
        let _ = std::fs::remove_file(store.dir.join(MAPPING));
        let _ = zfs.destroy(&ds, true);
    }
    r
}

struct Layers {
    /// Top first, as overlay lists them.
    lower: Vec<PathBuf>,
    upper: PathBuf,
}

/// The layers of the overlay mounted at `root`.
fn overlay_layers(mountinfo: &str, root: &Path) -> Option<Layers> {
    let want = root.to_str()?;
    mountinfo.lines().rev().find_map(|l| {
        let f: Vec<&str> = l.split(' ').collect();
        let sep = f.iter().position(|x| *x == "-")?;
        if f.get(4) != Some(&want) || f.get(sep + 1) != Some(&"overlay") {
            return None;
        }
        let opts = f.get(sep + 3)?;
        let get = |k: &str| opts.split(',').find_map(|o| o.strip_prefix(k));
        let upper = PathBuf::from(get("upperdir=")?);
        // Podman gives relative lower paths (l/SHORT) when the option string would be too long:
        // they are relative to the overlay driver's directory, two levels above the upper one.
        let home = upper.parent()?.parent()?.to_path_buf();
        let lower = get("lowerdir=")?
            .split(':')
            .map(|p| if p.starts_with('/') { PathBuf::from(p) } else { home.join(p) })
            .map(|p| std::fs::canonicalize(&p).unwrap_or(p))
            .collect();
        Some(Layers { lower, upper })
    })
}

/// A stable key for an image: FNV-1a of its layers' paths (they are named by layer ID).
fn image_key(lower: &[PathBuf]) -> String {
    let mut h: u64 = 0xcbf29ce484222325;
    for p in lower {
        for b in p.as_os_str().as_encoded_bytes().iter().chain(b"\n") {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x100000001b3);
        }
    }
    format!("{h:016x}")
}

/// `<parent>/image-<key>@base`, made once per image: the layers applied bottom-up.
fn ensure_image_base(zfs: &Zfs, cfg: &Config, parent: &str, lower: &[PathBuf]) -> Result<String, String> {
    let ds = format!("{parent}/image-{}", image_key(lower));
    let snap = format!("{ds}@base");
    std::fs::create_dir_all(&cfg.store.path).map_err(|e| format!("cannot create {}: {e}", cfg.store.path.display()))?;
    let lock_path = cfg.store.path.join(format!("zfs-image-{}.lock", image_key(lower)));
    let lock = std::fs::File::options().create(true).truncate(false).write(true).open(&lock_path).map_err(|e| format!("cannot open {}: {e}", lock_path.display()))?;
    lock.lock().map_err(|e| format!("cannot lock {}: {e}", lock_path.display()))?;
    if zfs.exists(&snap).map_err(ze)? {
        return Ok(snap);
    }
    if zfs.exists(&ds).map_err(ze)? {
        // A copy that never finished.
        zfs.destroy(&ds, true).map_err(ze)?;
    }
    if !zfs.exists(parent).map_err(ze)? {
        return Err(format!("parent dataset {parent} does not exist (zfs create {parent}, or fix [zfs] parent_dataset)"));
    }
    zfs.create(&ds, &[]).map_err(|e| format!("cannot create the image's dataset: {e}"))?;
    let r = (|| {
        let mp = mountpoint(zfs, &ds)?;
        for layer in lower.iter().rev() {
            apply_layer(layer, &mp)?;
        }
        zfs.snapshot(&snap).map_err(ze)?;
        zfs.set(&ds, "readonly", "on").map_err(ze)
    })();
    if let Err(e) = r {
        let _ = zfs.destroy(&ds, true);
        return Err(format!("cannot copy the image into {ds}: {e}"));
    }
    Ok(snap)
}

fn is_whiteout(md: &std::fs::Metadata) -> bool {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    md.file_type().is_char_device() && md.rdev() == 0
}

fn is_opaque(dir: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let Ok(c) = std::ffi::CString::new(dir.as_os_str().as_bytes()) else { return false };
    let mut buf = [0u8; 4];
    // SAFETY: valid NUL-terminated strings and a buffer of the given length.
    let n = unsafe { nix::libc::lgetxattr(c.as_ptr(), c"trusted.overlay.opaque".as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    n == 1 && buf[0] == b'y'
}

fn remove_any(p: &Path) {
    match std::fs::symlink_metadata(p) {
        Ok(md) if md.is_dir() => {
            let _ = std::fs::remove_dir_all(p);
        }
        Ok(_) => {
            let _ = std::fs::remove_file(p);
        }
        Err(_) => {}
    }
}

/// Applies an overlay layer onto a plain tree: whiteouts delete, opaque directories replace,
/// everything else is copied over (owners, modes, times, links kept).
fn apply_layer(layer: &Path, dest: &Path) -> Result<(), String> {
    fn before(layer: &Path, dest: &Path) -> std::io::Result<()> {
        for e in std::fs::read_dir(layer)? {
            let e = e?;
            let md = e.metadata()?;
            let to = dest.join(e.file_name());
            let there = std::fs::symlink_metadata(&to).ok();
            if is_whiteout(&md) || (md.is_dir() && is_opaque(&e.path())) {
                remove_any(&to);
            } else if md.is_dir() {
                if there.as_ref().is_some_and(|t| !t.is_dir()) {
                    remove_any(&to);
                } else if there.is_some() {
                    before(&e.path(), &to)?;
                }
            } else if there.as_ref().is_some_and(|t| t.is_dir()) {
                remove_any(&to);
            }
        }
        Ok(())
    }
    fn after(layer: &Path, dest: &Path) -> std::io::Result<()> {
        for e in std::fs::read_dir(layer)? {
            let e = e?;
            let md = e.metadata()?;
            if is_whiteout(&md) {
                remove_any(&dest.join(e.file_name()));
            } else if md.is_dir() {
                after(&e.path(), &dest.join(e.file_name()))?;
            }
        }
        Ok(())
    }
    before(layer, dest).map_err(|e| format!("cannot apply {}: {e}", layer.display()))?;
    let cp = crate::tools::locate("cp", None, "PATH").map_err(|e| e.to_string())?;
    let out = std::process::Command::new(cp)
        .args(["-a", "--no-target-directory"])
        .arg(layer)
        .arg(dest)
        .output()
        .map_err(|e| format!("cannot run cp: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "copying {} failed: {}",
            layer.display(),
            String::from_utf8_lossy(&out.stderr).lines().next().unwrap_or("").trim()
        ));
    }
    after(layer, dest).map_err(|e| format!("cannot apply {}: {e}", layer.display()))
}

// ---------------------------------------------------------------------------------------------
// statepoints

/// Finds a snapshot by its name after `@`, anywhere in the pool of `dataset`.
pub fn find_snapshot(zfs: &Zfs, dataset: &str, name: &str) -> Result<Option<String>, String> {
    let suffix = format!("@{name}");
    Ok(zfs.snapshots(zfs::pool_of(dataset)).map_err(ze)?.into_iter().find(|s| s.ends_with(&suffix)))
}

/// Checks, before anything changes, that a statepoint's snapshot is still there.
pub fn check_available(cfg: &Config, store: &ContainerStore, local: &crate::store::LocalState) -> Result<(), String> {
    let (Some(snap), Some(map)) = (&local.zfs_snapshot, mapping(store)) else { return Ok(()) };
    let zfs = zfs_from(cfg)?;
    let name = snap.rsplit('@').next().unwrap_or(snap);
    match find_snapshot(&zfs, &map.dataset, name)? {
        Some(_) => Ok(()),
        None => Err(format!("the statepoint's snapshot {name} is missing from pool {}", zfs::pool_of(&map.dataset))),
    }
}

/// Flushes what the kernel holds for the file system mounted at `mp` (FUSE keeps written pages).
fn syncfs(mp: &Path) -> Result<(), String> {
    use std::os::fd::AsRawFd;
    let d = std::fs::File::open(mp).map_err(|e| format!("cannot open {}: {e}", mp.display()))?;
    // SAFETY: a valid open fd.
    if unsafe { nix::libc::syncfs(d.as_raw_fd()) } != 0 {
        return Err(format!("cannot sync {}: {}", mp.display(), std::io::Error::last_os_error()));
    }
    Ok(())
}

pub struct ZfsRootfs {
    pub zfs: Zfs,
    pub map: Mapping,
    pub container_id: String,
}

impl ZfsRootfs {
    pub fn for_container(cfg: &Config, store: &ContainerStore, id: &str) -> Result<Option<ZfsRootfs>, String> {
        let Some(map) = mapping(store) else { return Ok(None) };
        Ok(Some(ZfsRootfs { zfs: zfs_from(cfg)?, map, container_id: id.to_string() }))
    }

    /// The snapshot statepoint `sp` will have.
    pub fn snapshot_of(&self, sp: &str) -> String {
        format!("{}@{}", self.map.dataset, snapshot_name(&self.container_id, sp))
    }

    /// Makes the container's dataset what statepoint snapshot `recorded` holds; every other
    /// snapshot stays. The container must not run. The guard undoes it unless committed.
    pub fn restore_snapshot(&self, recorded: &str) -> Result<crate::rootfs::RestoreGuard, String> {
        let zfs = &self.zfs;
        let d = self.map.dataset.clone();
        let name = recorded.rsplit('@').next().unwrap_or(recorded);
        let snap = find_snapshot(zfs, &d, name)?.ok_or_else(|| format!("the statepoint's snapshot {name} is missing from pool {}", zfs::pool_of(&d)))?;
        let origin_ds = zfs::dataset_of(&snap).to_string();
        let new = format!("{d}.planarian-new");
        if zfs.exists(&new).map_err(ze)? {
            zfs.destroy(&new, true).map_err(ze)?;
        }
        let mp = zfs.get(&d, "mountpoint").map_err(ze)?;
        zfs.clone_snapshot(&snap, &new, &[("mountpoint", "none")]).map_err(ze)?;
        let drop_new = || {
            let _ = zfs.destroy(&new, true);
        };
        if let Err(e) = zfs.promote(&new) {
            drop_new();
            return Err(ze(e));
        }
        let unpromote = || {
            let _ = zfs.promote(&origin_ds);
            drop_new();
        };
        if let Err(e) = zfs.unmount(&d) {
            unpromote();
            return Err(match e.kind() {
                Kind::Busy => format!("the container's files are in use ({} is busy: a process has a file or directory open there); nothing was changed", mp.value),
                _ => ze(e),
            });
        }
        let old = (1..).map(|n| format!("{d}.planarian-old-{n}")).find(|o| !zfs.exists(o).unwrap_or(true)).unwrap();
        let swap = || -> Result<(), zfs::Error> {
            zfs.set(&d, "mountpoint", "none")?;
            zfs.rename(&d, &old)?;
            zfs.rename(&new, &d)?;
            zfs.restore_property(&d, "mountpoint", &mp)?;
            if zfs.get(&d, "mounted")?.value != "yes" {
                zfs.mount(&d)?;
            }
            Ok(())
        };
        // Puts the previous dataset back under its name and mount point (any step may be done).
        let undo = {
            let (zfs, d, old, new, mp, origin_ds) = (zfs.clone(), d.clone(), old.clone(), new.clone(), mp.clone(), origin_ds.clone());
            move || -> Result<(), String> {
                if zfs.exists(&old).map_err(ze)? {
                    if zfs.exists(&d).map_err(ze)? {
                        let _ = zfs.unmount(&d);
                        zfs.set(&d, "mountpoint", "none").map_err(ze)?;
                        zfs.rename(&d, &new).map_err(ze)?;
                    }
                    zfs.rename(&old, &d).map_err(ze)?;
                }
                zfs.restore_property(&d, "mountpoint", &mp).map_err(ze)?;
                if zfs.get(&d, "mounted").map_err(ze)?.value != "yes" {
                    zfs.mount(&d).map_err(ze)?;
                }
                zfs.promote(&origin_ds).map_err(ze)?;
                zfs.destroy(&new, true).map_err(ze)
            }
        };
        if let Err(e) = swap() {
            return Err(match undo() {
                Ok(()) => ze(e),
                Err(u) => format!("{e}; and putting the previous dataset back failed: {u}"),
            });
        }
        let commit = {
            let (zfs, d) = (zfs.clone(), d.clone());
            move || collect(&zfs, &d)
        };
        Ok(crate::rootfs::RestoreGuard::new(Box::new(undo), Box::new(commit)))
    }
}

impl crate::rootfs::Rootfs for ZfsRootfs {
    fn backend(&self) -> &'static str {
        "zfs"
    }

    fn plan(&self, sp: &str, local: &mut crate::store::LocalState) {
        local.rootfs_backend = self.backend().into();
        local.zfs_snapshot = Some(self.snapshot_of(sp));
        local.rootfs_copy_path = None;
        local.rootfs_upperdir = None;
    }

    fn snapshot(&self, _sp_dir: &Path, local: &crate::store::LocalState) -> Result<(), String> {
        let snap = local.zfs_snapshot.as_deref().ok_or("no snapshot planned")?;
        // Where it is mounted, from this host's mount table when that is unambiguous (`zfs get`
        // twice otherwise: a fixed cost of every snapshot).
        let mounted = std::fs::read_to_string("/proc/self/mountinfo").map(|t| zfs::mounts_of(&t, &self.map.dataset)).unwrap_or_default();
        let mp = match &mounted[..] {
            [one] => one.clone(),
            _ => mountpoint(&self.zfs, &self.map.dataset)?,
        };
        syncfs(&mp)?;
        self.zfs.snapshot(snap).map_err(|e| match e.kind() {
            Kind::NoSpace => format!("the ZFS pool {} is full: cannot snapshot the container's files ({e})", zfs::pool_of(snap)),
            _ => ze(e),
        })
    }

    fn discard(&self, _sp_dir: &Path, local: &crate::store::LocalState) {
        if let Some(snap) = &local.zfs_snapshot {
            let _ = self.zfs.destroy_snapshot(snap);
        }
    }

    fn restore(&self, _sp_dir: &Path, local: &crate::store::LocalState) -> Result<crate::rootfs::RestoreGuard, String> {
        let snap = local.zfs_snapshot.as_deref().ok_or("the statepoint has no ZFS snapshot (it was taken on the copy-based path)")?;
        self.restore_snapshot(snap)
    }
}

/// Destroys the container's retired datasets that hold no snapshot any more.
fn collect(zfs: &Zfs, d: &str) {
    let prefix = format!("{d}.planarian-old-");
    let Ok(snaps) = zfs.snapshots(zfs::pool_of(d)) else { return };
    let Ok(fss) = zfs.filesystems(zfs::pool_of(d)) else { return };
    for (fs, _) in fss.iter().filter(|(n, _)| n.starts_with(&prefix)) {
        let at = format!("{fs}@");
        if !snaps.iter().any(|s| s.starts_with(&at)) {
            let _ = zfs.destroy(fs, false);
        }
    }
}

/// Removes a statepoint's snapshot (deferred while a clone depends on it), then whatever
/// retired dataset that leaves empty. Missing snapshots are fine.
pub fn destroy_snapshot(store: &ContainerStore, recorded: &str) -> Result<(), String> {
    let cfg = Config::load().map_err(|e| e.to_string())?;
    let zfs = zfs_from(&cfg)?;
    let name = recorded.rsplit('@').next().unwrap_or(recorded);
    if let Some(snap) = find_snapshot(&zfs, recorded, name)? {
        zfs.destroy_snapshot(&snap).map_err(ze)?;
    }
    if let Some(map) = mapping(store) {
        collect(&zfs, &map.dataset);
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// fork

/// The dataset of a fork of `src`: under the configured parent, else beside the source's.
pub fn fork_dataset(cfg: &Config, src: &Mapping, new_id: &str) -> String {
    match &cfg.zfs.parent_dataset {
        Some(p) => format!("{p}/ctr-{new_id}"),
        None => format!("{}-fork-{}", src.dataset, short(new_id)),
    }
}

/// Gives a new container (no statepoints yet) a clone of `recorded` as its dataset.
pub fn fork_into(cfg: &Config, src: &Mapping, recorded: &str, new_store: &ContainerStore, new_id: &str, new_bundle: &Path) -> Result<(), String> {
    let zfs = zfs_from(cfg)?;
    let name = recorded.rsplit('@').next().unwrap_or(recorded);
    let snap = find_snapshot(&zfs, &src.dataset, name)?.ok_or_else(|| format!("the statepoint's snapshot {name} is missing"))?;
    let ds = fork_dataset(cfg, src, new_id);
    zfs.clone_snapshot(&snap, &ds, &[]).map_err(ze)?;
    let bundle = std::fs::canonicalize(new_bundle).unwrap_or(new_bundle.to_path_buf());
    save_mapping(new_store, &Mapping { dataset: ds.clone(), owned: true, bundle, image_base: None }).inspect_err(|_| {
        let _ = zfs.destroy(&ds, true);
    })
}

// ---------------------------------------------------------------------------------------------
// removal of a container

/// Removes everything planarian made in ZFS for a container: its datasets (after promoting the
/// forks that depend on them), its snapshots; its statepoints are discarded. The mapping goes.
pub fn remove_container(cfg: &Config, store: &ContainerStore) -> Result<(), String> {
    let Some(map) = mapping(store) else { return Ok(()) };
    let zfs = zfs_from(cfg)?;
    let d = &map.dataset;
    let pool = zfs::pool_of(d);
    let id = store.dir.file_name().unwrap_or_default().to_string_lossy().into_owned();
    let ours = format!("@planarian-{}-", short(&id));
    let old_prefix = format!("{d}.planarian-old-");
    let in_family = |fs: &str| fs == d || fs.starts_with(&old_prefix) || fs == format!("{d}.planarian-new");
    if map.owned {
        // Forks (or anything) cloned from the family's snapshots take them over first.
        for _ in 0..64 {
            let fss = zfs.filesystems(pool).map_err(ze)?;
            let dependant = fss.iter().find(|(fs, origin)| {
                !in_family(fs) && origin.as_deref().is_some_and(|o| in_family(zfs::dataset_of(o)))
            });
            match dependant {
                Some((fs, _)) => zfs.promote(fs).map_err(ze)?,
                None => break,
            }
        }
        let mut family: Vec<String> = zfs.filesystems(pool).map_err(ze)?.into_iter().map(|(n, _)| n).filter(|n| in_family(n)).collect();
        // Retired datasets are clones of the live one's snapshots: they go first.
        family.sort_by_key(|n| n == d);
        for fs in family {
            zfs.destroy(&fs, true).map_err(ze)?;
        }
    } else {
        for (fs, _) in zfs.filesystems(pool).map_err(ze)?.iter().filter(|(n, _)| n.starts_with(&old_prefix)) {
            let _ = zfs.destroy(fs, true);
        }
    }
    // Its snapshots that a promote moved elsewhere, or on the user's own dataset.
    for s in zfs.snapshots(pool).map_err(ze)?.iter().filter(|s| s.contains(&ours)) {
        let _ = zfs.destroy_snapshot(s);
    }
    for mut m in store.manifests() {
        if m.local_state.zfs_snapshot.is_some() && m.status != crate::store::Status::Discarded {
            m.status = crate::store::Status::Discarded;
            let _ = store.write_manifest(&m);
        }
    }
    std::fs::remove_file(store.dir.join(MAPPING)).map_err(|e| format!("cannot remove the mapping: {e}"))
}

/// `planarian gc [--wait ID]`: removes the datasets of containers Podman has removed. With
/// `--wait`, waits (up to 30 s) for that container's bundle to go first — `delete` starts it,
/// and only a `podman rm` removes the bundle.
pub fn gc_main(args: &[std::ffi::OsString]) -> Result<i32, String> {
    let cfg = Config::load().map_err(|e| e.to_string())?;
    let args: Vec<&str> = args.iter().filter_map(|a| a.to_str()).collect();
    let stores: Vec<ContainerStore> = match args[..] {
        ["--wait", id] => {
            let store = ContainerStore::new(&cfg.store.path, id);
            let Some(map) = mapping(&store) else { return Ok(0) };
            let t = std::time::Instant::now();
            while map.bundle.exists() && t.elapsed() < std::time::Duration::from_secs(30) {
                std::thread::sleep(std::time::Duration::from_millis(200));
            }
            vec![store]
        }
        [] => std::fs::read_dir(cfg.store.path.join("containers"))
            .map(|rd| rd.filter_map(Result::ok).map(|e| ContainerStore::new(&cfg.store.path, &e.file_name().to_string_lossy())).collect())
            .unwrap_or_default(),
        _ => return Err("usage: planarian gc [--wait CONTAINER-ID]".into()),
    };
    let wait = matches!(args[..], ["--wait", _]);
    let mut failed = None;
    for store in stores {
        let Some(map) = mapping(&store) else { continue };
        if map.bundle.exists() {
            continue;
        }
        // Right after a removal the file system may still be busy (the container's mount
        // namespace going away): retry for a while, and leave the last error in the store.
        let t = std::time::Instant::now();
        let r = loop {
            let r = store.lock(true).and_then(|_lock| remove_container(&cfg, &store));
            if r.is_ok() || !wait || t.elapsed() > std::time::Duration::from_secs(30) {
                break r;
            }
            std::thread::sleep(std::time::Duration::from_secs(1));
        };
        if let Err(e) = r {
            let _ = std::fs::write(store.dir.join("gc-error"), format!("{e}\n"));
            failed = Some(format!("cannot remove the datasets of removed container {}: {e}", store.dir.display()));
        }
    }
    match failed {
        Some(e) => Err(e),
        None => Ok(0),
    }
}

/// Starts `planarian gc --wait ID` in the background when a mapped container is deleted.
pub fn on_delete(cfg: &Config, args: &[std::ffi::OsString]) {
    let Some(id) = args.iter().rev().find(|a| !a.to_string_lossy().starts_with('-')) else { return };
    let store = ContainerStore::new(&cfg.store.path, &id.to_string_lossy());
    if !store.dir.join(MAPPING).exists() {
        return;
    }
    let Ok(exe) = std::env::current_exe() else { return };
    let mut cmd = std::process::Command::new(exe);
    cmd.arg("gc").arg("--wait").arg(id).stdin(std::process::Stdio::null()).stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null());
    crate::tools::detach(&mut cmd);
    let _ = cmd.spawn();
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::OsString;

    #[test]
    fn create_arguments_as_podman_sends_them() {
        let a: Vec<OsString> = ["--bundle", "/b/userdata", "--pid-file", "/r/pidfile", "--console-socket", "/tmp/s", "abc123"].iter().map(OsString::from).collect();
        assert_eq!(create_args(&a), (PathBuf::from("/b/userdata"), Some("abc123".into())));
        let a: Vec<OsString> = ["--bundle=/x", "--no-pivot", "id2"].iter().map(OsString::from).collect();
        assert_eq!(create_args(&a), (PathBuf::from("/x"), Some("id2".into())));
    }

    #[test]
    fn overlay_layers_resolve_relative_lower_paths() {
        let mi = "60 29 0:45 / /s/overlay/abc/merged rw - overlay overlay rw,lowerdir=l/AAA:l/BBB,upperdir=/s/overlay/abc/diff,workdir=/s/overlay/abc/work\n";
        let l = overlay_layers(mi, Path::new("/s/overlay/abc/merged")).unwrap();
        assert_eq!(l.upper, Path::new("/s/overlay/abc/diff"));
        assert_eq!(l.lower, vec![PathBuf::from("/s/overlay/l/AAA"), PathBuf::from("/s/overlay/l/BBB")]);
        assert!(overlay_layers(mi, Path::new("/other")).is_none());
        assert_eq!(image_key(&l.lower), image_key(&l.lower.clone()));
        assert_ne!(image_key(&l.lower), image_key(&l.lower[..1]));
    }

    #[test]
    fn layers_apply_with_whiteouts_and_opaque_directories() {
        let base = std::env::temp_dir().join(format!("planarian-layer-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        let (lower, dest) = (base.join("lower"), base.join("dest"));
        std::fs::create_dir_all(lower.join("etc/old")).unwrap();
        std::fs::write(lower.join("etc/passwd"), "root").unwrap();
        std::fs::write(lower.join("etc/old/x"), "x").unwrap();
        std::fs::write(lower.join("gone"), "g").unwrap();
        std::fs::create_dir_all(&dest).unwrap();
        apply_layer(&lower, &dest).unwrap();
        assert_eq!(std::fs::read_to_string(dest.join("etc/passwd")).unwrap(), "root");

        // An upper layer: a modified file, a new one, and (when we may make device nodes) a
        // whiteout deleting a file of the lower layer.
        let upper = base.join("upper");
        std::fs::create_dir_all(upper.join("etc")).unwrap();
        std::fs::write(upper.join("etc/passwd"), "root\nagent").unwrap();
        std::fs::write(upper.join("new"), "n").unwrap();
        let whiteout = nix::sys::stat::mknod(&upper.join("gone"), nix::sys::stat::SFlag::S_IFCHR, nix::sys::stat::Mode::from_bits_truncate(0o600), 0).is_ok();
        apply_layer(&upper, &dest).unwrap();
        assert_eq!(std::fs::read_to_string(dest.join("etc/passwd")).unwrap(), "root\nagent");
        assert_eq!(std::fs::read_to_string(dest.join("new")).unwrap(), "n");
        assert!(dest.join("etc/old/x").exists());
        if whiteout {
            assert!(std::fs::symlink_metadata(dest.join("gone")).is_err(), "the whiteout deleted the file and left no device");
        }
        std::fs::remove_dir_all(&base).unwrap();
    }

    #[test]
    fn snapshot_names_are_per_container() {
        assert_eq!(snapshot_name("0123456789abcdef0123", "sp3"), "planarian-0123456789ab-sp3");
    }
}
