//! Files put back under a running container: the differences between a statepoint's tree and
//! the current one, applied through the container's own root, so its processes (frozen) see
//! exactly the statepoint's files when they run again.
//!
//! * copy path: the statepoint's copy of the overlay's writable layer against the live layer,
//!   applied through the overlay (`/proc/PID/root`): an entry the layer has now and had not then
//!   shows the image's version again, copied from the lower layers;
//! * ZFS: a clone of the statepoint's snapshot against the live dataset (zfs-fuse has neither
//!   `.zfs/snapshot` nor `zfs diff`, and rolls back only to the newest snapshot). There entries
//!   compare by inode and ctime too: a clone shares both with its origin for what did not change.
//!
//! A difference the sync cannot express (an overlay directory that became or stopped being
//! opaque) refuses before anything is written.

use std::collections::HashSet;
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, PartialEq, Eq)]
enum Op {
    /// Make the entry what the statepoint's tree (or, `from` set, a lower layer) has.
    Put {
        rel: PathBuf,
        from: PathBuf,
    },
    Remove(PathBuf),
    /// A directory's owner, mode and times.
    DirMeta {
        rel: PathBuf,
        from: PathBuf,
    },
}

/// What to change, and where.
#[derive(Debug)]
pub struct Sync {
    ops: Vec<Op>,
    apply_root: PathBuf,
    /// [`plan_places`]: how many places were examined (no directory was read otherwise).
    pub places: Option<usize>,
    /// Where those places came from (ZFS: `stream`, the changed objects' znodes, or `zdb`).
    pub located_by: Option<&'static str>,
}

fn is_whiteout(md: &std::fs::Metadata) -> bool {
    md.file_type().is_char_device() && md.rdev() == 0
}

fn is_opaque(dir: &Path) -> bool {
    let Ok(c) = CString::new(dir.as_os_str().as_bytes()) else { return false };
    let mut buf = [0u8; 4];
    // SAFETY: valid NUL-terminated strings and a buffer of the given length.
    let n = unsafe {
        nix::libc::lgetxattr(c.as_ptr(), c"trusted.overlay.opaque".as_ptr(), buf.as_mut_ptr().cast(), buf.len())
    };
    n == 1 && buf[0] == b'y'
}

fn same(a: &std::fs::Metadata, b: &std::fs::Metadata, pa: &Path, pb: &Path, strict: bool) -> bool {
    // A Unix socket's name is its socket's: the rollback in place keeps the socket (the same one
    // in the same state, or the one a restore bound anew), and with it the name it is bound to.
    // Written back, the name would be a node no socket listens on.
    if a.file_type().is_socket() && b.file_type().is_socket() {
        return true;
    }
    let base = a.file_type() == b.file_type()
        && a.mode() == b.mode()
        && a.uid() == b.uid()
        && a.gid() == b.gid()
        && a.rdev() == b.rdev()
        && (a.is_dir() || (a.size() == b.size() && a.mtime() == b.mtime() && a.mtime_nsec() == b.mtime_nsec()));
    let links = !a.file_type().is_symlink() || std::fs::read_link(pa).ok() == std::fs::read_link(pb).ok();
    base && links && (!strict || (a.ino() == b.ino() && a.ctime() == b.ctime() && a.ctime_nsec() == b.ctime_nsec()))
}

/// The topmost lower layer's version of `rel`, if the image has one (whiteouts and opaque
/// directories of the lower layers honoured).
fn lower_of(lowers: &[PathBuf], rel: &Path) -> Option<PathBuf> {
    for layer in lowers {
        let mut dir = layer.clone();
        let mut stop = false;
        let comps: Vec<_> = rel.components().collect();
        for (i, c) in comps.iter().enumerate() {
            dir.push(c);
            let md = std::fs::symlink_metadata(&dir);
            match md {
                Ok(m) if is_whiteout(&m) => return None,
                Ok(m) if i + 1 == comps.len() => {
                    let _ = m;
                    return Some(dir);
                }
                Ok(m) if m.is_dir() => stop |= is_opaque(&dir),
                Ok(_) => return None,
                Err(_) => break,
            }
        }
        if stop {
            return None;
        }
    }
    None
}

/// Why two trees cannot be made the same in place, or what failed writing the difference.
#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    /// A directory opaque in the overlay on one side only: a copy of the layer does not say
    /// which lower entries it hides.
    #[error("/{} became or stopped being an opaque overlay directory", .0.display())]
    OpaqueChanged(PathBuf),
    #[error("/{} is an opaque overlay directory in the statepoint", .0.display())]
    OpaqueThen(PathBuf),
    #[error("{op}: {source}")]
    Write { op: String, source: std::io::Error },
}

/// Compares `target` (the statepoint's tree) with `current` (the live one); changes go to
/// `apply_root`. `lowers`: the overlay's lower layers (copy path), none on ZFS (`strict`).
/// Paths in `mounted` (relative: the container's mount points) are not the tree's and are left.
pub fn plan(
    target: &Path,
    current: &Path,
    apply_root: &Path,
    lowers: &[PathBuf],
    strict: bool,
    mounted: &[PathBuf],
) -> Result<Sync, SyncError> {
    plan_changed(target, current, apply_root, lowers, strict, mounted, None)
}

/// [`plan`], told which inodes may have changed (`changed`: ZFS's objects between the two
/// snapshots): an entry with the same inode on both sides and not in `changed` is the same
/// object unchanged, and is not even looked at (directories are still read, from their
/// listings' inode numbers, without a `stat` per entry).
pub fn plan_changed(
    target: &Path,
    current: &Path,
    apply_root: &Path,
    lowers: &[PathBuf],
    strict: bool,
    mounted: &[PathBuf],
    changed: Option<&HashSet<u64>>,
) -> Result<Sync, SyncError> {
    let mut ops = Vec::new();
    let mut metas = Vec::new();
    let w = Walk { target, current, lowers, strict, mounted, changed, focused: false, dirs: Default::default() };
    let ino = |p: &Path| std::fs::symlink_metadata(p).map(|m| m.ino()).ok();
    let root_unchanged =
        changed.is_some_and(|c| ino(target).is_some_and(|i| Some(i) == ino(current) && !c.contains(&i)));
    w.walk(Path::new(""), root_unchanged, &mut ops, &mut metas)?;
    Ok(finish(ops, metas, target, apply_root))
}

/// The plan in the order it is applied: entries put back or removed (none inside another that
/// is put back or removed whole, each once), then the times and modes of directories, deepest
/// first — of those that differ and of those the changes inside would move (an entry's
/// directory, when the statepoint's tree has it).
fn finish(mut ops: Vec<Op>, mut metas: Vec<Op>, target: &Path, apply_root: &Path) -> Sync {
    let whole: std::collections::BTreeSet<PathBuf> = ops.iter().map(|o| o.rel().to_path_buf()).collect();
    for dir in whole.iter().filter_map(|r| r.parent()) {
        if std::fs::symlink_metadata(target.join(dir)).is_ok_and(|m| m.is_dir()) {
            metas.push(Op::DirMeta { rel: dir.to_path_buf(), from: target.join(dir) });
        }
    }
    let inside = |r: &Path| r.ancestors().skip(1).any(|a| whole.contains(a));
    ops.sort_by(|a, b| a.rel().cmp(b.rel()));
    ops.dedup();
    ops.retain(|o| !inside(o.rel()));
    metas.sort_by(|a, b| {
        b.rel().components().count().cmp(&a.rel().components().count()).then_with(|| a.rel().cmp(b.rel()))
    });
    metas.dedup();
    metas.retain(|o| !inside(o.rel()) && !whole.contains(o.rel()));
    ops.extend(metas);
    Sync { ops, apply_root: apply_root.to_path_buf(), places: None, located_by: None }
}

/// [`plan`] on ZFS when the objects that may differ are known with their places: `changed`,
/// the objects between the two snapshots, and `places`, the paths in the current tree of those
/// of them it holds (each the only path of its object). Only those paths are examined, and a
/// directory among them only one level down: every difference is either one of those objects,
/// or a name that came, went or changed object in a directory, which then is one of them too (a
/// directory whose listing changed changed). No other directory is read.
pub fn plan_places(
    target: &Path,
    current: &Path,
    apply_root: &Path,
    mounted: &[PathBuf],
    changed: &HashSet<u64>,
    places: &[PathBuf],
) -> Result<Sync, SyncError> {
    let mut ops = Vec::new();
    let mut metas = Vec::new();
    let w = Walk {
        target,
        current,
        lowers: &[],
        strict: true,
        mounted,
        changed: Some(changed),
        focused: true,
        dirs: Default::default(),
    };
    let mut places: Vec<&PathBuf> = places.iter().collect();
    places.sort();
    places.dedup();
    let examined = places.len();
    for rel in places {
        if rel.as_os_str().is_empty() {
            w.walk(rel, false, &mut ops, &mut metas)?;
        } else if !mounted.iter().any(|m| rel.starts_with(m)) {
            w.entry(rel, true, &mut ops, &mut metas)?;
        }
    }
    Ok(Sync { places: Some(examined), ..finish(ops, metas, target, apply_root) })
}

/// Whether the entry at `rel` is the same object, unchanged, on both sides (ZFS: inode and
/// ctime included), reached without following a symbolic link.
pub fn unchanged(target: &Path, current: &Path, rel: &Path) -> bool {
    match (within(target, rel), within(current, rel)) {
        (Some(t), Some(c)) => same(&t, &c, &target.join(rel), &current.join(rel), true),
        _ => false,
    }
}

impl Op {
    fn rel(&self) -> &Path {
        match self {
            Op::Put { rel, .. } | Op::DirMeta { rel, .. } | Op::Remove(rel) => rel,
        }
    }
}

/// A directory's entries: name → (inode, is a directory), from the listing alone.
pub(crate) fn listing(dir: &Path) -> std::collections::BTreeMap<std::ffi::OsString, (u64, bool)> {
    use std::os::unix::fs::DirEntryExt;
    std::fs::read_dir(dir)
        .map(|rd| rd.flatten().map(|e| (e.file_name(), (e.ino(), e.file_type().is_ok_and(|t| t.is_dir())))).collect())
        .unwrap_or_default()
}

fn names(dir: &Path) -> std::collections::BTreeSet<std::ffi::OsString> {
    std::fs::read_dir(dir).map(|rd| rd.flatten().map(|e| e.file_name()).collect()).unwrap_or_default()
}

/// `base/rel`'s metadata when every directory on the way is one (no symbolic link followed).
pub(crate) fn within(base: &Path, rel: &Path) -> Option<std::fs::Metadata> {
    let mut at = base.to_path_buf();
    let comps: Vec<_> = rel.components().collect();
    for c in &comps[..comps.len().saturating_sub(1)] {
        at.push(c);
        if !std::fs::symlink_metadata(&at).is_ok_and(|m| m.is_dir()) {
            return None;
        }
    }
    std::fs::symlink_metadata(base.join(rel)).ok()
}

struct Walk<'a> {
    target: &'a Path,
    current: &'a Path,
    lowers: &'a [PathBuf],
    strict: bool,
    mounted: &'a [PathBuf],
    changed: Option<&'a HashSet<u64>>,
    /// [`plan_places`]: an entry that is the same object on both sides is examined, if at all,
    /// at its own place; never through its directory.
    focused: bool,
    /// Directories found to be directories on the way to an entry (the trees do not change
    /// while planned): each looked at once.
    dirs: std::cell::RefCell<HashSet<PathBuf>>,
}

impl Walk<'_> {
    /// [`within`], each directory on the way looked at once per plan.
    fn within(&self, base: &Path, rel: &Path) -> Option<std::fs::Metadata> {
        let mut at = base.to_path_buf();
        let comps: Vec<_> = rel.components().collect();
        for c in &comps[..comps.len().saturating_sub(1)] {
            at.push(c);
            if self.dirs.borrow().contains(&at) {
                continue;
            }
            if !std::fs::symlink_metadata(&at).is_ok_and(|m| m.is_dir()) {
                return None;
            }
            self.dirs.borrow_mut().insert(at.clone());
        }
        std::fs::symlink_metadata(base.join(rel)).ok()
    }

    /// `unchanged`: the directory is the same object on both sides and did not change, so its
    /// listing is the same: read once, from the live side (the statepoint's side is a fresh mount,
    /// every read of it cold).
    fn walk(&self, rel: &Path, unchanged: bool, ops: &mut Vec<Op>, metas: &mut Vec<Op>) -> Result<(), SyncError> {
        let (td, cd) = (self.target.join(rel), self.current.join(rel));
        let cl = listing(&cd);
        let tl = if unchanged { cl.clone() } else { listing(&td) };
        let mut all: std::collections::BTreeSet<&std::ffi::OsString> = tl.keys().collect();
        all.extend(cl.keys());
        for n in all {
            let r = rel.join(n);
            if self.mounted.contains(&r) {
                continue;
            }
            if let (Some(changed), Some(t), Some(c)) = (self.changed, tl.get(n), cl.get(n)) {
                if t == c && (self.focused || !changed.contains(&t.0)) {
                    if t.1 && !self.focused {
                        self.walk(&r, true, ops, metas)?;
                    }
                    continue;
                }
            }
            self.entry(&r, false, ops, metas)?;
        }
        Ok(())
    }

    /// Compares the entry at `r` on both sides. `checked`: its directories are checked on the way
    /// (it was not reached through them).
    fn entry(&self, r: &Path, checked: bool, ops: &mut Vec<Op>, metas: &mut Vec<Op>) -> Result<(), SyncError> {
        let (target, current, lowers, strict) = (self.target, self.current, self.lowers, self.strict);
        let (tp, cp) = (target.join(r), current.join(r));
        let (t, c) = if checked {
            (self.within(target, r), self.within(current, r))
        } else {
            (std::fs::symlink_metadata(&tp).ok(), std::fs::symlink_metadata(&cp).ok())
        };
        match (t, c) {
            (Some(t), Some(c)) if t.is_dir() && c.is_dir() => {
                // The same directory, unchanged (ZFS: inode and ctime): the same listing, and each
                // entry that changed is a place of its own.
                if self.focused
                    && same(&t, &c, &tp, &cp, true)
                    && t.mtime() == c.mtime()
                    && t.mtime_nsec() == c.mtime_nsec()
                {
                    return Ok(());
                }
                if !lowers.is_empty() && is_opaque(&tp) != is_opaque(&cp) {
                    return Err(SyncError::OpaqueChanged(r.to_path_buf()));
                }
                self.walk(r, false, ops, metas)?;
                if !same(&t, &c, &tp, &cp, strict) || t.mtime() != c.mtime() || t.mtime_nsec() != c.mtime_nsec() {
                    metas.push(Op::DirMeta { rel: r.to_path_buf(), from: tp });
                }
            }
            (Some(t), c) => {
                if c.as_ref().is_some_and(|c| same(&t, c, &tp, &cp, strict)) {
                    return Ok(());
                }
                if !lowers.is_empty() && t.is_dir() && is_opaque(&tp) {
                    return Err(SyncError::OpaqueThen(r.to_path_buf()));
                }
                ops.push(if is_whiteout(&t) && !lowers.is_empty() {
                    Op::Remove(r.to_path_buf())
                } else {
                    Op::Put { rel: r.to_path_buf(), from: tp }
                });
            }
            (None, Some(_)) => {
                // Not in the statepoint's layer: the image's version, or nothing.
                match lower_of(lowers, r) {
                    Some(from) => ops.push(Op::Put { rel: r.to_path_buf(), from }),
                    None => ops.push(Op::Remove(r.to_path_buf())),
                }
            }
            (None, None) => {}
        }
        Ok(())
    }
}

fn remove_any(p: &Path) -> std::io::Result<()> {
    match std::fs::symlink_metadata(p) {
        Ok(md) if md.is_dir() => std::fs::remove_dir_all(p),
        Ok(_) => std::fs::remove_file(p),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

fn cstr(p: &Path) -> std::io::Result<CString> {
    CString::new(p.as_os_str().as_bytes()).map_err(std::io::Error::other)
}

/// Owner, mode and times of `from` onto `to` (not following links).
pub(crate) fn set_meta(from: &std::fs::Metadata, to: &Path) -> std::io::Result<()> {
    std::os::unix::fs::lchown(to, Some(from.uid()), Some(from.gid()))?;
    if !from.file_type().is_symlink() {
        // (after the owner: a chown drops the set-ID bits)
        std::fs::set_permissions(to, std::fs::Permissions::from_mode(from.mode() & 0o7777))?;
    }
    set_times(from, to)
}

/// The access and modification times of `from` onto `to` (not following links).
pub(crate) fn set_times(from: &std::fs::Metadata, to: &Path) -> std::io::Result<()> {
    let c = cstr(to)?;
    let times = [
        nix::libc::timespec { tv_sec: from.atime(), tv_nsec: from.atime_nsec() },
        nix::libc::timespec { tv_sec: from.mtime(), tv_nsec: from.mtime_nsec() },
    ];
    // SAFETY: a valid path and two timespecs.
    if unsafe { nix::libc::utimensat(nix::libc::AT_FDCWD, c.as_ptr(), times.as_ptr(), nix::libc::AT_SYMLINK_NOFOLLOW) }
        != 0
    {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Makes `to` what `from` is (a whole tree for a directory). A regular file that exists keeps
/// its inode (a process holding it open reads the statepoint's content, as after a rollback of
/// the file system).
fn put(from: &Path, to: &Path) -> std::io::Result<()> {
    let md = std::fs::symlink_metadata(from)?;
    let existing = std::fs::symlink_metadata(to).ok();
    let ft = md.file_type();
    if let Some(e) = &existing {
        let keep = (ft.is_file() && e.file_type().is_file()) || (ft.is_dir() && e.is_dir());
        if !keep {
            remove_any(to)?;
        }
    }
    if ft.is_file() {
        let mut src = std::fs::File::open(from)?;
        let mut dst = std::fs::OpenOptions::new().write(true).create(true).truncate(true).open(to)?;
        std::io::copy(&mut src, &mut dst)?;
    } else if ft.is_dir() {
        if !to.is_dir() {
            std::fs::create_dir(to)?;
        }
        let want = names(from);
        for n in names(to) {
            if !want.contains(&n) {
                remove_any(&to.join(&n))?;
            }
        }
        for n in want {
            put(&from.join(&n), &to.join(&n))?;
        }
    } else if ft.is_symlink() {
        std::os::unix::fs::symlink(std::fs::read_link(from)?, to)?;
    } else {
        make_node(&md, to)?;
    }
    set_meta(&md, to)
}

/// A device, FIFO or socket at `to` of the type and device number `md` gives (its mode as the
/// umask leaves it: [`set_meta`] sets it).
pub(crate) fn make_node(md: &std::fs::Metadata, to: &Path) -> std::io::Result<()> {
    let c = cstr(to)?;
    // SAFETY: a valid path; mode and device from the source's metadata.
    if unsafe { nix::libc::mknod(c.as_ptr(), md.mode(), md.rdev()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

impl Sync {
    /// How many entries change.
    pub fn len(&self) -> usize {
        self.ops.iter().filter(|o| !matches!(o, Op::DirMeta { .. })).count()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Writes the changes; the first failure stops it (the caller then restores the statepoint
    /// whole).
    pub fn apply(&self) -> Result<usize, SyncError> {
        for op in &self.ops {
            let r = match op {
                Op::Put { rel, from } => put(from, &self.apply_root.join(rel)),
                Op::Remove(rel) => remove_any(&self.apply_root.join(rel)),
                Op::DirMeta { rel, from } => {
                    std::fs::symlink_metadata(from).and_then(|md| set_meta(&md, &self.apply_root.join(rel)))
                }
            };
            r.map_err(|source| SyncError::Write { op: format!("{op:?}"), source })?;
        }
        Ok(self.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A scratch directory (removed when the first is dropped) and a directory made in it.
    fn tmp(tag: &str) -> (tempfile::TempDir, PathBuf) {
        let scratch = tempfile::tempdir().unwrap();
        let d = scratch.path().join(tag);
        std::fs::create_dir_all(&d).unwrap();
        (scratch, d)
    }

    fn tree(root: &Path) -> Vec<(String, String)> {
        let mut out = Vec::new();
        fn go(root: &Path, rel: &Path, out: &mut Vec<(String, String)>) {
            for n in names(&root.join(rel)) {
                let r = rel.join(&n);
                let p = root.join(&r);
                let md = std::fs::symlink_metadata(&p).unwrap();
                let what = if md.is_dir() {
                    go(root, &r, out);
                    "dir".to_string()
                } else if md.file_type().is_symlink() {
                    format!("-> {}", std::fs::read_link(&p).unwrap().display())
                } else {
                    std::fs::read_to_string(&p).unwrap()
                };
                out.push((r.display().to_string(), format!("{what} {:o} {}", md.mode() & 0o7777, md.mtime())));
            }
        }
        go(root, Path::new(""), &mut out);
        out.sort();
        out
    }

    /// A plain tree (the ZFS case): the live tree becomes the statepoint's, files that stay
    /// open keep their inode.
    #[test]
    fn plain_trees_become_the_statepoints() {
        let (_scratch, d) = tmp("plain");
        let (t, c) = (d.join("t"), d.join("c"));
        for x in [&t, &c] {
            std::fs::create_dir_all(x.join("etc/sub")).unwrap();
            std::fs::write(x.join("etc/keep"), "same").unwrap();
        }
        // Same content written at different times differ by mtime: set them equal.
        let md = std::fs::metadata(t.join("etc/keep")).unwrap();
        set_meta(&md, &c.join("etc/keep")).unwrap();
        std::fs::write(t.join("etc/conf"), "v1").unwrap();
        std::fs::write(c.join("etc/conf"), "v2, longer").unwrap();
        std::fs::write(t.join("etc/sub/gone-now"), "was here").unwrap();
        std::fs::write(c.join("new"), "created after").unwrap();
        std::fs::create_dir_all(c.join("newdir/deep")).unwrap();
        std::os::unix::fs::symlink("conf", t.join("etc/link")).unwrap();
        std::fs::write(c.join("etc/link"), "a file where a link was").unwrap();
        let ino = std::fs::metadata(c.join("etc/conf")).unwrap().ino();
        let s = plan(&t, &c, &c, &[], false, &[]).unwrap();
        assert_eq!(s.len(), 5, "{s:?}");
        s.apply().unwrap();
        assert_eq!(tree(&t), tree(&c));
        assert_eq!(std::fs::metadata(c.join("etc/conf")).unwrap().ino(), ino);
        assert!(plan(&t, &c, &c, &[], false, &[]).unwrap().is_empty());
        let _ = std::fs::remove_dir_all(&d);
    }

    /// Told what changed, the walk skips what did not: a file rewritten in place (same inode)
    /// is found only through the changed set.
    #[test]
    fn changed_inodes_are_the_only_files_looked_at() {
        let (_scratch, d) = tmp("changed");
        let c = d.join("c");
        std::fs::create_dir_all(c.join("dir")).unwrap();
        std::fs::write(c.join("dir/f"), "now").unwrap();
        // The same tree as its own target: nothing differs...
        assert!(plan_changed(&c, &c, &c, &[], true, &[], Some(&HashSet::new())).unwrap().is_empty());
        // ...a rename shows (names differ); an unchanged inode is trusted.
        let ino = std::fs::metadata(c.join("dir/f")).unwrap().ino();
        let none: HashSet<u64> = HashSet::new();
        let one: HashSet<u64> = [ino].into_iter().collect();
        assert!(plan_changed(&c, &c, &c, &[], true, &[], Some(&none)).unwrap().is_empty());
        assert!(
            plan_changed(&c, &c, &c, &[], true, &[], Some(&one)).unwrap().is_empty(),
            "changed but equal on both sides"
        );
        let _ = std::fs::remove_dir_all(&d);
    }

    /// The overlay case: what the writable layer holds now and held not then shows the lower
    /// layer's version again; whiteouts of the statepoint delete.
    #[test]
    fn overlay_layers_put_the_image_back() {
        let (_scratch, d) = tmp("overlay");
        let (t, c, lower, merged) = (d.join("t"), d.join("c"), d.join("lower"), d.join("merged"));
        for x in [&t, &c, &lower, &merged] {
            std::fs::create_dir_all(x).unwrap();
        }
        std::fs::write(lower.join("image-file"), "from the image").unwrap();
        // Now the layer has a changed copy of the image's file (copied up after the statepoint).
        std::fs::write(c.join("image-file"), "changed by the agent").unwrap();
        std::fs::write(merged.join("image-file"), "changed by the agent").unwrap();
        // At the statepoint, a whiteout deleted /gone.
        nix::sys::stat::mknod(
            &t.join("gone"),
            nix::sys::stat::SFlag::S_IFCHR,
            nix::sys::stat::Mode::from_bits_truncate(0o600),
            0,
        )
        .ok();
        if !t.join("gone").exists() && std::fs::symlink_metadata(t.join("gone")).is_err() {
            // No CAP_MKNOD here: the whiteout part is left to the guest tests.
            let _ = std::fs::remove_dir_all(&d);
            return;
        }
        std::fs::write(merged.join("gone"), "recreated").unwrap();
        std::fs::write(c.join("gone"), "recreated").unwrap();
        let s = plan(&t, &c, &merged, std::slice::from_ref(&lower), false, &[]).unwrap();
        s.apply().unwrap();
        assert_eq!(std::fs::read_to_string(merged.join("image-file")).unwrap(), "from the image");
        assert!(!merged.join("gone").exists());
        let _ = std::fs::remove_dir_all(&d);
    }
}
