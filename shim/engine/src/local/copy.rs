//! The files path that works on every host: a copy of the container's writable layer (the
//! overlay upper directory, with its whiteouts and opaque directories, so deletions of image
//! files are captured too), taken while the container is frozen.
//!
//! A copy is whole only the first time. Each copy keeps an index (`rootfs.idx` beside it) of the
//! layer's regular files as they were: device, inode, size, modification and change times. The
//! next copy makes the tree itself (directories, links, devices and their owners, modes, extended
//! attributes and times: no program started), hard-links every file whose index entry still
//! matches from the last copy, copies the others (`cp`, only when there are any), and puts the
//! directories' times back: an unchanged file costs a link, not its bytes, and a layer where
//! nothing changed costs a walk and its links. The change time is
//! the kernel's (no program can set it), and any write, `chmod`, `chown`, xattr or rename of
//! the file moves it; a file changed less than two seconds before a copy is left out of its
//! index (the timestamp's granularity, as git's "racily clean" files), so its next copy is a
//! real one. Statepoint copies are never written (a restore copies them back), so two of them
//! may share a file.
//!
//! What a write does not date: a page of a shared writable mapping that is dirty already takes
//! further writes without a fault, so without a new change time until written back. So a file a
//! process of the container maps shared and writable is always copied, and is written back
//! while frozen (`fdatasync`), which makes its next write fault and date the file again. On
//! tmpfs no mapped write ever dates a file: there every copy is whole. Neither is the index
//! trusted across a reboot or a wall clock set back or forward (the host's clocks kept with it).

use super::files::{InPlaceAt, InPlaceFiles, RestoreGuard, Rootfs};
use super::{Error, Result};
use crate::store::LocalState;
use std::path::{Path, PathBuf};
use std::process::Command;
use sys::proc::Proc;

pub struct CopyRootfs {
    pub upperdir: PathBuf,
    /// The container's store, whose newest committed copy with an index the next one links
    /// unchanged files from; none: every copy is whole.
    pub store: Option<PathBuf>,
    /// Files the container's processes map shared and writable (device major, minor, inode):
    /// always copied.
    pub mapped: std::sync::Mutex<std::collections::HashSet<(u64, u64, u64)>>,
}

impl CopyRootfs {
    pub fn new(upperdir: PathBuf, store: Option<PathBuf>) -> CopyRootfs {
        CopyRootfs { upperdir, store, mapped: Default::default() }
    }
}

/// `cp -a` with `extra` options from `from` to `to` (`--no-target-directory`); the error quotes
/// cp's first line. The one way planarian copies a tree (statepoint files, overlay layers, forks).
pub fn cp(extra: &[&str], from: &Path, to: &Path) -> Result<()> {
    run_cp(from, None, |c| c.arg("-a").args(extra).arg("--no-target-directory").arg(from).arg(to))
}

/// Runs `cp` with the arguments `args` gives it (in `cwd`, if any); the error names `from` and
/// quotes cp's first line.
fn run_cp(from: &Path, cwd: Option<&Path>, args: impl FnOnce(&mut Command) -> &mut Command) -> Result<()> {
    let bin = crate::tools::locate("cp", None, "PATH")?;
    let mut c = Command::new(&bin);
    if let Some(d) = cwd {
        c.current_dir(d);
    }
    let out = args(&mut c).output().map_err(|source| Error::Run { tool: bin, source })?;
    if out.status.success() {
        return Ok(());
    }
    Err(Error::Copy {
        from: from.to_path_buf(),
        why: String::from_utf8_lossy(&out.stderr).lines().next().unwrap_or("").trim().to_string(),
    })
}

fn copy_tree(from: &Path, to: &Path) -> Result<()> {
    // GNU cp -a keeps owners, modes, times, xattrs (trusted.overlay.opaque), hard links,
    // symlinks, and device nodes (overlay whiteouts are 0:0 character devices).
    cp(&["--reflink=auto"], from, to).inspect_err(|_| {
        let _ = std::fs::remove_dir_all(to);
    })
}

impl Rootfs for CopyRootfs {
    fn backend(&self) -> &'static str {
        "copy"
    }

    fn plan(&self, _sp: &str, local: &mut LocalState) {
        local.rootfs_backend = self.backend().into();
        local.rootfs_copy_path = Some("rootfs".into());
        local.rootfs_upperdir = Some(self.upperdir.display().to_string());
        local.zfs_snapshot = None;
    }

    fn processes(&self, pids: &[i32]) {
        *self.mapped.lock().expect("the mapped files") = shared_writable(pids);
    }

    fn snapshot(&self, sp_dir: &Path, local: &LocalState) -> Result<()> {
        let dest = sp_dir.join(local.rootfs_copy_path.as_deref().unwrap_or("rootfs"));
        let since = std::time::SystemTime::now() - RACY;
        let clock = crate::store::Clock::now();
        // (tmpfs: a mapped write never dates a file; no index is kept, every copy is whole)
        let dated = !on_tmpfs(&self.upperdir);
        let base = self.store.as_deref().filter(|_| dated).and_then(|s| last_copy(s, sp_dir, clock.as_ref()));
        let mapped = self.mapped.lock().expect("the mapped files").clone();
        let copied = match &base {
            Some((copy, index)) => incremental(&self.upperdir, &dest, copy, index, &mapped, since),
            None => {
                copy_tree(&self.upperdir, &dest).and_then(|()| Ok(index_of(&walk(&self.upperdir)?, &mapped, since)))
            }
        };
        let written = match (dated, clock) {
            (true, Some(clock)) => copied.and_then(|index| write_index(&sp_dir.join(INDEX), &clock, &index)),
            _ => copied.map(drop),
        };
        if written.is_err() {
            let _ = std::fs::remove_dir_all(&dest);
            let _ = std::fs::remove_file(sp_dir.join(INDEX));
        }
        written
    }

    fn discard(&self, sp_dir: &Path, local: &LocalState) {
        let _ = std::fs::remove_dir_all(sp_dir.join(local.rootfs_copy_path.as_deref().unwrap_or("rootfs")));
        let _ = std::fs::remove_file(sp_dir.join(INDEX));
    }

    fn restore(&self, sp_dir: &Path, local: &LocalState) -> Result<RestoreGuard> {
        let saved = sp_dir.join(local.rootfs_copy_path.as_deref().unwrap_or("rootfs"));
        if !saved.exists() {
            return Err(Error::FilesMissing(saved));
        }
        if crate::runtime::container::upperdir_mounted(&self.upperdir) {
            return Err(Error::FilesMounted(self.upperdir.clone()));
        }
        let name = self.upperdir.file_name().unwrap_or_default().to_string_lossy().into_owned();
        let parent = self.upperdir.parent().unwrap_or(Path::new("/"));
        let fresh = parent.join(format!("{name}.planarian-new"));
        let old = parent.join(format!("{name}.planarian-old"));
        // A planarian killed between the two renames below: the old copy is the upper dir.
        if !self.upperdir.exists() && old.is_dir() {
            sys::Context::at(std::fs::rename(&old, &self.upperdir), "put the previous files back at", &self.upperdir)?;
        }
        let _ = std::fs::remove_dir_all(&fresh);
        copy_tree(&saved, &fresh)?;
        // A leftover from a crash: the current upper dir is the truth, drop the old copy.
        let _ = std::fs::remove_dir_all(&old);
        sys::Context::at(std::fs::rename(&self.upperdir, &old), "move aside", &self.upperdir)?;
        if let Err(e) = std::fs::rename(&fresh, &self.upperdir) {
            let _ = std::fs::rename(&old, &self.upperdir);
            return Err(sys::IoError::new("put the statepoint's files in place at", &self.upperdir, e).into());
        }
        let current = self.upperdir.clone();
        let previous = old.clone();
        Ok(RestoreGuard::new(
            Box::new(move || {
                let _ = std::fs::remove_dir_all(&current);
                Ok(sys::Context::at(std::fs::rename(&previous, &current), "put the previous files back at", &current)?)
            }),
            Box::new(move || {
                let _ = std::fs::remove_dir_all(old);
            }),
        ))
    }

    /// Started as soon as the container is frozen: the comparison in a thread of its own, beside
    /// the page plan (it only reads).
    fn in_place_start(
        &self,
        sp_dir: &Path,
        local: &LocalState,
        at: &InPlaceAt,
        _prepared: Option<super::files::InPlaceStart>,
    ) -> Option<super::files::InPlaceStart> {
        let (saved, upper, at) = (saved_of(sp_dir, local), self.upperdir.clone(), at.clone());
        let thread: Planning = std::thread::spawn(move || compare(&saved, &upper, &at));
        Some(super::files::InPlaceStart::new(thread))
    }

    fn in_place(
        &self,
        sp_dir: &Path,
        local: &LocalState,
        at: &InPlaceAt,
        start: Option<super::files::InPlaceStart>,
    ) -> Result<InPlaceFiles> {
        let sync = match start.and_then(|s| s.work.downcast::<Planning>().ok()) {
            Some(thread) => thread.join().unwrap_or_else(|p| std::panic::resume_unwind(p))?,
            None => compare(&saved_of(sp_dir, local), &self.upperdir, at)?,
        };
        Ok(InPlaceFiles { sync, cleanup: None, leftovers: vec![] })
    }
}

/// Beside a statepoint's copy: the index of the layer's files it was copied from.
pub const INDEX: &str = "rootfs.idx";
const MAGIC: &[u8] = b"planarian rootfs index 1\n";
/// How recent a change may be for a file to be left out of the index (racily clean).
const RACY: std::time::Duration = std::time::Duration::from_secs(2);

/// What identifies a regular file's content without reading it: device, inode, size, and its
/// modification and change times (seconds, nanoseconds).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Key([i64; 7]);

impl Key {
    fn of(md: &std::fs::Metadata) -> Key {
        use std::os::unix::fs::MetadataExt;
        Key([
            md.dev() as i64,
            md.ino() as i64,
            md.size() as i64,
            md.mtime(),
            md.mtime_nsec(),
            md.ctime(),
            md.ctime_nsec(),
        ])
    }

    /// Changed at or after `since` (or the clock says so): not to be trusted by the next copy.
    fn racy(&self, since: std::time::SystemTime) -> bool {
        let changed = std::time::UNIX_EPOCH
            .checked_add(std::time::Duration::new(self.0[5].max(0) as u64, self.0[6].clamp(0, 999_999_999) as u32));
        changed.is_none_or(|c| c >= since)
    }
}

type Index = std::collections::HashMap<PathBuf, Key>;

/// Every entry of the tree at `root` (its relative path and metadata, `root` itself first as
/// ""), parents before children.
fn walk(root: &Path) -> Result<Vec<(PathBuf, std::fs::Metadata)>> {
    let io = |p: &Path, e| Error::from(sys::IoError::new("read", p.to_path_buf(), e));
    let mut out = vec![(PathBuf::new(), std::fs::symlink_metadata(root).map_err(|e| io(root, e))?)];
    let mut i = 0;
    while i < out.len() {
        if out[i].1.is_dir() {
            let rel = out[i].0.clone();
            let dir = root.join(&rel);
            let mut names: Vec<_> =
                std::fs::read_dir(&dir).map_err(|e| io(&dir, e))?.flatten().map(|e| e.file_name()).collect();
            names.sort();
            for n in names {
                let p = dir.join(&n);
                out.push((rel.join(&n), std::fs::symlink_metadata(&p).map_err(|e| io(&p, e))?));
            }
        }
        i += 1;
    }
    Ok(out)
}

/// The index of the regular files among `entries`, those changed since `since` and those
/// `mapped` shared and writable left out.
fn index_of(entries: &[(PathBuf, std::fs::Metadata)], mapped: &Mapped, since: std::time::SystemTime) -> Index {
    entries
        .iter()
        .filter(|(_, md)| md.is_file() && !is_mapped(md, mapped))
        .map(|(rel, md)| (rel.clone(), Key::of(md)))
        .filter(|(_, k)| !k.racy(since))
        .collect()
}

type Mapped = std::collections::HashSet<(u64, u64, u64)>;

fn is_mapped(md: &std::fs::Metadata, mapped: &Mapped) -> bool {
    use std::os::unix::fs::MetadataExt;
    let dev = md.dev();
    mapped.contains(&(nix::sys::stat::major(dev), nix::sys::stat::minor(dev), md.ino()))
}

/// The files processes `pids` map shared and writable (`/proc/PID/maps`: `rw?s`), each written
/// back now (`fdatasync` through `/proc/PID/map_files`), so that its next write through the
/// mapping faults and dates the file again.
fn shared_writable(pids: &[i32]) -> Mapped {
    let mut out = Mapped::new();
    for pid in pids {
        let proc = Proc::of(*pid);
        let Ok(maps) = proc.maps() else { continue };
        for m in maps {
            if m.prot & sys::proc::PROT_WRITE == 0 || !m.shared || m.inode == 0 {
                continue;
            }
            if out.insert((m.dev.0, m.dev.1, m.inode)) {
                if let Ok(file) = proc.open(&format!("map_files/{}", m.range_name())) {
                    let _ = file.sync_data();
                }
            }
        }
    }
    out
}

/// Whether `dir` is on tmpfs.
fn on_tmpfs(dir: &Path) -> bool {
    nix::sys::statfs::statfs(dir).is_ok_and(|s| s.filesystem_type() == nix::sys::statfs::TMPFS_MAGIC)
}

fn write_index(path: &Path, clock: &crate::store::Clock, index: &Index) -> Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let mut buf = MAGIC.to_vec();
    let c = serde_json::to_vec(clock).expect("a clock serialises");
    buf.extend((c.len() as u32).to_le_bytes());
    buf.extend(c);
    for (rel, k) in index {
        let b = rel.as_os_str().as_bytes();
        buf.extend((b.len() as u32).to_le_bytes());
        buf.extend(b);
        k.0.iter().for_each(|x| buf.extend(x.to_le_bytes()));
    }
    Ok(sys::write_atomic(path, &buf, 0o600)?)
}

/// The index a copy kept, and the host's clocks when it was made.
fn read_index(path: &Path) -> Option<(crate::store::Clock, Index)> {
    use std::os::unix::ffi::OsStrExt;
    let buf = std::fs::read(path).ok()?;
    let mut rest = buf.strip_prefix(MAGIC)?;
    let n = u32::from_le_bytes(rest.get(..4)?.try_into().ok()?) as usize;
    let clock = serde_json::from_slice(rest.get(4..4 + n)?).ok()?;
    rest = &rest[4 + n..];
    let mut out = Index::new();
    while !rest.is_empty() {
        let n = u32::from_le_bytes(rest.get(..4)?.try_into().ok()?) as usize;
        let rel = PathBuf::from(std::ffi::OsStr::from_bytes(rest.get(4..4 + n)?));
        rest = &rest[4 + n..];
        let mut k = [0i64; 7];
        for x in &mut k {
            *x = i64::from_le_bytes(rest.get(..8)?.try_into().ok()?);
            rest = &rest[8..];
        }
        out.insert(rel, Key(k));
    }
    Some((clock, out))
}

/// The newest committed statepoint of `store` (other than `this`) with a copy and its index,
/// made while the wall clock kept time up to `now`: the copy's path and the index.
fn last_copy(store: &Path, this: &Path, now: Option<&crate::store::Clock>) -> Option<(PathBuf, Index)> {
    let sps = store.join("statepoints");
    let mut dirs: Vec<(u64, PathBuf)> = std::fs::read_dir(&sps)
        .ok()?
        .flatten()
        .filter_map(|e| Some((e.file_name().to_str()?.strip_prefix("sp")?.parse().ok()?, e.path())))
        .filter(|(_, p)| p != this && p.join(INDEX).is_file())
        .collect();
    dirs.sort();
    dirs.into_iter().rev().find_map(|(_, dir)| {
        let m = crate::store::read_manifest(&dir.join("manifest.json")).ok()?;
        let copy = dir.join(m.local_state.rootfs_copy_path.as_deref()?);
        (m.status == crate::store::Status::Committed && copy.is_dir()).then_some(())?;
        let (then, index) = read_index(&dir.join(INDEX))?;
        // (a second of slack: two readings of two clocks)
        then.kept_time_to(now?, 1.0).then_some((copy, index))
    })
}

/// The copy of `upper` at `dest` with every file `index` says unchanged hard-linked from `base`
/// (an earlier copy), files `mapped` shared and writable copied whatever the index says; returns
/// the new copy's index.
fn incremental(
    upper: &Path,
    dest: &Path,
    base: &Path,
    index: &Index,
    mapped: &Mapped,
    since: std::time::SystemTime,
) -> Result<Index> {
    use std::os::unix::fs::MetadataExt;
    let entries = walk(upper)?;
    // The tree, every attribute of every entry but the regular files'.
    make_tree(upper, dest, &entries)?;
    // Names of one inode (hard links in the layer) are linked or copied together, so that they
    // stay one file.
    let mut groups: std::collections::BTreeMap<(u64, u64), (&std::fs::Metadata, Vec<&Path>)> = Default::default();
    for (rel, md) in entries.iter().filter(|(_, md)| md.is_file()) {
        groups.entry((md.dev(), md.ino())).or_insert((md, Vec::new())).1.push(rel);
    }
    let mut changed: Vec<Vec<&Path>> = Vec::new();
    for (md, names) in groups.into_values() {
        let unchanged = !is_mapped(md, mapped)
            && names.iter().all(|rel| {
                index.get(*rel) == Some(&Key::of(md))
                    && std::fs::symlink_metadata(base.join(rel)).is_ok_and(|b| b.is_file() && b.len() == md.len())
            });
        if !(unchanged && names.iter().all(|rel| std::fs::hard_link(base.join(rel), dest.join(rel)).is_ok())) {
            // (every name taken out: cp makes the group anew, as one)
            for rel in &names {
                let _ = std::fs::remove_file(dest.join(rel));
            }
            changed.push(names);
        }
    }
    // The others, with their bytes (one cp for many, a group never split between two: `--parents`
    // names them under `dest`).
    let mut batch: Vec<&Path> = Vec::new();
    let mut groups = changed.into_iter().peekable();
    while let Some(g) = groups.next() {
        batch.extend(g);
        if batch.len() < 1000 && groups.peek().is_some() {
            continue;
        }
        run_cp(upper, Some(upper), |c| {
            c.args(["-a", "--reflink=auto", "--parents", "-t"]).arg(dest).arg("--").args(&batch)
        })?;
        batch.clear();
    }
    // A link put in a directory moved its times: back to the layer's, deepest first.
    for (rel, md) in entries.iter().rev().filter(|(_, md)| md.is_dir()) {
        let p = dest.join(rel);
        super::treesync::set_times(md, &p)
            .map_err(|e| Error::from(sys::IoError::new("set the times of", p.clone(), e)))?;
    }
    Ok(index_of(&entries, mapped, since))
}

/// Every entry of `entries` (a [`walk`] of `from`) but the regular files made at `to`, new: each
/// directory with its owner, mode and extended attributes (the overlay's `trusted.overlay.*`:
/// an opaque directory stays one), each symbolic link, device (a whiteout is a 0:0 character
/// device), FIFO and socket with its times too. Directories' times are the caller's to set, once
/// their entries are in.
fn make_tree(from: &Path, to: &Path, entries: &[(PathBuf, std::fs::Metadata)]) -> Result<()> {
    for (rel, md) in entries.iter().filter(|(_, md)| !md.is_file()) {
        let dst = to.join(rel);
        make_entry(&from.join(rel), &dst, md).map_err(|(what, e)| Error::from(sys::IoError::new(what, dst, e)))?;
    }
    Ok(())
}

/// [`make_tree`]'s entry `to`, as `from` (whose metadata is `md`) is: on failure, what failed.
fn make_entry(
    from: &Path,
    to: &Path,
    md: &std::fs::Metadata,
) -> std::result::Result<(), (&'static str, std::io::Error)> {
    use super::treesync::{make_node, set_meta};
    let at = |what: &'static str| move |e: std::io::Error| (what, e);
    let ft = md.file_type();
    if ft.is_dir() {
        std::fs::create_dir(to).map_err(at("create"))?;
    } else if ft.is_symlink() {
        std::os::unix::fs::symlink(std::fs::read_link(from).map_err(at("read the link"))?, to).map_err(at("create"))?;
    } else {
        make_node(md, to).map_err(at("create"))?;
    }
    set_meta(md, to).map_err(at("set the owner, mode and times of"))?;
    copy_xattrs(from, to).map_err(at("set the extended attributes of"))
}

/// The extended attributes of `from` onto `to` (neither followed if a link). As `cp -a`, one
/// that cannot be set is left out, except the overlay's own (`trusted.overlay.*`: an opaque
/// directory that stopped being one would show the image's files again).
fn copy_xattrs(from: &Path, to: &Path) -> std::io::Result<()> {
    use nix::libc;
    use std::os::unix::ffi::OsStrExt;
    let c = |p: &Path| std::ffi::CString::new(p.as_os_str().as_bytes()).map_err(std::io::Error::other);
    let (src, dst) = (c(from)?, c(to)?);
    let names = xattr_names(&src)?;
    for name in &names {
        let cname = std::ffi::CString::new(name.as_slice()).map_err(std::io::Error::other)?;
        let value = xattr_value(&src, &cname)?;
        // SAFETY: valid path and name, a buffer of the given length.
        let set = unsafe { libc::lsetxattr(dst.as_ptr(), cname.as_ptr(), value.as_ptr().cast(), value.len(), 0) };
        if set != 0 && name.starts_with(b"trusted.overlay.") {
            return Err(std::io::Error::last_os_error());
        }
    }
    // An entry made in a directory with a default ACL has that ACL: not the source's, if it has none.
    for name in xattr_names(&dst)?.into_iter().filter(|n| n.starts_with(b"system.posix_acl_") && !names.contains(n)) {
        let cname = std::ffi::CString::new(name).map_err(std::io::Error::other)?;
        // SAFETY: valid path and name.
        if unsafe { libc::lremovexattr(dst.as_ptr(), cname.as_ptr()) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// The value of extended attribute `name` of `path` (not followed).
fn xattr_value(path: &std::ffi::CStr, name: &std::ffi::CStr) -> std::io::Result<Vec<u8>> {
    let mut value = vec![0u8; 256];
    loop {
        // SAFETY: valid path and name, a buffer of the given length.
        let len = unsafe { nix::libc::lgetxattr(path.as_ptr(), name.as_ptr(), value.as_mut_ptr().cast(), value.len()) };
        let e = std::io::Error::last_os_error();
        if len >= 0 {
            value.truncate(len as usize);
            return Ok(value);
        }
        if e.raw_os_error() != Some(nix::libc::ERANGE) || value.len() >= 1 << 16 {
            return Err(e);
        }
        value.resize(value.len() * 4, 0);
    }
}

/// The names of the extended attributes of `path` (not followed); none where the file system
/// has none.
fn xattr_names(path: &std::ffi::CStr) -> std::io::Result<Vec<Vec<u8>>> {
    use nix::libc;
    let mut names = vec![0u8; 1024];
    loop {
        // SAFETY: a valid path and a buffer of the given length.
        let n = unsafe { libc::llistxattr(path.as_ptr(), names.as_mut_ptr().cast(), names.len()) };
        if n >= 0 {
            names.truncate(n as usize);
            return Ok(names.split(|b| *b == 0).filter(|n| !n.is_empty()).map(<[u8]>::to_vec).collect());
        }
        let e = std::io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::ENOTSUP) => return Ok(Vec::new()),
            Some(libc::ERANGE) if names.len() < 1 << 20 => names.resize(names.len() * 4, 0),
            _ => return Err(e),
        }
    }
}

/// The comparison a rollback in place began early.
type Planning = std::thread::JoinHandle<Result<super::treesync::Sync>>;

/// Where a statepoint keeps its copy of the writable layer.
fn saved_of(sp_dir: &Path, local: &LocalState) -> std::path::PathBuf {
    sp_dir.join(local.rootfs_copy_path.as_deref().unwrap_or("rootfs"))
}

/// The statepoint's copy of the writable layer (`saved`) against the live one (`upper`), the
/// changes to be written through the container's root.
fn compare(saved: &Path, upper: &Path, at: &InPlaceAt) -> Result<super::treesync::Sync> {
    if !saved.is_dir() {
        return Err(Error::FilesMissing(saved.to_path_buf()));
    }
    if at.lowers.is_empty() {
        return Err(Error::InPlaceFiles("the container's root is not an overlay with lower layers".into()));
    }
    Ok(super::treesync::plan(saved, upper, &at.root, &at.lowers, false, &at.mounted)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    /// What a tree holds, entry by entry: type, mode, owner, size, modification time, the bytes
    /// of files and the targets of links (no inode, no access time).
    fn tree(root: &Path) -> Vec<String> {
        walk(root)
            .unwrap()
            .into_iter()
            .map(|(rel, md)| {
                let what = if md.is_file() {
                    String::from_utf8_lossy(&std::fs::read(root.join(&rel)).unwrap()).into_owned()
                } else if md.is_symlink() {
                    std::fs::read_link(root.join(&rel)).unwrap().display().to_string()
                } else {
                    String::new()
                };
                let t = if md.is_symlink() { (0, 0) } else { (md.mtime(), md.mtime_nsec()) };
                let (dev, xattrs) = (md.rdev(), xattrs(&root.join(&rel)));
                format!(
                    "{} {:o} {}:{} {} {t:?} {dev} {xattrs:?} {what}",
                    rel.display(),
                    md.mode(),
                    md.uid(),
                    md.gid(),
                    md.len()
                )
            })
            .collect()
    }

    /// The extended attributes of `p` (not followed), names and values: read here, not by the
    /// code under test.
    fn xattrs(p: &Path) -> Vec<(String, Vec<u8>)> {
        use std::os::unix::ffi::OsStrExt;
        let c = std::ffi::CString::new(p.as_os_str().as_bytes()).unwrap();
        let mut names = vec![0u8; 4096];
        // SAFETY: a valid path and a buffer of the given length.
        let n = unsafe { nix::libc::llistxattr(c.as_ptr(), names.as_mut_ptr().cast(), names.len()) };
        names.truncate(n.max(0) as usize);
        let mut out: Vec<_> = names
            .split(|b| *b == 0)
            .filter(|n| !n.is_empty())
            .map(|n| {
                let name = std::ffi::CString::new(n).unwrap();
                let mut v = vec![0u8; 4096];
                // SAFETY: valid path and name, a buffer of the given length.
                let len = unsafe { nix::libc::lgetxattr(c.as_ptr(), name.as_ptr(), v.as_mut_ptr().cast(), v.len()) };
                v.truncate(len.max(0) as usize);
                (String::from_utf8_lossy(n).into_owned(), v)
            })
            .collect();
        out.sort();
        out
    }

    #[test]
    fn a_copy_links_what_did_not_change_and_equals_a_whole_one() {
        let scratch = tempfile::tempdir().unwrap();
        let base = scratch.path().join("incremental");
        let upper = base.join("diff");
        std::fs::create_dir_all(upper.join("a/deep")).unwrap();
        std::fs::write(upper.join("a/f1"), "one").unwrap();
        std::fs::write(upper.join("a/f2"), "two").unwrap();
        std::fs::write(upper.join("a/deep/f5"), "five").unwrap();
        std::fs::hard_link(upper.join("a/f1"), upper.join("a/f3")).unwrap();
        std::os::unix::fs::symlink("f1", upper.join("a/l")).unwrap();
        // What an overlay's layer holds beside files: a whiteout (a 0:0 character device), an
        // opaque directory, and a FIFO, a directory with its own owner and mode.
        use nix::sys::stat::{mknod, Mode, SFlag};
        mknod(&upper.join("a/gone"), SFlag::S_IFCHR, Mode::empty(), 0).unwrap();
        mknod(&upper.join("a/fifo"), SFlag::S_IFIFO, Mode::from_bits_truncate(0o640), 0).unwrap();
        std::fs::create_dir(upper.join("opaque")).unwrap();
        let c = std::ffi::CString::new(upper.join("opaque").into_os_string().into_encoded_bytes()).unwrap();
        // SAFETY: a valid path, name and one-byte value.
        let set =
            unsafe { nix::libc::lsetxattr(c.as_ptr(), c"trusted.overlay.opaque".as_ptr(), b"y".as_ptr().cast(), 1, 0) };
        assert_eq!(set, 0, "{}", std::io::Error::last_os_error());
        std::os::unix::fs::lchown(upper.join("opaque"), Some(1000), Some(1000)).unwrap();
        std::fs::set_permissions(upper.join("opaque"), std::os::unix::fs::PermissionsExt::from_mode(0o2750)).unwrap();
        let later = std::time::SystemTime::now() + std::time::Duration::from_secs(3600);
        let none = Mapped::new();
        // Files changed just now are racily clean: left out of the index.
        assert!(index_of(&walk(&upper).unwrap(), &none, std::time::SystemTime::now() - RACY).is_empty());

        let sp1 = base.join("sp1");
        copy_tree(&upper, &sp1).unwrap();
        let index = index_of(&walk(&upper).unwrap(), &none, later);
        assert_eq!(index.len(), 4);
        let clock = crate::store::Clock::now().unwrap();
        write_index(&base.join(INDEX), &clock, &index).unwrap();
        assert_eq!(read_index(&base.join(INDEX)).unwrap(), (clock, index.clone()));

        std::fs::write(upper.join("a/f2"), "TWO").unwrap();
        std::fs::write(upper.join("a/f4"), "four").unwrap();
        std::fs::remove_file(upper.join("a/deep/f5")).unwrap();
        std::fs::set_permissions(upper.join("a/f1"), std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
        std::fs::write(upper.join("a/deep/f6"), "six").unwrap();
        let sp2 = base.join("sp2");
        let index2 = incremental(&upper, &sp2, &sp1, &index, &none, later).unwrap();
        assert_eq!(tree(&sp2), tree(&upper), "the copy holds what the layer holds");
        let ino = |p: PathBuf| std::fs::metadata(p).unwrap().ino();
        assert_ne!(ino(sp2.join("a/f2")), ino(sp1.join("a/f2")), "a changed file is copied");
        assert_ne!(ino(sp2.join("a/f1")), ino(sp1.join("a/f1")), "a chmod is a change");
        assert_eq!(ino(sp2.join("a/f1")), ino(sp2.join("a/f3")), "hard links within the layer stay links");

        // Nothing changed since: every file is a link, and the copy still equals the layer.
        let sp3 = base.join("sp3");
        let index3 = incremental(&upper, &sp3, &sp2, &index2, &none, later).unwrap();
        assert_eq!(tree(&sp3), tree(&upper));
        for f in ["a/f1", "a/f2", "a/f3", "a/f4", "a/deep/f6"] {
            assert_eq!(ino(sp3.join(f)), ino(sp2.join(f)), "{f} is linked");
        }
        assert_eq!(std::fs::read_to_string(sp1.join("a/f2")).unwrap(), "two", "an earlier copy keeps its bytes");

        // A file mapped shared and writable takes writes its times may not show: always copied.
        let f4 = std::fs::OpenOptions::new().read(true).write(true).open(upper.join("a/f4")).unwrap();
        use nix::libc;
        use std::os::fd::AsRawFd;
        // SAFETY: a fresh shared mapping of a 4-byte file, written within its length, unmapped below.
        let map = unsafe {
            libc::mmap(std::ptr::null_mut(), 4, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, f4.as_raw_fd(), 0)
        };
        assert_ne!(map, libc::MAP_FAILED);
        unsafe { *map.cast::<u8>() = b'F' };
        let mapped = shared_writable(&[std::process::id() as i32]);
        assert!(is_mapped(&std::fs::metadata(upper.join("a/f4")).unwrap(), &mapped), "{mapped:?}");
        let sp4 = base.join("sp4");
        let index4 = incremental(&upper, &sp4, &sp3, &index3, &mapped, later).unwrap();
        assert_eq!(std::fs::read_to_string(sp4.join("a/f4")).unwrap(), "Four");
        assert_ne!(ino(sp4.join("a/f4")), ino(sp3.join("a/f4")), "a mapped file is copied");
        assert!(!index4.contains_key(Path::new("a/f4")), "and never trusted by the next copy");
        assert_eq!(ino(sp4.join("a/f1")), ino(sp3.join("a/f1")));
        // SAFETY: the mapping made above, of that length.
        assert_eq!(unsafe { libc::munmap(map, 4) }, 0);
    }

    #[test]
    fn copy_snapshot_and_restore_are_exact_and_undoable() {
        let scratch = tempfile::tempdir().unwrap();
        let base = scratch.path().join("rootfs");
        let upper = base.join("diff");
        std::fs::create_dir_all(upper.join("etc")).unwrap();
        std::fs::write(upper.join("etc/app.conf"), "v1").unwrap();
        std::os::unix::fs::symlink("app.conf", upper.join("etc/link")).unwrap();
        let r = CopyRootfs::new(upper.clone(), None);
        let mut local = LocalState::default();
        r.plan("sp1", &mut local);
        let sp1 = base.join("sp1");
        std::fs::create_dir_all(&sp1).unwrap();
        r.snapshot(&sp1, &local).unwrap();

        std::fs::write(upper.join("etc/app.conf"), "v2").unwrap();
        std::fs::write(upper.join("new-file"), "x").unwrap();
        let guard = r.restore(&sp1, &local).unwrap();
        assert_eq!(std::fs::read_to_string(upper.join("etc/app.conf")).unwrap(), "v1");
        assert!(!upper.join("new-file").exists());
        assert_eq!(std::fs::read_link(upper.join("etc/link")).unwrap(), Path::new("app.conf"));
        guard.undo().unwrap();
        assert_eq!(std::fs::read_to_string(upper.join("etc/app.conf")).unwrap(), "v2");
        assert!(upper.join("new-file").exists());

        let guard = r.restore(&sp1, &local).unwrap();
        guard.commit();
        assert!(!base.join("diff.planarian-old").exists());
        assert_eq!(std::fs::read_to_string(upper.join("etc/app.conf")).unwrap(), "v1");

        // A planarian killed between moving the upper dir aside and putting the copy in place.
        std::fs::write(upper.join("etc/app.conf"), "v3").unwrap();
        std::fs::rename(&upper, base.join("diff.planarian-old")).unwrap();
        let guard = r.restore(&sp1, &local).unwrap();
        assert_eq!(std::fs::read_to_string(upper.join("etc/app.conf")).unwrap(), "v1");
        guard.undo().unwrap();
        assert_eq!(std::fs::read_to_string(upper.join("etc/app.conf")).unwrap(), "v3", "the old copy was the truth");
    }
}
