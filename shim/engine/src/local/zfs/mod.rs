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

//!
//! Jobs: [`create`] maps a new container to its dataset (and copies each image once, with
//! [`layers`]); this module keeps statepoints, rollbacks, forks and removal.

pub mod create;
pub mod layers;
pub mod places;

use super::files::{InPlaceAt, InPlaceFiles, InPlaceStart, RestoreGuard, Rootfs, TakenFiles};
use super::{Error, Result};
use crate::config::Config;
use crate::store::{ContainerStore, LocalState};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use sys::Context;
use zfs::{Kind, Zfs};

pub(crate) const MAPPING: &str = "zfs.json";

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

pub fn zfs_from(cfg: &Config) -> Result<Zfs> {
    Ok(crate::tools::locate("zfs", cfg.runtime.zfs_path.as_deref(), "[runtime] zfs_path").map(Zfs::new)?)
}

pub fn mapping(store: &ContainerStore) -> Option<Mapping> {
    let data = std::fs::read(store.dir.join(MAPPING)).ok()?;
    serde_json::from_slice(&data).ok()
}

pub(crate) fn save_mapping(store: &ContainerStore, m: &Mapping) -> Result<()> {
    let text = serde_json::to_string_pretty(m).map_err(|source| Error::Json { what: MAPPING.into(), source })?;
    Ok(sys::write_atomic(&store.dir.join(MAPPING), text.as_bytes(), 0o644)?)
}

pub(crate) fn short(id: &str) -> &str {
    &id[..id.len().min(12)]
}

/// The snapshot name (after `@`) of statepoint `sp` of container `id`.
pub fn snapshot_name(id: &str, sp: &str) -> String {
    format!("planarian-{}-{sp}", short(id))
}

/// Where a dataset is mounted (mounted first when it is not).
pub(crate) fn mountpoint(zfs: &Zfs, ds: &str) -> Result<PathBuf> {
    // Where it is mounted, from this host's mount table when that is unambiguous (`zfs get`
    // twice otherwise: a fixed cost of every snapshot, restore and create, ~100 ms each under
    // emulation).
    if let [one] = &sys::proc::Proc::own().mounts().map(|ms| zfs::mounts_of(&ms, ds)).unwrap_or_default()[..] {
        return Ok(one.clone());
    }
    let mp = zfs.get(ds, "mountpoint")?.value;
    if !mp.starts_with('/') {
        return Err(Error::NoMountPoint { dataset: ds.to_string(), mountpoint: mp });
    }
    if zfs.get(ds, "mounted")?.value != "yes" {
        zfs.mount(ds)?;
    }
    Ok(PathBuf::from(mp))
}

// ---------------------------------------------------------------------------------------------
// statepoints

/// Finds a snapshot by its name after `@`, anywhere in the pool of `dataset`.
pub fn find_snapshot(zfs: &Zfs, dataset: &str, name: &str) -> Result<Option<String>> {
    Ok(named(&zfs.snapshots(zfs::pool_of(dataset))?, name).cloned())
}

/// The snapshot named `name` after `@` among `snaps`.
fn named<'a>(snaps: &'a [String], name: &str) -> Option<&'a String> {
    let suffix = format!("@{name}");
    snaps.iter().find(|s| s.ends_with(&suffix))
}

fn missing(name: &str, dataset: &str) -> Error {
    Error::SnapshotMissing { name: name.to_string(), pool: zfs::pool_of(dataset).to_string() }
}

/// Checks, before anything changes, that a statepoint's snapshot is still there.
pub fn check_available(cfg: &Config, store: &ContainerStore, local: &LocalState) -> Result<()> {
    locate(cfg, store, local).map(drop)
}

/// Where statepoint `local`'s snapshot is now (with the container's dataset and `zfs`), or
/// `None` when the statepoint or the container keeps no files on ZFS; an error when it is gone.
fn locate(cfg: &Config, store: &ContainerStore, local: &LocalState) -> Result<Option<(Zfs, Mapping, String)>> {
    let (Some(snap), Some(map)) = (&local.zfs_snapshot, mapping(store)) else { return Ok(None) };
    let zfs = zfs_from(cfg)?;
    let found = recorded_snapshot(&zfs, &map.dataset, snap)?;
    Ok(Some((zfs, map, found)))
}

/// Statepoint snapshot `recorded` (its full name when it was taken): there, when libzfs_core
/// says so (no process, and no listing of every snapshot of the pool); otherwise (a restore since
/// may have moved it, or no libzfs_core) looked for by its name in the pool of `dataset`.
fn recorded_snapshot(zfs: &Zfs, dataset: &str, recorded: &str) -> Result<String> {
    if zfs::lzc::Core::get().is_some_and(|core| core.exists(recorded)) {
        return Ok(recorded.to_string());
    }
    let name = recorded.rsplit('@').next().unwrap_or(recorded);
    find_snapshot(zfs, dataset, name)?.ok_or_else(|| missing(name, dataset))
}

/// Checks, before anything changes, that the container's files can go back to statepoint
/// `local`: its snapshot is there, and, on zfs-fuse, no other container runs on a clone of a
/// snapshot the rollback would rename. Going back swaps datasets by `zfs rename`, which on
/// zfs-fuse remounts the clones of the renamed dataset's snapshots — a fork of this container,
/// or a container imported with `--since` on top of it — and fails while one is in use,
/// half-way through. OpenZFS renames such a dataset and leaves its clones mounted where they are.
pub fn check_rollback(cfg: &Config, store: &ContainerStore, local: &LocalState) -> Result<()> {
    // (on OpenZFS only the snapshot matters: asked of libzfs_core where it was taken, no
    // process; a restore since may have moved it, and then it is looked for)
    if let (Some(snap), Some(_), Some(core)) = (&local.zfs_snapshot, mapping(store), zfs::lzc::Core::get()) {
        if core.exists(snap) {
            return Ok(());
        }
    }
    let Some((zfs, map, snap)) = locate(cfg, store, local)? else { return Ok(()) };
    if zfs.flavour() == zfs::Flavour::OpenZfs {
        return Ok(());
    }
    let home = zfs::dataset_of(&snap);
    let d = &map.dataset;
    let in_family = |fs: &str| fs == d || fs.starts_with(&format!("{d}.planarian-")) || fs == home;
    let users: Vec<String> = zfs
        .filesystems(zfs::pool_of(d))?
        .into_iter()
        .filter(|(fs, origin)| !in_family(fs) && origin.as_deref().is_some_and(|o| in_family(zfs::dataset_of(o))))
        .filter(|(fs, _)| zfs.get(fs, "mounted").is_ok_and(|p| p.value == "yes"))
        .map(|(fs, _)| fs)
        .collect();
    if users.is_empty() {
        Ok(())
    } else {
        Err(Error::ClonesInUse { dataset: d.clone(), users: users.join(", ") })
    }
}

/// Whether [`check_rollback`] for the container of `store` starts `zfs` processes: its files on
/// ZFS without libzfs_core (zfs-fuse; elsewhere it asks the library, or nothing).
pub fn check_rollback_costly(store: &ContainerStore) -> bool {
    mapping(store).is_some() && zfs::lzc::Core::get().is_none()
}

/// Flushes what the kernel holds for the file system mounted at `mp` (FUSE keeps written pages).
fn syncfs(mp: &Path) -> Result<()> {
    use std::os::fd::AsRawFd;
    let d = std::fs::File::open(mp).at("open", mp)?;
    // SAFETY: a valid open fd.
    if unsafe { nix::libc::syncfs(d.as_raw_fd()) } != 0 {
        return Err(sys::IoError::new("sync", mp, std::io::Error::last_os_error()).into());
    }
    Ok(())
}

pub struct ZfsRootfs {
    pub zfs: Zfs,
    pub map: Mapping,
    pub container_id: String,
    /// Where a rollback in place reads the statepoint's files from.
    view: View,
}

impl ZfsRootfs {
    pub fn for_container(cfg: &Config, store: &ContainerStore, id: &str) -> Result<Option<ZfsRootfs>> {
        let Some(map) = mapping(store) else { return Ok(None) };
        let view = View::of(&map.dataset, &super::files::in_place_scratch(store));
        Ok(Some(ZfsRootfs { zfs: zfs_from(cfg)?, map, container_id: id.to_string(), view }))
    }

    /// The snapshot statepoint `sp` will have.
    pub fn snapshot_of(&self, sp: &str) -> String {
        format!("{}@{}", self.map.dataset, snapshot_name(&self.container_id, sp))
    }

    /// Makes the container's dataset what statepoint snapshot `recorded` holds; every other
    /// snapshot stays. The container must not run. The guard undoes it unless committed.
    pub fn restore_snapshot(&self, recorded: &str) -> Result<RestoreGuard> {
        let zfs = &self.zfs;
        let d = self.map.dataset.clone();
        let name = recorded.rsplit('@').next().unwrap_or(recorded);
        let snaps = zfs.snapshots(zfs::pool_of(&d))?;
        let snap = named(&snaps, name).cloned().ok_or_else(|| missing(name, &d))?;
        // (what a rollback in place left, its cleanup killed or failed: a view left mounted would
        // keep the snapshot from moving, the frozen state's snapshot would keep the dataset this
        // retires for good; a clone left on zfs-fuse keeps nothing, and goes at the next rollback)
        unmount_all(self.view.at());
        if snaps.contains(&frozen_of(&d)) {
            remove_leftover(zfs, &frozen_of(&d));
        }
        let origin_ds = zfs::dataset_of(&snap).to_string();
        let new = format!("{d}.planarian-new");
        if zfs.exists(&new)? {
            zfs.destroy(&new, true)?;
        }
        let mp = zfs.get(&d, "mountpoint")?;
        zfs.clone_snapshot(&snap, &new, &[("mountpoint", "none")])?;
        if let Err(e) = zfs.promote(&new) {
            let _ = zfs.destroy(&new, true);
            return Err(e.into());
        }
        if let Err(e) = zfs.unmount(&d) {
            let _ = zfs.promote(&origin_ds);
            let _ = zfs.destroy(&new, true);
            return Err(match e.kind() {
                Kind::Busy => Error::FilesBusy(mp.value.clone()),
                _ => e.into(),
            });
        }
        let old = (1..).map(|n| format!("{d}.planarian-old-{n}")).find(|o| !zfs.exists(o).unwrap_or(true)).unwrap();
        let swap = Swap { zfs: zfs.clone(), d, old, new, mp, origin_ds };
        if let Err(e) = swap.swap() {
            return Err(match swap.undo() {
                Ok(()) => e.into(),
                Err(u) => Error::UndoFailed {
                    first: Box::new(e.into()),
                    undoing: "putting the previous dataset back",
                    then: Box::new(u),
                },
            });
        }
        let commit = {
            let (zfs, d) = (zfs.clone(), swap.d.clone());
            move || collect(&zfs, &d)
        };
        Ok(RestoreGuard::new(Box::new(move || swap.undo()), Box::new(commit)))
    }
}

/// A restore's exchange of datasets: the promoted clone `new` takes the container's dataset's
/// name `d` and mount point `mp`; the previous one becomes `old`; `origin_ds` held the snapshot.
struct Swap {
    zfs: Zfs,
    d: String,
    old: String,
    new: String,
    mp: zfs::Property,
    origin_ds: String,
}

impl Swap {
    fn swap(&self) -> Result<(), zfs::Error> {
        let (zfs, d) = (&self.zfs, &self.d);
        zfs.set(d, "mountpoint", "none")?;
        zfs.rename(d, &self.old)?;
        zfs.rename(&self.new, d)?;
        self.mounted_where_it_was()
    }

    /// The dataset under the name `d` gets the mount point it had, and is mounted there.
    fn mounted_where_it_was(&self) -> Result<(), zfs::Error> {
        let (zfs, d) = (&self.zfs, &self.d);
        zfs.restore_property(d, "mountpoint", &self.mp)?;
        if zfs.get(d, "mounted")?.value != "yes" {
            zfs.mount(d)?;
        }
        Ok(())
    }

    /// Puts the previous dataset back under its name and mount point (any step may be done).
    fn undo(&self) -> Result<()> {
        let (zfs, d) = (&self.zfs, &self.d);
        if zfs.exists(&self.old)? {
            if zfs.exists(d)? {
                let _ = zfs.unmount(d);
                zfs.set(d, "mountpoint", "none")?;
                zfs.rename(d, &self.new)?;
            }
            zfs.rename(&self.old, d)?;
        }
        self.mounted_where_it_was()?;
        zfs.promote(&self.origin_ds)?;
        Ok(zfs.destroy(&self.new, true)?)
    }
}

impl Rootfs for ZfsRootfs {
    fn backend(&self) -> &'static str {
        "zfs"
    }

    fn plan(&self, sp: &str, local: &mut LocalState) {
        local.rootfs_backend = self.backend().into();
        local.zfs_snapshot = Some(self.snapshot_of(sp));
        local.rootfs_copy_path = None;
        local.rootfs_upperdir = None;
        // (before the snapshot: whatever changed later changed after this)
        local.zfs_clock = crate::store::Clock::now();
    }

    fn snapshot(&self, _sp_dir: &Path, local: &LocalState) -> Result<()> {
        let snap = local.zfs_snapshot.as_deref().ok_or(Error::NoZfsSnapshot)?;
        syncfs(&mountpoint(&self.zfs, &self.map.dataset)?)?;
        self.zfs.snapshot(snap).map_err(|e| match e.kind() {
            Kind::NoSpace => Error::PoolFull { pool: zfs::pool_of(snap).to_string(), source: e },
            _ => e.into(),
        })
    }

    fn discard(&self, _sp_dir: &Path, local: &LocalState) {
        if let Some(snap) = &local.zfs_snapshot {
            let _ = self.zfs.destroy_snapshot(snap);
        }
    }

    fn restore(&self, _sp_dir: &Path, local: &LocalState) -> Result<RestoreGuard> {
        let snap = local.zfs_snapshot.as_deref().ok_or(Error::NoZfsSnapshot)?;
        self.restore_snapshot(snap)
    }

    /// Started as soon as the container is frozen: [`find_in_place`] and the comparison of what
    /// it found in a thread of its own, beside the page plan. The snapshot of the frozen state it
    /// compares from is the rollback's own, removed with the statepoint's view.
    fn in_place_start(
        &self,
        _sp_dir: &Path,
        local: &LocalState,
        at: &InPlaceAt,
        prepared: Option<InPlaceStart>,
    ) -> Option<InPlaceStart> {
        let recorded = local.zfs_snapshot.clone()?;
        // (the statepoint's view, when it was begun before the freeze)
        let prepared = prepared.and_then(|p| p.work.downcast::<EarlyView>().ok()).and_then(|mut v| v.thread.take());
        // Objects whose last change came before the statepoint's snapshot (two seconds and more
        // before it was decided on) did not change since: the stream carries them only as
        // neighbours of ones that did (it sends whole blocks of znodes). Trusted only while the
        // wall clock kept time since (same boot, moved as the time since boot did).
        let unchanged_before = local
            .zfs_clock
            .as_ref()
            .zip(crate::store::Clock::now())
            .filter(|(then, now)| then.kept_time_to(now, 2.0))
            .map(|(then, _)| then.wall.saturating_sub(2));
        let (zfs, d, at) = (self.zfs.clone(), self.map.dataset.clone(), at.clone());
        let taken = TakenFiles::new(frozen_of(&d));
        let (view, made) = (self.view.clone(), vec![self.view.leftover()]);
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let thread = {
            let (zfs, taken, stop) = (zfs.clone(), taken.clone(), stop.clone());
            std::thread::spawn(move || {
                let found = find_in_place(&zfs, &d, &recorded, view, &taken, unchanged_before, prepared)?;
                if stop.load(std::sync::atomic::Ordering::Relaxed) {
                    return Err(Error::InPlaceFiles("not compared: the rollback went another way".into()));
                }
                compare(&zfs, &found, &at)
            })
        };
        Some(InPlaceStart::new(Early { zfs, made, now: Some(taken), stop, thread: Some(thread) }))
    }

    /// The statepoint's [`View`], begun as soon as the rollback knows its target: it needs only
    /// the statepoint's snapshot, so it runs beside the freeze and the process tree's check
    /// instead of after them. Only on OpenZFS, where it is a mount(2): on zfs-fuse it is a `zfs
    /// clone` process, which, begun beside them, slowed them on the guest's CPUs by as much as it
    /// began earlier (docs/benchmarks.md).
    fn in_place_prepare(&self, local: &LocalState, _scratch: &Path) -> Option<InPlaceStart> {
        let recorded = local.zfs_snapshot.clone()?;
        let view = self.view.clone();
        if !matches!(view, View::Snapshot(_)) {
            return None;
        }
        let (zfs, d) = (self.zfs.clone(), self.map.dataset.clone());
        let thread = {
            let (zfs, view) = (zfs.clone(), view.clone());
            std::thread::spawn(move || {
                let t = std::time::Instant::now();
                view.make(&Snap::of(&zfs, &d, &recorded)).map(|mounted| (mounted, t.elapsed()))
            })
        };
        Some(InPlaceStart::new(EarlyView { zfs, view, thread: Some(thread) }))
    }

    /// zfs-fuse rolls a mounted dataset back only to its newest snapshot, and has neither
    /// `.zfs/snapshot` nor `zfs diff`: the statepoint's snapshot is mounted where it can be read
    /// (its [`View`]), compared with the live dataset entry by entry (inode and ctime included)
    /// and the differences written into the dataset. The view (and the snapshot an early start
    /// took) goes when this is dropped, or later ([`InPlaceFiles::hand_off`]).
    fn in_place(
        &self,
        sp_dir: &Path,
        local: &LocalState,
        at: &InPlaceAt,
        start: Option<InPlaceStart>,
    ) -> Result<InPlaceFiles> {
        let zfs = &self.zfs;
        let t = std::time::Instant::now();
        // (not begun early: begun now, with a snapshot of its own)
        let start = start.or_else(|| self.in_place_start(sp_dir, local, at, None)).ok_or(Error::NoZfsSnapshot)?;
        let mut early = start.work.downcast::<Early>().map_err(|_| Error::InPlaceFiles("not a ZFS start".into()))?;
        let compared =
            early.thread.take().expect("joined once").join().unwrap_or_else(|p| std::panic::resume_unwind(p));
        let mut made = std::mem::take(&mut early.made);
        // (the snapshot of the frozen state, when it was made)
        if let Some(now) = early.now.take().filter(TakenFiles::capturers) {
            made.push(now.name().to_string());
        }
        let cleanup = {
            let (zfs, made) = (zfs.clone(), made.clone());
            move || made.iter().for_each(|m| remove_leftover(&zfs, m))
        };
        match compared {
            Ok((sync, times)) => {
                crate::log::own_log(
                    "info",
                    &format!("in place on ZFS: {times}; waited for it {} ms", t.elapsed().as_millis()),
                );
                Ok(InPlaceFiles { sync, cleanup: Some(Box::new(cleanup)), leftovers: made })
            }
            Err(e) => {
                cleanup();
                Err(e)
            }
        }
    }
}

/// Compares the statepoint's tree (its [`View`], mounted read-only at `at.scratch`) with the live
/// one where [`find_in_place`] says they can differ: the plan, and how long each part took.
fn compare(zfs: &Zfs, found: &Found, at: &InPlaceAt) -> Result<(super::treesync::Sync, String)> {
    let live = &found.live;
    let mounted = sys::proc::Proc::own().mounts().ok().and_then(|m| zfs::dataset_mounted_at(&m, &at.scratch));
    if mounted.as_deref() != Some(found.mounted.as_str()) {
        match &found.view {
            View::Clone(name, _) => zfs.mount(name)?,
            View::Snapshot(_) => {
                let what = mounted.unwrap_or_else(|| "nothing".into());
                return Err(Error::InPlaceFiles(format!("{} is not mounted at the view ({what} is)", found.mounted)));
            }
        }
    }
    let t = std::time::Instant::now();
    // A file with other names is trusted only unchanged (then all its names are).
    let places = found
        .places
        .as_ref()
        .filter(|(_, named, _)| named.iter().all(|rel| super::treesync::unchanged(&at.scratch, live, rel)));
    let planned = if let (Some(changed), Some((places, _, by))) = (&found.changed, places) {
        let mut s = super::treesync::plan_places(&at.scratch, live, live, &at.mounted, changed, places)?;
        s.located_by = Some(by);
        s
    } else {
        super::treesync::plan_changed(&at.scratch, live, live, &[], true, &at.mounted, found.changed.as_ref())?
    };
    Ok((planned, format!("{}; plan {} ms", found.times, t.elapsed().as_millis())))
}

/// What the files' part of a rollback in place on ZFS needs: the statepoint's snapshot mounted
/// read-only where it can be read (`view`, showing `mounted` in the mount table); what changed
/// since the statepoint, from an incremental stream to the current state's snapshot, and where
/// those objects are now (from their znodes in the stream, [`places::places`]; else zdb, which
/// follows their parent pointers in the snapshot). Only those places are examined; without them
/// (or when a place cannot be trusted: a path that does not lead to its object) every directory
/// is. The stream and the places are found beside the view's making.
struct Found {
    live: PathBuf,
    view: View,
    mounted: String,
    changed: Option<std::collections::HashSet<u64>>,
    /// The places, those of files with other names apart, and who told them.
    places: Option<(Vec<PathBuf>, Vec<PathBuf>, &'static str)>,
    times: String,
}

/// What changed since the statepoint (the stream between its snapshot and a snapshot of the
/// frozen state) and where, found beside the making of the statepoint's [`View`] (the files are
/// copied back from it): the two at once.
fn find_in_place(
    zfs: &Zfs,
    d: &str,
    recorded: &str,
    view: View,
    taken: &TakenFiles,
    unchanged_before: Option<u64>,
    prepared: Option<ViewThread>,
) -> Result<Found> {
    let started = std::time::Instant::now();
    let scratch = view.at();
    // (the view begun before is waited for whatever happens below: never left to be made after
    // the rollback's cleanup)
    let mut prepared = Joined(prepared);
    // The statepoint's snapshot is usually on the dataset; a rollback that swapped datasets may
    // have left it on a retired one: looked for only when it is not there (and whatever the
    // first try met in the way, removed).
    let at = Snap::of(zfs, d, recorded);
    let live = mountpoint(zfs, d)?;
    let (made, (changes, times)) = std::thread::scope(|s| {
        let finding = s.spawn(|| changes_since(&at, &live, scratch, taken, unchanged_before));
        let made = match prepared.0.take() {
            Some(t) => t.join().unwrap_or_else(|p| std::panic::resume_unwind(p)),
            None => view.make(&at).map(|mounted| (mounted, started.elapsed())),
        };
        let found = finding.join().unwrap_or_else(|p| std::panic::resume_unwind(p));
        (made, found.unwrap_or_else(|e| ((None, None), format!("not found: {e}"))))
    });
    let (mounted, took) = made?;
    let ms = |t: std::time::Duration| t.as_millis();
    let what = if matches!(view, View::Snapshot(_)) { "snapshot mounted" } else { "clone" };
    Ok(Found {
        live,
        view,
        mounted,
        changed: changes.0,
        places: changes.1,
        times: format!("{what} {} ms; {times}; {} ms in all", ms(took), ms(started.elapsed())),
    })
}

/// The statepoint's snapshot: where it should be (`snap`, on dataset `d`), and its name to look
/// for elsewhere.
struct Snap<'a> {
    zfs: &'a Zfs,
    d: &'a str,
    name: &'a str,
    snap: String,
}

impl<'a> Snap<'a> {
    /// The snapshot `recorded` (a statepoint's, by its full name when it was taken) on `d`.
    fn of(zfs: &'a Zfs, d: &'a str, recorded: &'a str) -> Snap<'a> {
        let name = recorded.rsplit('@').next().unwrap_or(recorded);
        Snap { zfs, d, name, snap: format!("{d}@{name}") }
    }

    /// Where the snapshot is, when it is not on the dataset.
    fn located(&self) -> Result<String> {
        find_snapshot(self.zfs, self.d, self.name)?.ok_or_else(|| missing(self.name, self.d))
    }
}

/// What changed, and where: the changed objects and their places, or `None` when they cannot be
/// known (the files are then compared whole).
type Changes = (Option<std::collections::HashSet<u64>>, Option<(Vec<PathBuf>, Vec<PathBuf>, &'static str)>);

/// The frozen state's snapshot (`taken`'s, said made or not), the objects
/// changed since the statepoint's (those older than `unchanged_before` aside), and their places
/// in the live tree `live` (from the stream and the listings, else from zdb); with the times.
fn changes_since(
    at: &Snap,
    live: &Path,
    scratch: &Path,
    taken: &TakenFiles,
    unchanged_before: Option<u64>,
) -> Result<(Changes, String)> {
    let (zfs, now) = (at.zfs, taken.name());
    let ms = |t: std::time::Duration| t.as_millis();
    let t = std::time::Instant::now();
    // The frozen state's snapshot (one a crashed rollback left is replaced).
    let capturing = taken.capturing();
    let mut synced = std::time::Duration::ZERO;
    let mut snapshot = || -> Result<()> {
        syncfs(live)?;
        synced = t.elapsed();
        if zfs.snapshot(now).is_err() {
            let _ = zfs.destroy_snapshot(now);
            zfs.snapshot(now)?;
        }
        Ok(())
    };
    let snapshot = snapshot();
    capturing.made(snapshot.is_ok());
    snapshot?;
    let snapped = t.elapsed();
    let changes = zfs.changes(&at.snap, now).or_else(|_| Ok::<_, Error>(zfs.changes(&at.located()?, now)?));
    let mut changes = match changes {
        Ok(c) => c,
        Err(e) => return Ok(((None, None), format!("no stream: {e}"))),
    };
    let streamed = t.elapsed();
    let carried = changes.objects.len();
    if let Some(before) = unchanged_before {
        changes.objects.retain(|_, o| !matches!(o, zfs::stream::Object::File(z) if z.ctime < before));
    }
    let changed: std::collections::HashSet<u64> = changes.objects.keys().copied().collect();
    // Where they are: from their znodes and the live tree's listings, else from zdb.
    // What this learns of directories' places is kept for the next rollback.
    let cache = scratch.with_file_name("zfs-dirs.json");
    let known = places::load_known(&cache);
    let (places, how) = match places::places(&changes, live, &[], &known) {
        Ok(p) => {
            places::save_known(&cache, &known, &p.dirs);
            (Some((p.single, p.named, "stream")), format!("{} directories read", p.read))
        }
        Err(why) => {
            let found = places(zfs, now, &changed, live);
            if let Some((single, _)) = &found {
                places::save_known(&cache, &known, &places::dirs_of(live, single));
            }
            (found.map(|(single, named)| (single, named, "zdb")), format!("zdb: from the stream, {why}"))
        }
    };
    let times = format!(
        "snapshot {} ms (syncfs {} ms), stream {} ms ({carried} objects, {} changed since the statepoint), places {} ms ({how})",
        ms(snapped),
        ms(synced),
        ms(streamed - snapped),
        changed.len(),
        ms(t.elapsed() - streamed)
    );
    Ok(((Some(changed), places), times))
}

/// The name of dataset `d`'s read-only clone of a statepoint, which a rollback in place on
/// zfs-fuse reads the statepoint's files from (the [`View`] there).
fn view_of(d: &str) -> String {
    format!("{d}.planarian-inplace")
}

/// The name of the snapshot of dataset `d`'s frozen state a rollback in place takes.
fn frozen_of(d: &str) -> String {
    format!("{d}@planarian-inplace-now")
}

/// Where a rollback in place reads the statepoint's files from, read-only at a scratch directory:
/// on OpenZFS the statepoint's snapshot itself, mounted as `.zfs/snapshot` mounts it (no clone,
/// so no transaction group to wait for); on zfs-fuse, which mounts no snapshot, a read-only
/// clone of it named [`view_of`] the dataset.
#[derive(Clone)]
enum View {
    Snapshot(PathBuf),
    Clone(String, PathBuf),
}

impl View {
    fn of(d: &str, scratch: &Path) -> View {
        if zfs::kernel_zfs() {
            View::Snapshot(scratch.to_path_buf())
        } else {
            View::Clone(view_of(d), scratch.to_path_buf())
        }
    }

    /// Where it is mounted.
    fn at(&self) -> &Path {
        match self {
            View::Snapshot(at) | View::Clone(_, at) => at,
        }
    }

    /// What [`remove_leftover`] takes to remove it: its mount point, or the clone.
    fn leftover(&self) -> String {
        match self {
            View::Snapshot(at) => at.to_string_lossy().into_owned(),
            View::Clone(name, _) => name.clone(),
        }
    }

    /// Makes it from the statepoint's snapshot (one a crashed rollback left is replaced): what
    /// the mount table shows mounted there.
    fn make(&self, at: &Snap) -> Result<String> {
        let scratch = self.at();
        std::fs::create_dir_all(scratch).at("create", scratch)?;
        match self {
            View::Snapshot(_) => {
                unmount_all(scratch);
                if zfs::mount_snapshot(&at.snap, scratch).is_ok() {
                    return Ok(at.snap.clone());
                }
                let snap = at.located()?;
                zfs::mount_snapshot(&snap, scratch)?;
                Ok(snap)
            }
            View::Clone(view, _) => {
                if at.zfs.clone_read_only(&at.snap, view, scratch).is_err() {
                    if at.zfs.exists(view)? {
                        at.zfs.destroy(view, true)?;
                    }
                    at.zfs.clone_read_only(&at.located()?, view, scratch)?;
                }
                Ok(view.clone())
            }
        }
    }
}

/// The thread making the statepoint's view before the freeze: what it mounted, and how long it
/// took.
type ViewThread = std::thread::JoinHandle<Result<(String, std::time::Duration)>>;

/// A view's thread, joined when this is dropped.
struct Joined(Option<ViewThread>);

impl Drop for Joined {
    fn drop(&mut self) {
        if let Some(t) = self.0.take() {
            let _ = t.join();
        }
    }
}

/// [`ZfsRootfs::in_place_prepare`]'s view being made: removed when this is dropped unless
/// [`ZfsRootfs::in_place_start`] took its thread (and so the view, which it removes with the rest).
struct EarlyView {
    zfs: Zfs,
    view: View,
    thread: Option<ViewThread>,
}

impl Drop for EarlyView {
    fn drop(&mut self) {
        if let Some(t) = self.thread.take() {
            let _ = t.join();
            remove_leftover(&self.zfs, &self.view.leftover());
        }
    }
}

/// An early start's thread, and what it makes: destroyed, unless taken by [`ZfsRootfs::in_place`],
/// once the thread ends.
struct Early {
    zfs: Zfs,
    made: Vec<String>,
    /// The snapshot of the frozen state: destroyed too, unless it was handed on with the rest.
    now: Option<TakenFiles>,
    /// Set when this is dropped unused: the thread compares nothing more.
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<Result<(super::treesync::Sync, String)>>>,
}

impl Drop for Early {
    fn drop(&mut self) {
        if let Some(t) = self.thread.take() {
            self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
            let _ = t.join();
        }
        for m in &self.made {
            remove_leftover(&self.zfs, m);
        }
        if let Some(now) = self.now.take().filter(TakenFiles::capturers) {
            remove_leftover(&self.zfs, now.name());
        }
    }
}

/// The places in the live tree (`live`, which is snapshot `now`, frozen) of the `changed` objects
/// it holds, relative to its root, and, apart, those of files with more than one name (zdb
/// knows one); `None` when one cannot be trusted: zdb failed, or a path does not lead to its
/// object. Objects that are no file, and files no directory holds any more (unlinked, still
/// open), have no place; system directories (zdb shows them at `/`) neither.
fn places(
    zfs: &Zfs,
    now: &str,
    changed: &std::collections::HashSet<u64>,
    live: &Path,
) -> Option<(Vec<PathBuf>, Vec<PathBuf>)> {
    use std::os::unix::fs::MetadataExt;
    // (object 1, the master node, names the root: FUSE shows every mount's root as inode 1)
    let mut objects: Vec<u64> = changed.iter().copied().chain([1]).collect();
    objects.sort_unstable();
    objects.dedup();
    let infos = zfs
        .object_paths(now, &objects)
        .map_err(|e| crate::log::own_log("warning", &format!("in place: where the changed objects are: {e}")))
        .ok()?;
    let root = infos.iter().find_map(|o| o.root)?;
    let (mut out, mut named) = (Vec::new(), Vec::new());
    for o in infos.into_iter().filter(|o| changed.contains(&o.object)) {
        if o.unlinked() {
            continue;
        }
        let path = o.path.as_deref().expect("linked");
        if path == "/" {
            // The root, or a system directory (zdb shows them at "/" too).
            if o.object == root {
                out.push(PathBuf::new());
            }
            continue;
        }
        let rel = PathBuf::from(path.trim_start_matches('/'));
        let ino = std::fs::symlink_metadata(live.join(&rel)).ok().map(|m| m.ino());
        if ino != Some(o.object) {
            crate::log::own_log(
                "warning",
                &format!("in place: object {} is not at {path}: every directory is compared", o.object),
            );
            return None;
        }
        if !o.is_dir() && o.links.unwrap_or(1) > 1 {
            named.push(rel);
        } else {
            out.push(rel);
        }
    }
    Some((out, named))
}

/// Removes what a rollback in place left: the statepoint's view ([`View::leftover`]: a mount
/// point, unmounted; a clone, destroyed) or the snapshot of the frozen state it took. Destroying
/// a clone unmounts it; FUSE may still hold the walked mount a moment: then it is unmounted
/// first and tried again.
pub fn remove_leftover(zfs: &Zfs, view: &str) {
    if view.starts_with('/') {
        unmount_all(Path::new(view));
        return;
    }
    for _ in 0..20 {
        if zfs.destroy(view, true).is_ok() || !zfs.exists(view).unwrap_or(false) {
            return;
        }
        let _ = zfs.unmount(view);
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// Removes what a rollback in place that was killed on its way left on ZFS: the statepoint's view
/// (a mount, or a clone) and the frozen state's snapshot. The recovery of an interrupted rollback
/// calls it first: a restore that moves the statepoint's snapshot must not find it mounted, and
/// the frozen state's snapshot, left behind on the retired dataset, would keep that for good.
pub fn remove_killed_in_place(cfg: &Config, store: &ContainerStore) {
    let view_at = super::files::in_place_scratch(store);
    match (mapping(store), zfs_from(cfg)) {
        (Some(map), Ok(zfs)) => remove_in_place_leftovers(&zfs, &map.dataset, &view_at),
        _ => unmount_all(&view_at),
    }
}

/// The statepoint's view of dataset `d` (mounted at `view_at`, or a clone) and its frozen state's
/// snapshot, removed where they are.
fn remove_in_place_leftovers(zfs: &Zfs, d: &str, view_at: &Path) {
    unmount_all(view_at);
    for made in [view_of(d), frozen_of(d)] {
        if zfs.exists(&made).unwrap_or(false) {
            remove_leftover(zfs, &made);
        }
    }
}

/// Unmounts the snapshots mounted at `at` (a statepoint's [`View`], one a crashed rollback left
/// included), trying again for a while one that is still busy (the walk's last files being
/// closed). Nothing else mounted there is touched (zfs-fuse's clone goes by `zfs destroy`).
fn unmount_all(at: &Path) {
    let snapshot_on_top = || {
        let mounts = sys::proc::Proc::own().mounts().unwrap_or_default();
        zfs::dataset_mounted_at(&mounts, at).is_some_and(|source| source.contains('@'))
    };
    let mut busy = 0;
    while snapshot_on_top() {
        match zfs::unmount_at(at) {
            Ok(()) => {}
            Err(nix::libc::EBUSY) if busy < 20 => {
                busy += 1;
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            Err(e) => {
                let e = std::io::Error::from_raw_os_error(e);
                crate::log::own_log("warning", &format!("in place: the view at {} stays mounted: {e}", at.display()));
                return;
            }
        }
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
pub fn destroy_snapshot(cfg: &Config, store: &ContainerStore, recorded: &str) -> Result<()> {
    let zfs = zfs_from(cfg)?;
    let name = recorded.rsplit('@').next().unwrap_or(recorded);
    // (a view a crashed rollback left mounted would keep it: the exclusive lock held, no rollback
    // has one mounted now)
    unmount_all(&super::files::in_place_scratch(store));
    if let Some(snap) = find_snapshot(&zfs, recorded, name)? {
        zfs.destroy_snapshot(&snap)?;
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
pub fn fork_into(
    cfg: &Config,
    src: &Mapping,
    recorded: &str,
    new_store: &ContainerStore,
    new_id: &str,
    new_bundle: &Path,
) -> Result<()> {
    let zfs = zfs_from(cfg)?;
    let snap = recorded_snapshot(&zfs, &src.dataset, recorded)?;
    let ds = fork_dataset(cfg, src, new_id);
    zfs.clone_snapshot(&snap, &ds, &[])?;
    let bundle = std::fs::canonicalize(new_bundle).unwrap_or(new_bundle.to_path_buf());
    save_mapping(new_store, &Mapping { dataset: ds.clone(), owned: true, bundle, image_base: None }).inspect_err(|_| {
        let _ = zfs.destroy(&ds, true);
    })
}

// ---------------------------------------------------------------------------------------------
// statepoints that leave the machine

/// Writes the files of statepoint snapshot `recorded` of `store`'s container into `out` as a
/// `zfs send` stream: whole, or incremental from snapshot `since` (an older statepoint of the
/// same dataset's history, which the receiver holds). Returns the `guid` of the snapshot the
/// stream starts from, for an incremental one.
pub fn send_statepoint(
    cfg: &Config,
    store: &ContainerStore,
    recorded: &str,
    since: Option<&str>,
    out: &Path,
) -> Result<Option<String>> {
    let map = mapping(store).ok_or(Error::NoZfsSnapshot)?;
    let zfs = zfs_from(cfg)?;
    let find = |recorded: &str| recorded_snapshot(&zfs, &map.dataset, recorded);
    let snap = find(recorded)?;
    let from = since.map(find).transpose()?;
    let guid = match &from {
        Some(f) => Some(zfs.guid(f)?),
        None => None,
    };
    let file = std::fs::File::create(out).at("create", out)?;
    zfs.send(&snap, from.as_deref(), file).inspect_err(|_| {
        let _ = std::fs::remove_file(out);
    })?;
    Ok(guid)
}

/// A `zfs send` stream to receive: the file, and the guid of the snapshot an incremental one
/// starts from.
pub struct Incoming<'a> {
    pub stream: &'a Path,
    pub from_guid: Option<&'a str>,
}

/// Makes the `incoming` stream container `id`'s dataset, `<parent>/ctr-<id>`, its snapshot
/// named `snap_name` (a statepoint of `id`), and maps the container to it. An incremental stream
/// (from the snapshot whose guid it names, found anywhere in `parent`'s pool) is received
/// into a clone of that snapshot: only the changes travel. Returns the snapshot. On failure
/// nothing is left.
pub fn receive_statepoint(
    cfg: &Config,
    store: &ContainerStore,
    id: &str,
    parent: &str,
    incoming: Incoming,
    snap_name: &str,
    bundle: &Path,
) -> Result<String> {
    let Incoming { stream, from_guid } = incoming;
    let zfs = zfs_from(cfg)?;
    if !zfs.exists(parent)? {
        return Err(Error::NoParentDataset(parent.to_string()));
    }
    let ds = format!("{parent}/ctr-{id}");
    if zfs.exists(&ds)? {
        return Err(Error::DatasetExists(ds));
    }
    let input = std::fs::File::open(stream).at("open", stream)?;
    let step = |what: &str| {
        let what = format!("cannot {what} the files of container {}", short(id));
        move |source| Error::ZfsStep { what, source }
    };
    if let Some(guid) = from_guid {
        // A clone of the common snapshot, promoted for the receive so that the snapshot is its
        // own newest (the only ground zfs-fuse receives an incremental stream on; OpenZFS's
        // `receive -o origin` is the same idea), then the snapshots go back to where they were:
        // the new dataset is a clone of the common snapshot, as a fork is.
        let base = zfs
            .snapshot_by_guid(zfs::pool_of(parent), guid)?
            .ok_or_else(|| Error::NoCommonSnapshot(zfs::pool_of(parent).to_string()))?;
        let origin_ds = zfs::dataset_of(&base).to_string();
        zfs.clone_snapshot(&base, &ds, &[]).map_err(step("clone the common snapshot for"))?;
        let received = zfs.promote(&ds).and_then(|()| zfs.receive_force(&ds, input));
        let back = zfs.promote(&origin_ds);
        if let Err(e) = received.and(back) {
            let _ = zfs.promote(&origin_ds);
            let _ = zfs.destroy(&ds, true);
            return Err(step("receive")(e));
        }
    } else {
        zfs.receive(&ds, input).map_err(step("receive"))?;
    }
    let r = (|| {
        let received = zfs
            .snapshots(&ds)?
            .into_iter()
            .rev()
            .find(|s| zfs::dataset_of(s) == ds)
            .ok_or_else(|| missing(snap_name, &ds))?;
        let snap = format!("{ds}@{snap_name}");
        if received != snap {
            zfs.rename(&received, &snap)?;
        }
        mountpoint(&zfs, &ds)?;
        let bundle = std::fs::canonicalize(bundle).unwrap_or(bundle.to_path_buf());
        save_mapping(store, &Mapping { dataset: ds.clone(), owned: true, bundle, image_base: None })?;
        Ok(snap)
    })();
    if r.is_err() {
        let _ = zfs.destroy(&ds, true);
    }
    r
}

// ---------------------------------------------------------------------------------------------
// removal of a container

/// Removes everything planarian made in ZFS for a container: its datasets (after promoting the
/// forks that depend on them), its snapshots; its statepoints are discarded. The mapping goes.
/// A dataset or snapshot of removed container `id`'s that could not be destroyed: a warning
/// that names it and the command that removes it.
fn left_behind(id: &str, what: &str, e: &impl std::fmt::Display) {
    crate::log::own_log(
        "warning",
        &format!("container {} removed, but not its {what} ({e}); `zfs destroy -r {what}` removes it", short(id)),
    );
}

pub fn remove_container(cfg: &Config, store: &ContainerStore) -> Result<()> {
    let Some(map) = mapping(store) else { return Ok(()) };
    let zfs = zfs_from(cfg)?;
    // (a view a crashed rollback left mounted keeps its snapshot)
    unmount_all(&super::files::in_place_scratch(store));
    let d = &map.dataset;
    let pool = zfs::pool_of(d);
    let id = store.dir.file_name().unwrap_or_default().to_string_lossy().into_owned();
    let ours = format!("@planarian-{}-", short(&id));
    let old_prefix = format!("{d}.planarian-old-");
    let in_family =
        |fs: &str| fs == d || fs.starts_with(&old_prefix) || fs == format!("{d}.planarian-new") || fs == view_of(d);
    // The container's dataset is a clone of a retired one's snapshot after a rollback that went
    // forward by a restore (to a statepoint a retired dataset held): it takes that history back
    // first, or the retired dataset, and planarian's snapshot the live one depends on, could not
    // go. (Its own origin, an image base or the user's, stays.)
    for _ in 0..64 {
        let retired_origin = zfs.filesystems(pool)?.iter().any(|(fs, origin)| {
            fs == d && origin.as_deref().is_some_and(|o| zfs::dataset_of(o).starts_with(&old_prefix))
        });
        if !retired_origin {
            break;
        }
        zfs.promote(d)?;
    }
    if map.owned {
        // Forks (or anything) cloned from the family's snapshots take them over first.
        for _ in 0..64 {
            let fss = zfs.filesystems(pool)?;
            let dependant = fss.iter().find(|(fs, origin)| {
                !in_family(fs) && origin.as_deref().is_some_and(|o| in_family(zfs::dataset_of(o)))
            });
            match dependant {
                Some((fs, _)) => zfs.promote(fs)?,
                None => break,
            }
        }
        let mut family: Vec<String> =
            zfs.filesystems(pool)?.into_iter().map(|(n, _)| n).filter(|n| in_family(n)).collect();
        // Retired datasets are clones of the live one's snapshots: they go first.
        family.sort_by_key(|n| n == d);
        for fs in family {
            zfs.destroy(&fs, true)?;
        }
    } else {
        // (the container goes whatever stays: what does is named where an operator finds it)
        for (fs, _) in zfs.filesystems(pool)?.iter().filter(|(n, _)| n.starts_with(&old_prefix)) {
            if let Err(e) = zfs.destroy(fs, true) {
                left_behind(&id, fs, &e);
            }
        }
    }
    // Its snapshots that a promote moved elsewhere, or on the user's own dataset.
    for s in zfs.snapshots(pool)?.iter().filter(|s| s.contains(&ours)) {
        if let Err(e) = zfs.destroy_snapshot(s) {
            left_behind(&id, s, &e);
        }
    }
    for mut m in store.manifests() {
        if m.local_state.zfs_snapshot.is_some() && m.status != crate::store::Status::Discarded {
            m.status = crate::store::Status::Discarded;
            let _ = store.write_manifest(&m);
        }
    }
    Ok(std::fs::remove_file(store.dir.join(MAPPING)).at("remove", store.dir.join(MAPPING))?)
}

/// Removes the datasets of containers Podman has removed (their bundle is gone). With `wait`,
/// only that container's, after waiting (up to 30 s) for its bundle to go first — `delete`
/// starts this, and only a `podman rm` removes the bundle — and retrying while its file system
/// is still busy. The last error of a container is also left in its store (`gc-error`).
pub fn gc(cfg: &Config, wait: Option<&str>) -> Result<(), GcError> {
    let stores: Vec<ContainerStore> = match wait {
        Some(id) => {
            let store = ContainerStore::new(&cfg.store.path, id);
            let Some(map) = mapping(&store) else { return Ok(()) };
            let t = std::time::Instant::now();
            while map.bundle.exists() && t.elapsed() < std::time::Duration::from_secs(30) {
                std::thread::sleep(std::time::Duration::from_millis(200));
            }
            vec![store]
        }
        None => std::fs::read_dir(cfg.store.path.join("containers"))
            .map(|rd| {
                rd.filter_map(Result::ok)
                    .map(|e| ContainerStore::new(&cfg.store.path, &e.file_name().to_string_lossy()))
                    .collect()
            })
            .unwrap_or_default(),
    };
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
            let r = store.lock(true).map_err(Error::from).and_then(|_lock| remove_container(cfg, &store));
            if r.is_ok() || wait.is_none() || t.elapsed() > std::time::Duration::from_secs(30) {
                break r;
            }
            std::thread::sleep(std::time::Duration::from_secs(1));
        };
        if let Err(e) = r {
            let _ = std::fs::write(store.dir.join("gc-error"), format!("{e}\n"));
            failed = Some(GcError { store: store.dir.clone(), source: e });
        }
    }
    failed.map_or(Ok(()), Err)
}

/// The datasets of a removed container could not be removed.
#[derive(Debug, thiserror::Error)]
#[error("cannot remove the datasets of removed container {}: {source}", store.display())]
pub struct GcError {
    pub store: PathBuf,
    pub source: Error,
}

/// Starts `planarian gc --wait ID` in the background when a mapped container is deleted.
pub fn on_delete(cfg: &Config, id: &str) {
    let store = ContainerStore::new(&cfg.store.path, id);
    if !store.dir.join(MAPPING).exists() {
        return;
    }
    let Ok(exe) = std::env::current_exe() else { return };
    let mut cmd = std::process::Command::new(exe);
    cmd.arg("gc")
        .arg("--wait")
        .arg(id)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    crate::tools::detach(&mut cmd);
    let _ = cmd.spawn();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshot_names_are_per_container() {
        assert_eq!(snapshot_name("0123456789abcdef0123", "sp3"), "planarian-0123456789ab-sp3");
    }
}
