//! The container's `/dev`: a small tmpfs the runtime fills (device nodes, the std* links,
//! mount points for pts, shm, mqueue), kept by planarian instead of CRIU.
//!
//! CRIU archives every tmpfs it dumps by running `tar --gzip` (a fork and two execs, and for a
//! mount with children a scratch mount namespace), at every dump, and extracts it at every
//! restore: for `/dev`, a fixed cost larger than an incremental memory dump of a quiet sandbox.
//! Here the dump records `/dev` as an external mount and planarian reads the tmpfs itself while
//! the container is frozen (beside CRIU, with the files), into `dev.json` + `dev.data` in the
//! statepoint. A restore mounts a fresh tmpfs with the same options, fills it, and hands it to
//! CRIU as that external mount; CRIU mounts `/dev/pts` and the others on top as before.
//!
//! Kept: directories, regular files (contents), symbolic links, character and block devices,
//! FIFOs, hard links, owners, permission bits (set-id and sticky too) and modification times.
//! Not kept, as with CRIU's tar: sockets, extended attributes. What a child mount covers is
//! recorded as an empty placeholder (the child mount is CRIU's). A `/dev` that is not one tmpfs
//! is left to CRIU.

use super::{Error, Result};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use sys::proc::Mount;
use sys::Context;

/// The key under which a dump records `/dev` as an external mount.
pub const KEY: &str = "planarian-dev";
const INDEX: &str = "dev.json";
const DATA: &str = "dev.data";

#[derive(Debug, Serialize, Deserialize, PartialEq)]
pub struct Index {
    /// The tmpfs's own options (`size=65536k,mode=755`), to mount its successor.
    pub options: String,
    /// Depth first, parents before children; the first entry is `/dev` itself (path "").
    pub entries: Vec<Entry>,
}

#[derive(Debug, Serialize, Deserialize, PartialEq)]
pub struct Entry {
    pub path: String,
    pub kind: Kind,
    /// st_mode's permission bits, set-id and sticky bits included.
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub mtime: (i64, i64),
    #[serde(default, skip_serializing_if = "is_zero")]
    pub rdev: u64,
    /// A symbolic link's target.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
    /// A regular file's contents: offset and length in `dev.data`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<(u64, u64)>,
    /// Another name of an earlier entry (a hard link).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link: Option<String>,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    Dir,
    File,
    Symlink,
    Char,
    Block,
    Fifo,
}

/// `/dev` of the container whose init is `pid`, when it is one tmpfs planarian can keep: its
/// superblock options and the mount points below it.
pub struct DevMount {
    pub options: String,
    pub children: Vec<String>,
}

/// From the container's mount table ([`sys::proc::Proc::mounts`]).
pub fn dev_mount(mounts: &[Mount]) -> Option<DevMount> {
    let [dev] = &mounts.iter().filter(|m| m.point == "/dev").collect::<Vec<_>>()[..] else { return None };
    if dev.fstype != "tmpfs" {
        return None;
    }
    let options = dev.super_options.split(',').filter(|o| *o != "rw" && *o != "ro").collect::<Vec<_>>().join(",");
    let children = mounts.iter().filter_map(|m| m.point.strip_prefix("/dev/").map(String::from)).collect();
    Some(DevMount { options, children })
}

/// Records the tmpfs at `/proc/PID/root/dev` into `dir` (`dev.json`, `dev.data`). The container
/// is frozen. Files are written then renamed into place, so a half-written archive never counts.
pub fn save(pid: i32, dev: &DevMount, dir: &Path) -> Result<()> {
    save_from(&sys::proc::Proc::of(pid).root().join("dev"), dev, dir)
}

/// The kind an entry is kept as; `None` for a socket. What a child mount covers is an empty
/// placeholder file.
fn kind_of(ft: std::fs::FileType, covered: bool) -> Option<Kind> {
    Some(if ft.is_dir() {
        Kind::Dir
    } else if covered || ft.is_file() {
        Kind::File
    } else if ft.is_symlink() {
        Kind::Symlink
    } else if ft.is_char_device() {
        Kind::Char
    } else if ft.is_block_device() {
        Kind::Block
    } else if ft.is_fifo() {
        Kind::Fifo
    } else {
        return None;
    })
}

impl Entry {
    /// The entry of `path`, of kind `kind`, with its metadata `md` (no target, data or link yet).
    fn of(path: String, kind: Kind, md: &std::fs::Metadata) -> Entry {
        Entry {
            path,
            kind,
            mode: md.mode() & 0o7777,
            uid: md.uid(),
            gid: md.gid(),
            mtime: (md.mtime(), md.mtime_nsec()),
            rdev: if matches!(kind, Kind::Char | Kind::Block) { md.rdev() } else { 0 },
            target: None,
            data: None,
            link: None,
        }
    }
}

fn save_from(root: &Path, dev: &DevMount, dir: &Path) -> Result<()> {
    let tmp_data = dir.join(format!("{DATA}.tmp"));
    let mut data = std::io::BufWriter::new(std::fs::File::create(&tmp_data).at("create", &tmp_data)?);
    let mut index = Index { options: dev.options.clone(), entries: vec![] };
    let mut seen: HashMap<(u64, u64), String> = HashMap::new();
    let mut offset = 0u64;
    let mut stack = vec![String::new()];
    while let Some(rel) = stack.pop() {
        let path = if rel.is_empty() { root.to_path_buf() } else { root.join(&rel) };
        let md = std::fs::symlink_metadata(&path).at("read", &path)?;
        let covered = dev.children.iter().any(|c| c == &rel);
        // (a socket: nothing to keep, as with tar)
        let Some(kind) = kind_of(md.file_type(), covered) else { continue };
        let mut e = Entry::of(rel.clone(), kind, &md);
        if !covered && kind != Kind::Dir && md.nlink() > 1 {
            if let Some(first) = seen.get(&(md.dev(), md.ino())) {
                e.link = Some(first.clone());
                index.entries.push(e);
                continue;
            }
            seen.insert((md.dev(), md.ino()), rel.clone());
        }
        match kind {
            Kind::Symlink => {
                e.target = Some(std::fs::read_link(&path).at("read", &path)?.to_string_lossy().into_owned())
            }
            Kind::File if !covered => {
                let mut f = std::fs::File::open(&path).at("read", &path)?;
                let n = std::io::copy(&mut f, &mut data).at("copy", &path)?;
                e.data = Some((offset, n));
                offset += n;
            }
            Kind::Dir if !covered => {
                let mut names: Vec<String> = std::fs::read_dir(&path)
                    .at("read", &path)?
                    .filter_map(|d| d.ok().map(|d| d.file_name().to_string_lossy().into_owned()))
                    .collect();
                names.sort_unstable_by(|a, b| b.cmp(a));
                stack.extend(names.into_iter().map(|n| if rel.is_empty() { n } else { format!("{rel}/{n}") }));
            }
            _ => {}
        }
        index.entries.push(e);
    }
    data.into_inner().map_err(|e| e.into_error()).and_then(|f| f.sync_all()).at("write", &tmp_data)?;
    std::fs::rename(&tmp_data, dir.join(DATA)).at("write", dir.join(DATA))?;
    let text = serde_json::to_string(&index).map_err(|source| Error::Json { what: INDEX.into(), source })?;
    Ok(sys::write_atomic(&dir.join(INDEX), text.as_bytes(), 0o600)?)
}

/// Whether statepoint directory `dir` holds a `/dev` of planarian's.
pub fn saved(dir: &Path) -> bool {
    dir.join(INDEX).is_file()
}

/// Copies a statepoint's `/dev` into another statepoint directory (hard links when it can).
pub fn link(from: &Path, to: &Path) -> Result<()> {
    for f in [INDEX, DATA] {
        if from.join(f).exists() && std::fs::hard_link(from.join(f), to.join(f)).is_err() {
            std::fs::copy(from.join(f), to.join(f)).at("copy", from.join(f))?;
        }
    }
    Ok(())
}

/// A tmpfs filled from a statepoint, mounted (private) at a scratch path for CRIU to bind; it
/// is detached when dropped, the container's bind staying.
pub struct Restored {
    pub path: PathBuf,
}

impl Restored {
    pub fn mount(sp_dir: &Path, at: &Path) -> Result<Restored> {
        use nix::mount::{mount, MsFlags};
        let index: Index = serde_json::from_slice(&std::fs::read(sp_dir.join(INDEX)).at("read", sp_dir.join(INDEX))?)
            .map_err(|source| Error::Json { what: sp_dir.join(INDEX).display().to_string(), source })?;
        std::fs::create_dir_all(at).at("create", at)?;
        mount(Some("tmpfs"), at, Some("tmpfs"), MsFlags::empty(), Some(index.options.as_str()))
            .map_err(|source| Error::DevMount { at: at.to_path_buf(), options: index.options.clone(), source })?;
        let r = Restored { path: at.to_path_buf() };
        let _ = mount(None::<&str>, at, None::<&str>, MsFlags::MS_PRIVATE, None::<&str>);
        let mut data = std::fs::File::open(sp_dir.join(DATA)).at("read", sp_dir.join(DATA))?;
        fill(&index, &mut data, at)?;
        Ok(r)
    }
}

impl Drop for Restored {
    fn drop(&mut self) {
        let _ = nix::mount::umount2(&self.path, nix::mount::MntFlags::MNT_DETACH);
        let _ = std::fs::remove_dir(&self.path);
    }
}

/// Recreates `index` under `root`: entries, then owners and modes, then times (directories
/// last, deepest first, so filling them does not change them again).
fn fill(index: &Index, data: &mut (impl Read + std::io::Seek), root: &Path) -> Result<()> {
    use nix::sys::stat::{mknod, Mode, SFlag};
    use std::os::unix::fs::PermissionsExt;
    let at = |p: &str| if p.is_empty() { root.to_path_buf() } else { root.join(p) };
    let err = |p: &Path, e: &dyn std::fmt::Display| Error::DevEntry { path: p.to_path_buf(), why: e.to_string() };
    for e in &index.entries {
        let p = at(&e.path);
        if let Some(first) = &e.link {
            std::fs::hard_link(at(first), &p).map_err(|x| err(&p, &x))?;
            continue;
        }
        match e.kind {
            Kind::Dir if e.path.is_empty() => Ok(()),
            Kind::Dir => std::fs::create_dir(&p).map_err(|x| err(&p, &x)),
            Kind::File => {
                let mut f = std::fs::File::create(&p).map_err(|x| err(&p, &x))?;
                if let Some((off, len)) = e.data {
                    data.seek(std::io::SeekFrom::Start(off)).map_err(|x| err(&p, &x))?;
                    let n = std::io::copy(&mut data.take(len), &mut f).map_err(|x| err(&p, &x))?;
                    if n != len {
                        return Err(err(&p, &"dev.data is short"));
                    }
                }
                f.flush().map_err(|x| err(&p, &x))
            }
            Kind::Symlink => {
                std::os::unix::fs::symlink(e.target.as_deref().unwrap_or_default(), &p).map_err(|x| err(&p, &x))
            }
            Kind::Char | Kind::Block | Kind::Fifo => {
                let kind = match e.kind {
                    Kind::Char => SFlag::S_IFCHR,
                    Kind::Block => SFlag::S_IFBLK,
                    _ => SFlag::S_IFIFO,
                };
                mknod(&p, kind, Mode::from_bits_truncate(0o600), e.rdev as nix::libc::dev_t).map_err(|x| err(&p, &x))
            }
        }?;
    }
    for e in index.entries.iter().filter(|e| e.link.is_none()) {
        let p = at(&e.path);
        std::os::unix::fs::lchown(&p, Some(e.uid), Some(e.gid)).map_err(|x| err(&p, &x))?;
        if e.kind != Kind::Symlink {
            // After chown, which clears set-id bits.
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(e.mode)).map_err(|x| err(&p, &x))?;
        }
    }
    for e in index.entries.iter().rev().filter(|e| e.link.is_none()) {
        let p = at(&e.path);
        let t = nix::sys::time::TimeSpec::new(e.mtime.0, e.mtime.1);
        nix::sys::stat::utimensat(nix::fcntl::AT_FDCWD, &p, &t, &t, nix::sys::stat::UtimensatFlags::NoFollowSymlink)
            .map_err(|x| err(&p, &x))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tree like a Podman /dev (in a plain directory: device nodes need root, so a FIFO stands
    /// in for them), recorded and recreated entry for entry.
    #[test]
    fn records_and_recreates_a_tree() {
        let scratch = tempfile::tempdir().unwrap();
        let base = scratch.path().join("devfs");
        let (src, out) = (base.join("proc/root/dev"), base.join("out"));
        std::fs::create_dir_all(src.join("shm")).unwrap();
        std::fs::create_dir_all(src.join("pts")).unwrap();
        std::fs::write(src.join("pts/ptmx"), "covered by a mount").unwrap();
        std::fs::write(src.join("agent-note"), "written by the agent\n").unwrap();
        std::fs::hard_link(src.join("agent-note"), src.join("again")).unwrap();
        std::os::unix::fs::symlink("/proc/self/fd", src.join("fd")).unwrap();
        nix::unistd::mkfifo(&src.join("pipe"), nix::sys::stat::Mode::from_bits_truncate(0o640)).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(src.join("shm"), std::fs::Permissions::from_mode(0o1777)).unwrap();
        let t = nix::sys::time::TimeSpec::new(1_700_000_000, 5);
        nix::sys::stat::utimensat(
            nix::fcntl::AT_FDCWD,
            &src.join("agent-note"),
            &t,
            &t,
            nix::sys::stat::UtimensatFlags::NoFollowSymlink,
        )
        .unwrap();

        // Recorded through a path shaped like /proc/PID/root/dev.
        let dev = DevMount { options: "size=65536k,mode=755".into(), children: vec!["pts".into()] };
        let index = {
            let dir = base.join("sp");
            std::fs::create_dir_all(&dir).unwrap();
            save_from(&src, &dev, &dir).unwrap();
            let i: Index = serde_json::from_slice(&std::fs::read(dir.join(INDEX)).unwrap()).unwrap();
            std::fs::create_dir_all(&out).unwrap();
            fill(&i, &mut std::fs::File::open(dir.join(DATA)).unwrap(), &out).unwrap();
            i
        };
        assert_eq!(index.options, "size=65536k,mode=755");
        assert_eq!(std::fs::read_to_string(out.join("agent-note")).unwrap(), "written by the agent\n");
        let (a, b) =
            (std::fs::metadata(out.join("agent-note")).unwrap(), std::fs::metadata(out.join("again")).unwrap());
        assert_eq!((a.ino(), a.nlink()), (b.ino(), 2), "hard link kept");
        assert_eq!(a.mtime(), 1_700_000_000);
        assert_eq!(std::fs::read_link(out.join("fd")).unwrap(), Path::new("/proc/self/fd"));
        assert!(std::fs::symlink_metadata(out.join("pipe")).unwrap().file_type().is_fifo());
        assert_eq!(std::fs::metadata(out.join("pipe")).unwrap().mode() & 0o7777, 0o640);
        assert_eq!(std::fs::metadata(out.join("shm")).unwrap().mode() & 0o7777, 0o1777);
        // The mount point of a child mount is a placeholder: its contents are the mount's.
        assert!(std::fs::symlink_metadata(out.join("pts")).unwrap().is_dir());
        assert_eq!(std::fs::read_dir(out.join("pts")).unwrap().count(), 0);
    }
}
