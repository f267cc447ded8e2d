//! Statepoints that leave this machine's store.
//!
//! Podman's `checkpoint --export` and CRI-O archive the checkpoint directory the runtime wrote
//! (`--image-path`), and CRI-O then deletes it: a pointer into planarian's store would be lost.
//! When the caller will take the directory away ([`leaves`]), the checkpoint *hands the
//! statepoint out*: the whole incremental chain of CRIU images laid out inside the directory
//! (hard links into the store, so no data is copied where the two share a file system), and
//! planarian's part in `planarian/` — the manifest (dump options, the MCP position), the
//! descriptors and `/dev` — and, for files on ZFS, a `zfs send` stream of the statepoint's
//! snapshot. Files on the copy path travel as the caller's own `rootfs-diff.tar`, which Podman
//! and CRI-O write at export and apply before they call `restore`.
//!
//! A restore of a directory this store does not hold (another machine, a wiped store, Podman's
//! `--import --name` copy) [`import`]s it: the images become the start of a new chain of the
//! restored container, its files are received (ZFS) or copied from the layer the caller
//! prepared, and the next dump is incremental against the imported images.

use super::{podman_dir, Result};
use crate::config::Config;
use crate::local::copy::CopyRootfs;
use crate::local::files::Rootfs;
use crate::local::{self, zfs};
use crate::runtime::Bundle;
use crate::store::{read_manifest, ContainerStore, LocalState, Manifest, Status};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use sys::Context;

/// planarian's part of a handed-out directory.
pub const PART: &str = "planarian";
/// The statepoint's files on ZFS, as a `zfs send` stream, inside [`PART`].
pub const FILES_STREAM: &str = "files.zfs";
/// The statepoint's writable layer (copy path), inside [`PART`] of a `planarian statepoint
/// export` (Podman and CRI-O carry it as their own rootfs-diff.tar).
const CARRIED_ROOTFS: &str = "rootfs";

/// Whether the caller of `checkpoint` will take its directory away. Only a plain
/// `podman container checkpoint` keeps it where it is (and restores from the same store);
/// `--export`, `--create-image`, CRI-O, a Podman service and any other caller get a directory
/// that restores on its own.
pub fn leaves() -> bool {
    let ppid = nix::unistd::getppid();
    match sys::proc::Proc::of(ppid.as_raw()).cmdline() {
        Ok(args) => !plain_podman_checkpoint(&args),
        Err(_) => true,
    }
}

/// Whether the caller of `checkpoint` keeps only the top level of its directory, as regular
/// files: containerd's runc shim (containerd unpacks the directory into a checkpoint archive
/// entry by entry as plain files). The statepoint is then handed out flat
/// ([`crate::chain::flatten`]); a restore puts it back ([`HandedOut::read`]).
pub fn kept_flat() -> bool {
    let ppid = nix::unistd::getppid();
    sys::proc::Proc::of(ppid.as_raw()).read_bytes("cmdline").is_ok_and(|c| {
        let prog = c.split(|b| *b == 0).next().unwrap_or_default();
        Path::new(std::ffi::OsStr::from_bytes(prog)).file_name().is_some_and(|n| n == crate::runtime::lookup::SHIM)
    })
}

/// `podman [global flags] container checkpoint [flags] CTR…` without a flag that exports.
fn plain_podman_checkpoint(args: &[String]) -> bool {
    let Some(prog) = args.first() else { return false };
    if Path::new(prog).file_name().and_then(|n| n.to_str()) != Some("podman") {
        return false;
    }
    let Some(verb) = args.iter().position(|a| a == "checkpoint") else { return false };
    !args[verb + 1..].iter().any(|a| {
        let long = |name: &str| a == name || a.starts_with(&format!("{name}="));
        if long("--export") || long("--create-image") {
            return true;
        }
        // A group of short flags (`-e FILE`, `-Re FILE`, `-e=FILE`).
        a.strip_prefix('-').is_some_and(|s| !s.starts_with('-') && s.split('=').next().unwrap_or("").contains('e'))
    })
}

/// How the files travel, beside [`FILES_STREAM`]: the snapshot an incremental stream starts from.
const FILES_META: &str = "files.json";

/// What [`FILES_META`] holds: the stream's file name and the GUID of the snapshot it is
/// incremental on (none: a whole stream). Read by the import, on another machine perhaps.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
struct FilesMeta {
    #[serde(default)]
    stream: String,
    #[serde(default)]
    from_guid: Option<String>,
}

/// Leaves what Podman and CRI-O expect after a checkpoint whose directory leaves the machine
/// (an export, CRI-O's or containerd's checkpoint archive): the statepoint itself ([`hand_out`];
/// flat for containerd's shim, [`kept_flat`]) and [`podman_dir::mark`].
pub fn leave_for_podman(
    cfg: &Config,
    store: &ContainerStore,
    m: &Manifest,
    image_path: &Path,
    work_path: Option<&Path>,
) -> Result<()> {
    std::fs::create_dir_all(image_path).at("create", image_path)?;
    hand_out(cfg, store, m, image_path, None)?;
    if kept_flat() {
        crate::chain::flatten(image_path, PART)?;
    }
    podman_dir::mark(m, &store.statepoint_dir(&m.statepoint_id), image_path, work_path)
}

/// Lays statepoint `m` of `store` out in `image_path` so that it restores anywhere (see the
/// module text); files on ZFS as a whole stream, or one incremental from statepoint `since`'s
/// snapshot. Returns the number of chain levels handed out.
pub fn hand_out(
    cfg: &Config,
    store: &ContainerStore,
    m: &Manifest,
    image_path: &Path,
    since: Option<&Manifest>,
) -> Result<usize> {
    let sp_dir = store.statepoint_dir(&m.statepoint_id);
    for stale in ["parent", crate::chain::HANDED_OUT_CHAIN, PART] {
        let p = image_path.join(stale);
        let _ = std::fs::remove_file(&p);
        let _ = std::fs::remove_dir_all(&p);
    }
    let levels = crate::chain::hand_out(&sp_dir.join(&m.local_state.criu_checkpoint_path), image_path)?;
    let part = image_path.join(PART);
    // The manifest, the descriptors, /dev: the statepoint directory's own files.
    crate::chain::link_files(&sp_dir, &part)?;
    if let Some(snap) = &m.local_state.zfs_snapshot {
        let since = since.and_then(|s| s.local_state.zfs_snapshot.as_deref());
        let from_guid = zfs::send_statepoint(cfg, store, snap, since, &part.join(FILES_STREAM))?;
        let meta = FilesMeta { stream: FILES_STREAM.into(), from_guid };
        let text = serde_json::to_string(&meta).expect("strings encode");
        sys::write_atomic(&part.join(FILES_META), text.as_bytes(), 0o644)?;
    }
    Ok(levels)
}

/// A directory a checkpoint handed out: where it is, and its statepoint's manifest.
pub struct HandedOut {
    pub dir: PathBuf,
    pub manifest: Manifest,
}

impl HandedOut {
    /// The handed-out statepoint in `image_path`, if the directory is one.
    pub fn read(image_path: &Path) -> Result<Option<HandedOut>> {
        // Handed out flat (to containerd): laid out again first, once nothing in it leads out.
        if crate::chain::is_flat(image_path, PART) {
            let hostile = |why: String| super::Error::Hostile { dir: image_path.to_path_buf(), why };
            confined(image_path, Path::new("")).map_err(hostile)?;
            crate::chain::unflatten(image_path, PART).map_err(|e| hostile(e.to_string()))?;
        }
        let p = image_path.join(PART).join("manifest.json");
        if std::fs::symlink_metadata(image_path.join(PART)).is_err() {
            return Ok(None);
        }
        // It came from elsewhere: nothing in it may lead out of it before anything is read.
        confined(image_path, &Path::new(PART).join(CARRIED_ROOTFS))
            .map_err(|why| super::Error::Hostile { dir: image_path.to_path_buf(), why })?;
        if !p.exists() {
            return Ok(None);
        }
        let manifest = read_manifest(&p)?;
        Ok(Some(HandedOut { dir: image_path.to_path_buf(), manifest }))
    }

    /// Whether `store` holds this very statepoint, with its files: then a restore reads it from
    /// there (the same machine, the same container) and nothing is imported.
    pub fn held_by(&self, cfg: &Config, store: &ContainerStore, sp: &str) -> bool {
        let Ok(m) = read_manifest(&store.statepoint_dir(sp).join("manifest.json")) else { return false };
        if m.status != Status::Committed || m.timestamp != self.manifest.timestamp {
            return false;
        }
        match (&m.local_state.zfs_snapshot, &m.local_state.rootfs_copy_path) {
            (Some(_), _) => zfs::mapping(store).is_some() && zfs::check_available(cfg, store, &m.local_state).is_ok(),
            (None, Some(copy)) => store.statepoint_dir(sp).join(copy).is_dir(),
            (None, None) => false,
        }
    }
}

/// Whether a directory handed in (an archive unpacked by tar or Podman) holds only what a
/// statepoint planarian hands out does: directories and regular files, and `parent` links that
/// stay inside it; in `carried` (relative: the copy of the container's writable layer), anything
/// a container's files have except device nodes other than overlay whiteouts (0:0).
/// Anything else — a link out of it (to another container's images, to the host's files), a
/// device, a FIFO — is refused before anything is read through it.
pub fn confined(dir: &Path, carried: &Path) -> std::result::Result<(), String> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let mut todo = vec![PathBuf::new()];
    while let Some(rel) = todo.pop() {
        let path = dir.join(&rel);
        let md = std::fs::symlink_metadata(&path).map_err(|e| format!("{}: {e}", rel.display()))?;
        let t = md.file_type();
        let shown = if rel.as_os_str().is_empty() { ".".into() } else { rel.display().to_string() };
        if !carried.as_os_str().is_empty() && rel.starts_with(carried) {
            if (t.is_char_device() && md.rdev() != 0) || t.is_block_device() {
                return Err(format!("{shown} is a device node"));
            }
        } else if t.is_symlink() {
            let target = std::fs::read_link(&path).map_err(|e| format!("{shown}: {e}"))?;
            let inside = target.is_relative() && {
                let mut depth = rel.components().count() as i64 - 1;
                target.components().all(|c| {
                    depth += match c {
                        std::path::Component::ParentDir => -1,
                        std::path::Component::CurDir => 0,
                        _ => 1,
                    };
                    depth >= 0
                })
            };
            if rel.file_name() != Some(std::ffi::OsStr::new("parent")) || !inside {
                return Err(format!(
                    "{shown} is a link to {} (only `parent` links inside it are a statepoint's)",
                    target.display()
                ));
            }
            continue;
        } else if t.is_char_device() || t.is_block_device() {
            return Err(format!("{shown} is a device node"));
        } else if !t.is_dir() && !t.is_file() {
            return Err(format!("{shown} is neither a file nor a directory"));
        }
        if t.is_dir() {
            for e in std::fs::read_dir(&path).map_err(|e| format!("{shown}: {e}"))? {
                let e = e.map_err(|e| format!("{shown}: {e}"))?;
                todo.push(rel.join(e.file_name()));
            }
        }
    }
    Ok(())
}

/// An imported statepoint: removed with what it brought (its dataset, its chain's bases) unless
/// the restore that imported it succeeds ([`Imported::keep`]).
pub struct Imported<'a> {
    cfg: &'a Config,
    store: &'a ContainerStore,
    sp_dir: PathBuf,
    dataset: bool,
    keep: bool,
}

impl Imported<'_> {
    pub fn keep(mut self) {
        self.keep = true;
    }
}

impl Drop for Imported<'_> {
    fn drop(&mut self) {
        if self.keep {
            return;
        }
        let _ = std::fs::remove_dir_all(&self.sp_dir);
        if self.dataset {
            let _ = zfs::remove_container(self.cfg, self.store);
            let _ = std::fs::remove_file(self.store.dir.join(zfs::MAPPING));
        }
        crate::chain::collect(self.store);
    }
}

/// Makes the statepoint handed out in `from` a statepoint of container `id` (store `store`,
/// lock held), whose bundle Podman or CRI-O prepared: the start of a new chain. Files on the
/// copy path are what the caller applied to the container's writable layer (`upper`, or the
/// overlay mounted at its rootfs), or, from `planarian statepoint export`, carried in the
/// directory and put in place. The files are taken before the images, so that a refusal (ZFS
/// needed here) copies nothing.
pub fn import<'a>(
    cfg: &'a Config,
    store: &'a ContainerStore,
    from: &HandedOut,
    id: &str,
    bundle: &Bundle,
    upper: Option<&Path>,
) -> Result<(Manifest, Imported<'a>)> {
    let sp = store.next_id();
    let sp_dir = store.statepoint_dir(&sp);
    std::fs::create_dir_all(&sp_dir).at("create", &sp_dir)?;
    let mut guard = Imported { cfg, store, sp_dir: sp_dir.clone(), dataset: false, keep: false };
    let part = from.dir.join(PART);
    let local = match part.join(FILES_STREAM) {
        stream if stream.exists() => import_zfs_files(&mut guard, id, &part, &stream, bundle, &sp)?,
        _ => import_copied_files(id, &part, bundle, upper, &sp, &sp_dir)?,
    };
    let prev = crate::chain::link_chain(&from.dir, store, &sp_dir.join("criu"))?;
    for e in std::fs::read_dir(&part).at("read", &part)?.filter_map(|e| e.ok()) {
        let name = e.file_name();
        if e.file_type().is_ok_and(|t| t.is_file())
            && name != "manifest.json"
            && name != FILES_STREAM
            && name != FILES_META
        {
            std::fs::copy(e.path(), sp_dir.join(&name)).at("copy", e.path())?;
        }
    }
    let src = &from.manifest;
    let mut m = src.clone();
    m.statepoint_id = sp;
    m.container_id = id.to_string();
    m.branch_id = id.to_string();
    m.parent_statepoint_id = None;
    m.local_state = local;
    m.chain.prev_images_dir = prev;
    m.internal = false;
    m.status = Status::Committed;
    m.imported_from = Some(format!("{}/{}", super::short(&src.container_id), src.statepoint_id));
    store.write_manifest(&m)?;
    crate::fault::point("restore.imported")?;
    Ok((m, guard))
}

/// [`import`]'s files from a ZFS stream: received as the container's dataset (which `guard`
/// destroys unless the import is kept).
fn import_zfs_files(
    guard: &mut Imported,
    id: &str,
    part: &Path,
    stream: &Path,
    bundle: &Bundle,
    sp: &str,
) -> Result<LocalState> {
    let (cfg, store) = (guard.cfg, guard.store);
    let parent = cfg.zfs.parent_dataset.clone().ok_or(local::Error::NeedsZfs)?;
    let meta: FilesMeta =
        std::fs::read(part.join(FILES_META)).ok().and_then(|d| serde_json::from_slice(&d).ok()).unwrap_or_default();
    guard.dataset = true;
    let snap = zfs::receive_statepoint(
        cfg,
        store,
        id,
        &parent,
        zfs::Incoming { stream, from_guid: meta.from_guid.as_deref() },
        &zfs::snapshot_name(id, sp),
        &bundle.dir,
    )?;
    Ok(LocalState {
        criu_checkpoint_path: "criu".into(),
        rootfs_backend: "zfs".into(),
        zfs_snapshot: Some(snap),
        ..Default::default()
    })
}

/// [`import`]'s files on the copy path: carried in the directory and put in place, or what the
/// caller applied to the container's writable layer (`upper`, or the overlay at its rootfs).
fn import_copied_files(
    id: &str,
    part: &Path,
    bundle: &Bundle,
    upper: Option<&Path>,
    sp: &str,
    sp_dir: &Path,
) -> Result<LocalState> {
    let mut local = LocalState { criu_checkpoint_path: "criu".into(), ..Default::default() };
    let upper = match upper {
        Some(u) => u.to_path_buf(),
        None => {
            let mounts = sys::proc::Proc::own().mounts()?;
            zfs::layers::overlay_layers(&mounts, &bundle.spec.root)
                .ok_or_else(|| local::Error::NoFilesBackend(id.to_string()))?
                .upper
        }
    };
    let copy = CopyRootfs::new(upper, None);
    copy.plan(sp, &mut local);
    let carried = part.join(CARRIED_ROOTFS);
    if carried.is_dir() {
        let into = sp_dir.join(local.rootfs_copy_path.as_deref().unwrap_or("rootfs"));
        crate::local::copy::cp(&["--reflink=auto"], &carried, &into)?;
        copy.restore(sp_dir, &local)?.commit();
    } else {
        // The caller applied the statepoint's rootfs-diff.tar to the layer it prepared.
        copy.snapshot(sp_dir, &local)?;
    }
    Ok(local)
}

// ---------------------------------------------------------------------------------------------
// `planarian statepoint export` / `import`: a statepoint in one file, between machines

/// What `podman create` needs to make the container again, read from `podman container
/// inspect` of the source (its `io.planarian.*` annotations only: Podman adds its own).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "kebab-case")]
pub struct Recipe {
    pub name: String,
    pub image: String,
    pub command: Vec<String>,
    pub entrypoint: Vec<String>,
    pub env: Vec<String>,
    pub workdir: String,
    pub user: String,
    pub network: String,
    pub tty: bool,
    pub annotations: BTreeMap<String, String>,
}

impl Recipe {
    /// From one element of `podman container inspect`.
    pub fn of(c: &serde_json::Value) -> Recipe {
        let strings = |v: &serde_json::Value| -> Vec<String> {
            match v {
                serde_json::Value::Array(a) => a.iter().filter_map(|s| s.as_str().map(String::from)).collect(),
                // Podman 4 reports the entrypoint as one string.
                serde_json::Value::String(s) if !s.is_empty() => vec![s.clone()],
                _ => vec![],
            }
        };
        let text = |v: &serde_json::Value| v.as_str().unwrap_or_default().to_string();
        let cfg = &c["Config"];
        Recipe {
            name: text(&c["Name"]),
            image: text(&c["ImageName"]),
            command: strings(&cfg["Cmd"]),
            entrypoint: strings(&cfg["Entrypoint"]),
            env: strings(&cfg["Env"]).into_iter().filter(|e| !e.starts_with("HOSTNAME=")).collect(),
            workdir: text(&cfg["WorkingDir"]),
            user: text(&cfg["User"]),
            network: text(&c["HostConfig"]["NetworkMode"]),
            tty: cfg["Tty"].as_bool().unwrap_or(false),
            annotations: cfg["Annotations"]
                .as_object()
                .map(|a| {
                    a.iter()
                        .filter(|(k, _)| k.starts_with(crate::config::ANNOTATION_PREFIX))
                        .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string())))
                        .collect()
                })
                .unwrap_or_default(),
        }
    }

    /// `podman create` arguments for container `name` (on planarian: [`podman::create`]'s
    /// runtime). The ZFS parent the source used (a dataset of its machine) is left out: an
    /// import gives the container its dataset.
    pub fn create_args(&self, name: &str) -> Vec<String> {
        let mut a: Vec<String> = vec!["--name".into(), name.into()];
        if !self.network.is_empty() && self.network != "default" {
            a.extend(["--network".into(), self.network.clone()]);
        }
        if !self.workdir.is_empty() {
            a.extend(["--workdir".into(), self.workdir.clone()]);
        }
        if !self.user.is_empty() {
            a.extend(["--user".into(), self.user.clone()]);
        }
        if self.tty {
            a.push("--tty".into());
        }
        if !self.entrypoint.is_empty() {
            a.extend(["--entrypoint".into(), serde_json::to_string(&self.entrypoint).expect("strings serialise")]);
        }
        for e in &self.env {
            a.extend(["--env".into(), e.clone()]);
        }
        for (k, v) in self.annotations.iter().filter(|(k, _)| k.as_str() != ZFS_PARENT) {
            a.extend(["--annotation".into(), format!("{k}={v}")]);
        }
        a.push(self.image.clone());
        a.extend(self.command.iter().cloned());
        a
    }
}

/// A directory removed with everything in it when dropped.
struct Staging(PathBuf);

impl Staging {
    fn new(dir: PathBuf) -> Result<Staging> {
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).at("create", &dir)?;
        Ok(Staging(dir))
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

const RECIPE: &str = "container.json";
const ZFS_PARENT: &str = "io.planarian.zfs.parent_dataset";

/// What an export wrote.
#[derive(Debug)]
pub struct Exported {
    pub bytes: u64,
    /// Levels of the memory chain the file carries.
    pub levels: usize,
    /// How the files travel: "a ZFS stream", "an incremental ZFS stream (since spN)", "a copy".
    pub files: String,
}

/// Writes statepoint `m` of `store` into `file` (a tar): its chain of memory images, planarian's
/// part, its files (a ZFS stream, incremental since statepoint `since` when given, or its copy)
/// and how to create the container again.
pub fn export(
    cfg: &Config,
    store: &ContainerStore,
    m: &Manifest,
    since: Option<&Manifest>,
    recipe: &Recipe,
    file: &Path,
) -> Result<Exported> {
    let staging = Staging::new(store.dir.join(format!("export-{}", std::process::id())))?;
    let dir = staging.0.join("checkpoint");
    let levels = hand_out(cfg, store, m, &dir, since)?;
    podman_dir::mark(m, &store.statepoint_dir(&m.statepoint_id), &dir, None)?;
    let files = match (&m.local_state.zfs_snapshot, &m.local_state.rootfs_copy_path) {
        (Some(_), _) => match since {
            Some(s) => format!("an incremental ZFS stream (since {})", s.statepoint_id),
            None => "a ZFS stream".to_string(),
        },
        (None, Some(copy)) => {
            let sp_dir = store.statepoint_dir(&m.statepoint_id);
            crate::local::copy::cp(&["--link"], &sp_dir.join(copy), &dir.join(PART).join(CARRIED_ROOTFS))?;
            "a copy".to_string()
        }
        (None, None) => "none".to_string(),
    };
    let text = serde_json::to_string_pretty(recipe).expect("a recipe serialises");
    sys::write_atomic(&staging.0.join(RECIPE), text.as_bytes(), 0o644)?;
    tar(&["-cf", &file.display().to_string(), "-C", &staging.0.display().to_string(), "."])?
        .map_err(|why| super::Error::ExportWrite { file: file.to_path_buf(), why })?;
    let bytes = std::fs::metadata(file).at("read", file)?.len();
    Ok(Exported { bytes, levels, files })
}

/// Runs tar; its first line of complaint when it fails.
fn tar(args: &[&str]) -> Result<Result<(), String>> {
    let bin = crate::tools::locate("tar", None, "PATH")?;
    let out = std::process::Command::new(&bin).args(args).output().map_err(|e| sys::IoError::new("run", &bin, e))?;
    if out.status.success() {
        return Ok(Ok(()));
    }
    Ok(Err(String::from_utf8_lossy(&out.stderr).lines().next().unwrap_or("tar failed").to_string()))
}

/// A container made from a statepoint file, running.
#[derive(Debug)]
pub struct ImportedContainer {
    pub name: String,
    pub id: String,
    pub statepoint: String,
}

/// `planarian statepoint import FILE [--name NEW] [--parent-dataset DS]`: creates the container
/// again through Podman (its recipe; a new ID), makes the file's statepoint its first (the start
/// of its chain; files received or copied), and restores it through `podman container restore`,
/// so that Podman runs it as any other. On failure nothing is left.
pub fn import_file(
    cfg: &Config,
    file: &Path,
    name: Option<&str>,
    parent_dataset: Option<&str>,
) -> Result<ImportedContainer> {
    use crate::runtime::podman;
    let staging = Staging::new(cfg.store.path.join(format!("import-{}", std::process::id())))?;
    let bad = |why: &str| super::Error::NotAStatepointFile { file: file.to_path_buf(), why: why.to_string() };
    tar(&["-xf", &file.display().to_string(), "-C", &staging.0.display().to_string()])?.map_err(|why| bad(&why))?;
    confined(&staging.0, &Path::new("checkpoint").join(PART).join(CARRIED_ROOTFS)).map_err(|why| bad(&why))?;
    let recipe: Recipe = std::fs::read(staging.0.join(RECIPE))
        .ok()
        .and_then(|d| serde_json::from_slice(&d).ok())
        .ok_or_else(|| bad("no container.json"))?;
    let from =
        HandedOut::read(&staging.0.join("checkpoint"))?.ok_or_else(|| bad("no planarian manifest in checkpoint/"))?;
    let name = name.unwrap_or(&recipe.name).to_string();
    if podman::inspect(&name).is_ok() {
        return Err(super::Error::ContainerExists(name));
    }
    let args = recipe.create_args(&name);
    // Files on ZFS go under `parent_dataset`, else the source's parent, else this host's.
    let parent = parent_dataset.or(recipe.annotations.get(ZFS_PARENT).map(String::as_str));
    let cfg_here = match parent {
        Some(p) => cfg.with_annotations_of([(ZFS_PARENT, p)], Some("zfs"))?,
        None => cfg.clone(),
    };
    podman::create("planarian", &args)?;
    let made = (|| -> Result<ImportedContainer> {
        podman::init_stopped(&name)?;
        let new = podman::inspect(&name)?;
        podman::wait_stopped(&new.id, new.upperdir.as_deref(), std::time::Duration::from_secs(60))?;
        let bundle = Bundle::load(&new.bundle)?;
        let cfg = bundle.spec.configure(&cfg_here)?;
        let store = ContainerStore::new(&cfg.store.path, &new.id);
        let m = {
            let _lock = store.lock(true)?;
            let (m, imported) = import(&cfg, &store, &from, &new.id, &bundle, new.upperdir.as_deref())?;
            store.set_head(Some(&m.statepoint_id))?;
            podman_dir::leave_for_podman(
                &m,
                &store.statepoint_dir(&m.statepoint_id),
                &new.bundle.join("checkpoint"),
                None,
            )?;
            imported.keep();
            m
        };
        crate::fault::point("import.before-restore")?;
        podman::restore(&new.id, false, false)?;
        Ok(ImportedContainer { name: name.clone(), id: new.id, statepoint: m.statepoint_id })
    })();
    made.map_err(|e| {
        if let Ok(c) = podman::inspect(&name) {
            let _ = podman::remove(&name);
            let store = ContainerStore::new(&cfg.store.path, &c.id);
            let _ = zfs::remove_container(cfg, &store);
            let _ = std::fs::remove_dir_all(store.dir);
        }
        super::Error::ImportFailed(Box::new(e))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split(' ').map(String::from).collect()
    }

    #[test]
    fn a_recipe_creates_the_container_again_without_the_source_machines_dataset() {
        let inspect = serde_json::json!({
            "Name": "agent", "ImageName": "localhost/img:1",
            "Config": { "Cmd": ["python3", "-c", "print(1)"], "Entrypoint": "", "Env": ["PATH=/bin", "HOSTNAME=abc"],
                        "WorkingDir": "/work", "User": "", "Tty": false,
                        "Annotations": { "io.planarian.zfs.parent_dataset": "tank/sb", "io.planarian.store.retention": "3", "io.container.manager": "libpod" } },
            "HostConfig": { "NetworkMode": "none" }
        });
        let r = Recipe::of(&inspect);
        assert_eq!(r.env, ["PATH=/bin"]);
        assert_eq!(
            r.create_args("agent-2").join(" "),
            "--name agent-2 --network none --workdir /work --env PATH=/bin \
             --annotation io.planarian.store.retention=3 localhost/img:1 python3 -c print(1)"
                .split_whitespace()
                .collect::<Vec<_>>()
                .join(" ")
        );
    }

    #[test]
    fn only_a_plain_podman_checkpoint_keeps_its_directory() {
        assert!(plain_podman_checkpoint(&args("podman container checkpoint -l")));
        assert!(plain_podman_checkpoint(&args(
            "/usr/bin/podman --runtime planarian container checkpoint --keep --leave-running c1"
        )));
        assert!(plain_podman_checkpoint(&args("podman container checkpoint -R -k c1")));
        for leaving in [
            "podman container checkpoint --export=/tmp/a.tar.gz c1",
            "podman container checkpoint --export /tmp/a.tar.gz c1",
            "podman container checkpoint -e /tmp/a.tar.gz c1",
            "podman container checkpoint -Re /tmp/a.tar.gz c1",
            "podman container checkpoint --create-image img c1",
            "podman system service --time 0",
            "crio --log-level debug",
            "bash ./replay checkpoint",
        ] {
            assert!(!plain_podman_checkpoint(&args(leaving)), "{leaving}");
        }
    }

    /// A handed-out directory as planarian lays it out passes; each way out of it is refused,
    /// and a whiteout in the carried files is the container's own.
    #[test]
    fn only_what_planarian_hands_out_is_read() {
        use std::os::unix::fs::symlink;
        let scratch = tempfile::tempdir().unwrap();
        let d = scratch.path().join("confined");
        let chain = d.join(crate::chain::HANDED_OUT_CHAIN);
        std::fs::create_dir_all(chain.join("1")).unwrap();
        std::fs::create_dir_all(d.join(PART).join(CARRIED_ROOTFS).join("etc")).unwrap();
        for f in ["inventory.img", "pages-1.img", "planarian-chain/1/inventory.img", "planarian/manifest.json"] {
            std::fs::write(d.join(f), b"x").unwrap();
        }
        symlink("planarian-chain/1", d.join("parent")).unwrap();
        symlink("/etc/passwd", d.join(PART).join(CARRIED_ROOTFS).join("etc/link")).unwrap();
        let carried = Path::new(PART).join(CARRIED_ROOTFS);
        let whiteout = d.join(PART).join(CARRIED_ROOTFS).join("gone");
        let made = nix::sys::stat::mknod(&whiteout, nix::sys::stat::SFlag::S_IFCHR, nix::sys::stat::Mode::empty(), 0);
        assert_eq!(confined(&d, &carried), Ok(()));

        let refused = |what: &Path, why: &str| {
            let got = confined(&d, &carried).unwrap_err();
            assert!(got.contains(why), "{}: {got}", what.display());
            let _ = std::fs::remove_file(what);
            assert_eq!(confined(&d, &carried), Ok(()), "{}", what.display());
        };
        // A chain leading into another container's statepoints, or to the host's files.
        let p = chain.join("1/parent");
        symlink("../../../../other/statepoints/sp1/criu", &p).unwrap();
        refused(&p, "is a link to ../../../../other");
        symlink("/var/lib/planarian/containers/x/statepoints/sp1/criu", &p).unwrap();
        refused(&p, "is a link to /var/lib");
        let p = d.join("pages-2.img");
        symlink("/etc/shadow", &p).unwrap();
        refused(&p, "pages-2.img is a link");
        let p = d.join(PART).join("manifest2.json");
        symlink("../inventory.img", &p).unwrap();
        refused(&p, "only `parent` links");
        if made.is_ok() {
            // (root only) A device, in the images or among the container's files.
            let dev = nix::sys::stat::makedev(1, 1);
            for p in [d.join("mem.img"), d.join(PART).join(CARRIED_ROOTFS).join("etc/mem")] {
                nix::sys::stat::mknod(&p, nix::sys::stat::SFlag::S_IFCHR, nix::sys::stat::Mode::empty(), dev).unwrap();
                refused(&p, "device");
            }
            let p = d.join("fifo.img");
            nix::unistd::mkfifo(&p, nix::sys::stat::Mode::S_IRWXU).unwrap();
            refused(&p, "neither a file nor a directory");
        }
    }
}
