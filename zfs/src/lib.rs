//! Every ZFS operation planarian performs, through the `zfs` command line (OpenZFS and zfs-fuse
//! speak the same one), with typed errors that carry the command and its stderr; a snapshot and
//! the incremental stream a rollback in place reads go through OpenZFS's libzfs_core where it is
//! installed ([`lzc`]), without a process; a statepoint's snapshot is mounted read-only by
//! mount(2) where the kernel's ZFS can ([`mount_snapshot`]).
//!
//! Only what works on pool version 23 (zfs-fuse) is used: no `clones` or `written` properties;
//! dependants are found through `origin`, and deferred destruction (`destroy -d`) keeps a
//! snapshot a clone still needs.

pub mod lzc;
pub mod stream;

use std::path::{Path, PathBuf};
use std::process::Command;
use sys::proc::Mount;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// The pool is out of space.
    NoSpace,
    /// A mount is in use, or a dataset has dependants.
    Busy,
    /// The dataset or snapshot does not exist.
    NotFound,
    Other,
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot run {bin}: {err}")]
    Spawn { bin: PathBuf, err: std::io::Error },
    #[error("`zfs {args}` failed: {stderr}")]
    Command { args: String, stderr: String, kind: Kind },
}

impl Error {
    pub fn kind(&self) -> Kind {
        match self {
            Error::Spawn { .. } => Kind::Other,
            Error::Command { kind, .. } => *kind,
        }
    }
}

fn classify(stderr: &str) -> Kind {
    let s = stderr.to_ascii_lowercase();
    if s.contains("out of space") || s.contains("no space left") {
        Kind::NoSpace
    } else if s.contains("busy") || s.contains("has dependent clones") || s.contains("has children") {
        Kind::Busy
    } else if s.contains("does not exist") || s.contains("no such") {
        Kind::NotFound
    } else {
        Kind::Other
    }
}

pub type Result<T> = std::result::Result<T, Error>;

/// Which ZFS the `zfs` program drives: what a pool of version 23 forced on planarian is lifted
/// where OpenZFS allows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavour {
    /// OpenZFS's kernel module (`zfs version` answers).
    OpenZfs,
    /// zfs-fuse (no `version` command): a rename remounts the clones of the renamed dataset's
    /// snapshots, and fails while one is in use.
    ZfsFuse,
}

/// The `zfs` program, found by absolute path by the caller.
#[derive(Debug, Clone)]
pub struct Zfs {
    pub bin: PathBuf,
}

/// A property's value and where it comes from (`local`, `default`, `inherited from …`, `-`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Property {
    pub value: String,
    pub source: String,
}

impl Property {
    pub fn is_local(&self) -> bool {
        self.source == "local"
    }
}

impl Zfs {
    pub fn new(bin: impl Into<PathBuf>) -> Zfs {
        Zfs { bin: bin.into() }
    }

    /// Runs `zfs ARGS`, returning stdout.
    pub fn run(&self, args: &[&str]) -> Result<String> {
        // Errors are classified by their text: in English whatever the caller's locale.
        let out = Command::new(&self.bin)
            .args(args)
            .env("LC_ALL", "C")
            .output()
            .map_err(|err| Error::Spawn { bin: self.bin.clone(), err })?;
        if out.status.success() {
            return Ok(String::from_utf8_lossy(&out.stdout).into_owned());
        }
        Err(failure(args, &out.stderr))
    }

    /// Which ZFS this is (asked once per call: only operations that can be refused ask).
    pub fn flavour(&self) -> Flavour {
        let out = Command::new(&self.bin).arg("version").env("LC_ALL", "C").output();
        match out {
            Ok(o) if o.status.success() => Flavour::OpenZfs,
            _ => Flavour::ZfsFuse,
        }
    }

    pub fn exists(&self, name: &str) -> Result<bool> {
        match self.run(&["list", "-H", "-o", "name", "-t", "all", name]) {
            Ok(_) => Ok(true),
            Err(e) if e.kind() == Kind::NotFound => Ok(false),
            Err(e) => Err(e),
        }
    }

    pub fn create(&self, name: &str, props: &[(&str, &str)]) -> Result<()> {
        let opts = options(props);
        let mut args: Vec<&str> = vec!["create"];
        args.extend(opts.iter().map(String::as_str));
        args.push(name);
        self.run(&args).map(drop)
    }

    /// `zfs snapshot SNAP` (through libzfs_core where it is there: [`lzc`]).
    pub fn snapshot(&self, snap: &str) -> Result<()> {
        match lzc::Core::get() {
            Some(c) => c.snapshot(snap).map_err(|e| errno_failure(&["snapshot", snap], e)),
            None => self.run(&["snapshot", snap]).map(drop),
        }
    }

    pub fn clone_snapshot(&self, snap: &str, name: &str, props: &[(&str, &str)]) -> Result<()> {
        let opts = options(props);
        let mut args: Vec<&str> = vec!["clone"];
        args.extend(opts.iter().map(String::as_str));
        args.push(snap);
        args.push(name);
        self.run(&args).map(drop)
    }

    /// A read-only clone of `snap` named `name`, mounted at `mountpoint` (which exists):
    /// `zfs clone -o mountpoint=MOUNTPOINT -o readonly=on SNAP NAME`. (What a rollback in place
    /// reads the statepoint's files from on zfs-fuse, which mounts no snapshot.)
    pub fn clone_read_only(&self, snap: &str, name: &str, mountpoint: &Path) -> Result<()> {
        let Some(mp) = mountpoint.to_str() else {
            return Err(errno_failure(&["clone", snap, name], libc::EINVAL));
        };
        self.clone_snapshot(snap, name, &[("mountpoint", mp), ("readonly", "on")])
    }

    pub fn promote(&self, name: &str) -> Result<()> {
        self.run(&["promote", name]).map(drop)
    }

    pub fn rename(&self, from: &str, to: &str) -> Result<()> {
        self.run(&["rename", from, to]).map(drop)
    }

    pub fn mount(&self, name: &str) -> Result<()> {
        self.run(&["mount", name]).map(drop)
    }

    pub fn unmount(&self, name: &str) -> Result<()> {
        self.run(&["umount", name]).map(drop)
    }

    pub fn get(&self, name: &str, prop: &str) -> Result<Property> {
        let out = self.run(&["get", "-H", "-o", "value,source", prop, name])?;
        let line = out.lines().next().unwrap_or("");
        let (value, source) = line.split_once('\t').unwrap_or((line, "-"));
        Ok(Property { value: value.to_string(), source: source.to_string() })
    }

    /// A numeric property in bytes (`-p`).
    pub fn get_bytes(&self, name: &str, prop: &str) -> Result<u64> {
        let out = self.run(&["get", "-H", "-p", "-o", "value", prop, name])?;
        Ok(out.trim().parse().unwrap_or(0))
    }

    pub fn set(&self, name: &str, prop: &str, value: &str) -> Result<()> {
        self.run(&["set", &format!("{prop}={value}"), name]).map(drop)
    }

    pub fn inherit(&self, name: &str, prop: &str) -> Result<()> {
        self.run(&["inherit", prop, name]).map(drop)
    }

    /// Puts a property back the way `p` was: set when it was local, inherited otherwise.
    pub fn restore_property(&self, name: &str, prop: &str, p: &Property) -> Result<()> {
        if p.is_local() {
            self.set(name, prop, &p.value)
        } else {
            self.inherit(name, prop)
        }
    }

    /// Destroys a dataset (with its snapshots when `recursive`).
    pub fn destroy(&self, name: &str, recursive: bool) -> Result<()> {
        if recursive {
            self.run(&["destroy", "-r", name]).map(drop)
        } else {
            self.run(&["destroy", name]).map(drop)
        }
    }

    /// Destroys a snapshot now, or — when a clone still depends on it — once the last one is gone.
    pub fn destroy_snapshot(&self, snap: &str) -> Result<()> {
        self.run(&["destroy", "-d", snap]).map(drop)
    }

    /// Every snapshot in the pool of `dataset` (or below `root`), by full name.
    pub fn snapshots(&self, root: &str) -> Result<Vec<String>> {
        let out = self.run(&["list", "-H", "-o", "name", "-t", "snapshot", "-r", root])?;
        Ok(out.lines().map(String::from).filter(|l| !l.is_empty()).collect())
    }

    /// The snapshot below `root` whose `guid` is `guid` (a snapshot keeps it when renamed or
    /// received elsewhere: the common ground of an incremental stream).
    pub fn snapshot_by_guid(&self, root: &str, guid: &str) -> Result<Option<String>> {
        // (`get -p`: exact numbers; zfs-fuse's `list` prints guids rounded, e.g. 9.26E.)
        let out = self.run(&["get", "-H", "-p", "-r", "-o", "name,value", "guid", root])?;
        Ok(out
            .lines()
            .filter_map(|l| l.split_once('\t'))
            .find(|(n, g)| n.contains('@') && g.trim() == guid)
            .map(|(n, _)| n.to_string()))
    }

    /// A dataset's or snapshot's `guid`, exactly.
    pub fn guid(&self, name: &str) -> Result<String> {
        Ok(self.run(&["get", "-H", "-p", "-o", "value", "guid", name])?.trim().to_string())
    }

    /// Filesystems below `root` (itself included) with their origin snapshot, if clones.
    pub fn filesystems(&self, root: &str) -> Result<Vec<(String, Option<String>)>> {
        let out = self.run(&["list", "-H", "-o", "name,origin", "-t", "filesystem", "-r", root])?;
        Ok(out
            .lines()
            .filter_map(|l| l.split_once('\t'))
            .map(|(n, o)| (n.to_string(), Some(o.to_string()).filter(|o| o != "-")))
            .collect())
    }
}

impl Zfs {
    /// `zfs send SNAP` (incremental from `from`, a snapshot of the same dataset's history, when
    /// given) into `out`.
    pub fn send(&self, snap: &str, from: Option<&str>, out: std::fs::File) -> Result<()> {
        let mut args = vec!["send"];
        if let Some(f) = from {
            args.extend(["-i", f]);
        }
        args.push(snap);
        self.piped(&args, std::process::Stdio::null(), out.into())
    }

    /// The objects (inode numbers, for a file system) that differ between snapshot `from` and
    /// the later snapshot `snap` of the same history, with the znode of each file and directory
    /// among them: what an incremental `zfs send` carries, read as it comes ([`stream::read`]).
    /// Objects freed wholesale (deleted files) are not listed: their names are gone from a
    /// directory that is.
    pub fn changes(&self, from: &str, snap: &str) -> Result<stream::Changes> {
        if let Some(c) = lzc::Core::get() {
            let args = ["send", "-i", from, snap];
            let read = |f| stream::read(std::io::BufReader::with_capacity(1 << 16, f));
            return match c.send(from, snap, read) {
                Ok(Ok(changes)) => Ok(changes),
                Ok(Err(e)) => Err(unread(&args, e)),
                Err(e) => Err(errno_failure(&args, e)),
            };
        }
        self.changes_by_command(from, snap)
    }

    /// [`Zfs::changes`] through `zfs send -i` (where libzfs_core is not there).
    pub fn changes_by_command(&self, from: &str, snap: &str) -> Result<stream::Changes> {
        let args = ["send", "-i", from, snap];
        let mut child = Command::new(&self.bin)
            .args(args)
            .env("LC_ALL", "C")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .map_err(|err| Error::Spawn { bin: self.bin.clone(), err })?;
        let read = stream::read(std::io::BufReader::with_capacity(1 << 16, child.stdout.take().expect("piped")));
        if read.is_err() {
            let _ = child.kill();
        }
        let out = child.wait_with_output().map_err(|err| Error::Spawn { bin: self.bin.clone(), err })?;
        match read {
            Ok(changes) if out.status.success() => Ok(changes),
            Ok(_) => Err(failure(&args, &out.stderr)),
            Err(e) => Err(unread(&args, e)),
        }
    }

    /// The objects of [`Zfs::changes`] alone.
    pub fn changed_objects(&self, from: &str, snap: &str) -> Result<std::collections::HashSet<u64>> {
        Ok(self.changes(from, snap)?.objects.into_keys().collect())
    }

    /// A tool of the ZFS tools beside `zfs` (the same installation), else found in PATH.
    fn beside(&self, tool: &str) -> PathBuf {
        self.bin.parent().map(|d| d.join(tool)).filter(|p| p.exists()).unwrap_or_else(|| PathBuf::from(tool))
    }

    /// Where objects of snapshot `snap` (a file system's) are in its tree, read with
    /// `zdb -dddd SNAP OBJECT...` (beside `zfs`; `-ddddd` on OpenZFS), which follows each object's parent pointers in
    /// the snapshot. Every object asked for must exist in `snap` (zdb stops at one that does
    /// not, which is an error here).
    ///
    /// zdb's answer takes a fraction of its run: on its way out it waits up to a second for its
    /// cache's reclaim thread (a timed wait nobody cuts short). So, where `stdbuf` is there, zdb
    /// writes line by line and is asked for the master node once more after the objects: when
    /// that object's header arrives, the answer is complete and zdb is stopped (it only reads
    /// the pool).
    pub fn object_paths(&self, snap: &str, objects: &[u64]) -> Result<Vec<ObjectInfo>> {
        use std::io::BufRead;
        let zdb = self.beside("zdb");
        // (OpenZFS's zdb prints an object's path from five `d`s on, zfs-fuse's from four)
        let detail = match self.flavour() {
            Flavour::OpenZfs => "-ddddd",
            Flavour::ZfsFuse => "-dddd",
        };
        let mut args = vec![detail.to_string(), snap.to_string()];
        args.extend(objects.iter().map(u64::to_string));
        let failed = |found: usize, err: &str| Error::Command {
            args: format!("zdb {detail} {snap} ({} objects)", objects.len()),
            stderr: format!("{found} of {} objects read; {}", objects.len(), err.trim()),
            kind: Kind::Other,
        };
        let Some(stdbuf) = in_path("stdbuf") else {
            let out = Command::new(&zdb)
                .args(&args)
                .env("LC_ALL", "C")
                .output()
                .map_err(|err| Error::Spawn { bin: zdb.clone(), err })?;
            let found = parse_zdb_objects(&String::from_utf8_lossy(&out.stdout));
            if !out.status.success() || found.len() != objects.len() {
                return Err(failed(found.len(), &String::from_utf8_lossy(&out.stderr)));
            }
            return Ok(found);
        };
        args.push("1".into());
        let mut child = Command::new(&stdbuf)
            .arg("-oL")
            .arg(&zdb)
            .args(&args)
            .env("LC_ALL", "C")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .map_err(|err| Error::Spawn { bin: stdbuf.clone(), err })?;
        let out = std::io::BufReader::new(child.stdout.take().expect("piped"));
        let (mut text, mut headers) = (String::new(), 0);
        for line in out.lines() {
            let Ok(line) = line else { break };
            if is_object_header(&line) {
                headers += 1;
                if headers > objects.len() {
                    // The master node again: everything asked for came.
                    let _ = child.kill();
                    let _ = child.wait();
                    let found = parse_zdb_objects(&text);
                    return if found.len() == objects.len() { Ok(found) } else { Err(failed(found.len(), "")) };
                }
            }
            text.push_str(&line);
            text.push('\n');
        }
        let status = child.wait();
        let found = parse_zdb_objects(&text);
        Err(failed(found.len(), if status.is_ok_and(|s| s.success()) { "" } else { "zdb failed" }))
    }

    /// `zfs receive DATASET` from `input`: DATASET is created with the stream's snapshot (or,
    /// for an incremental stream, gets it on top of the snapshot the stream starts from).
    pub fn receive(&self, dataset: &str, input: std::fs::File) -> Result<()> {
        self.piped(&["receive", dataset], input.into(), std::process::Stdio::null())
    }

    /// `zfs receive -F DATASET`: an incremental stream into a dataset whose newest snapshot is
    /// where the stream starts (rolled back to it first).
    pub fn receive_force(&self, dataset: &str, input: std::fs::File) -> Result<()> {
        self.piped(&["receive", "-F", dataset], input.into(), std::process::Stdio::null())
    }

    fn piped(&self, args: &[&str], stdin: std::process::Stdio, stdout: std::process::Stdio) -> Result<()> {
        let out = Command::new(&self.bin)
            .args(args)
            .env("LC_ALL", "C")
            .stdin(stdin)
            .stdout(stdout)
            .stderr(std::process::Stdio::piped())
            .output()
            .map_err(|err| Error::Spawn { bin: self.bin.clone(), err })?;
        if out.status.success() {
            return Ok(());
        }
        Err(failure(args, &out.stderr))
    }
}

/// Mounts OpenZFS's `dataset` (a snapshot) read-only at `at` by mount(2), as `zfs mount` does
/// (`zfsutil`: asked by a ZFS tool, not by `mount`), and `nosuid,nodev,noexec`: a read-only view
/// of a container's files runs nothing of theirs on the host. `Err(errno)`.
fn mount_read_only(dataset: &str, at: &Path) -> std::result::Result<(), i32> {
    use std::os::unix::ffi::OsStrExt;
    let (src, target) = (std::ffi::CString::new(dataset), std::ffi::CString::new(at.as_os_str().as_bytes()));
    let (Ok(src), Ok(target)) = (src, target) else { return Err(libc::EINVAL) };
    let flags = libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
    // SAFETY: NUL-terminated strings that outlive the call.
    let r = unsafe { libc::mount(src.as_ptr(), target.as_ptr(), c"zfs".as_ptr(), flags, c"zfsutil".as_ptr().cast()) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO))
    }
}

/// Whether ZFS is the kernel's own (OpenZFS's module), which mounts a snapshot as it is: read-only,
/// as under `.zfs/snapshot`. zfs-fuse mounts none.
pub fn kernel_zfs() -> bool {
    Path::new("/sys/module/zfs").is_dir()
}

/// Mounts snapshot `snap` read-only at the directory `at` by mount(2), as `.zfs/snapshot` mounts
/// it (OpenZFS only, [`kernel_zfs`]): no clone is made, so no transaction group is waited for.
/// While it is mounted the snapshot cannot be destroyed: [`unmount_at`] first.
pub fn mount_snapshot(snap: &str, at: &Path) -> Result<()> {
    let args = format!("mount {snap}");
    let failed = |e: i32, kind| {
        let stderr = format!("mount(2) at {}: {}", at.display(), std::io::Error::from_raw_os_error(e));
        Error::Command { args: args.clone(), stderr, kind }
    };
    // (ENOENT from mount(2) is the snapshot's only once the mount point is known to be there)
    if !at.is_dir() {
        return Err(failed(libc::ENOENT, Kind::Other));
    }
    mount_read_only(snap, at).map_err(|e| failed(e, errno_kind(e)))
}

/// Unmounts what is mounted at `at` (the mount on top): `Err(errno)`, `EINVAL` when nothing is.
pub fn unmount_at(at: &Path) -> std::result::Result<(), i32> {
    use std::os::unix::ffi::OsStrExt;
    let Ok(target) = std::ffi::CString::new(at.as_os_str().as_bytes()) else { return Err(libc::EINVAL) };
    // SAFETY: a NUL-terminated string that outlives the call.
    if unsafe { libc::umount2(target.as_ptr(), libc::UMOUNT_NOFOLLOW) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO))
    }
}

/// A failed command's error: its first line says what went wrong (zfs-fuse follows it with the
/// whole usage text).
fn failure(args: &[&str], stderr: &[u8]) -> Error {
    let stderr = String::from_utf8_lossy(stderr);
    let stderr = stderr.lines().map(str::trim).find(|l| !l.is_empty()).unwrap_or("(no message)").to_string();
    Error::Command { args: args.join(" "), kind: classify(&stderr), stderr }
}

/// A send stream that could not be read.
fn unread(args: &[&str], e: stream::StreamError) -> Error {
    Error::Command { args: args.join(" "), stderr: e.to_string(), kind: Kind::Other }
}

/// A libzfs_core call that failed with `errno`, as the command it stands for.
fn errno_failure(args: &[&str], errno: i32) -> Error {
    let stderr = format!("libzfs_core: {}", std::io::Error::from_raw_os_error(errno));
    Error::Command { args: args.join(" "), stderr, kind: errno_kind(errno) }
}

/// What an errno from the kernel's ZFS says, as the command's message would.
fn errno_kind(errno: i32) -> Kind {
    match errno {
        libc::ENOSPC | libc::EDQUOT => Kind::NoSpace,
        libc::EBUSY => Kind::Busy,
        libc::ENOENT => Kind::NotFound,
        _ => Kind::Other,
    }
}

fn options(props: &[(&str, &str)]) -> Vec<String> {
    props.iter().flat_map(|(k, v)| ["-o".to_string(), format!("{k}={v}")]).collect()
}

/// One object of a file system, as `zdb -dddd` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectInfo {
    pub object: u64,
    /// Its type as zdb names it (`ZFS plain file`, `ZFS directory`, `ZFS master node`, ...).
    pub kind: String,
    /// Where it is: a path from the file system's root; `None` for an object that is no file
    /// (no path line), `Some("???<object#N>")` for one no directory holds (unlinked, still open).
    pub path: Option<String>,
    pub links: Option<u64>,
    /// The master node's `ROOT` entry: the object of the file system's root directory (which
    /// zdb shows at `/`, like the other directories no directory holds).
    pub root: Option<u64>,
}

impl ObjectInfo {
    pub fn is_dir(&self) -> bool {
        self.kind == "ZFS directory"
    }

    /// Not in the tree: no file at all, or unlinked.
    pub fn unlinked(&self) -> bool {
        self.path.as_deref().is_none_or(|p| p.starts_with("???"))
    }
}

/// The objects of `zdb -dddd` output: each starts at the line under an `Object  lvl ...` header
/// (number first, type last) and may have `\tpath\t...` and `\tlinks\t...` lines.
pub fn parse_zdb_objects(text: &str) -> Vec<ObjectInfo> {
    let mut out: Vec<ObjectInfo> = Vec::new();
    let mut header = false;
    for line in text.lines() {
        if is_object_header(line) {
            header = true;
            continue;
        }
        if header {
            header = false;
            let mut words = line.split_whitespace();
            if let Some(object) = words.next().and_then(|w| w.parse().ok()) {
                // number, then its sizes and %full (six columns, or seven with OpenZFS's dnsize:
                // each begins with a digit), then the type's words.
                let kind =
                    words.skip_while(|w| w.starts_with(|c: char| c.is_ascii_digit())).collect::<Vec<_>>().join(" ");
                out.push(ObjectInfo { object, kind, path: None, links: None, root: None });
            }
            continue;
        }
        let Some(last) = out.last_mut() else { continue };
        if let Some(p) = line.strip_prefix("\tpath\t") {
            last.path = Some(p.to_string());
        } else if let Some(n) = line.strip_prefix("\tlinks\t") {
            last.links = n.trim().parse().ok();
        } else if let Some(n) = line.trim_start().strip_prefix("ROOT = ").filter(|_| last.kind == "ZFS master node") {
            last.root = n.trim().parse().ok();
        }
    }
    out
}

/// zdb's header line before each object (`    Object  lvl   iblk ...  type`).
fn is_object_header(line: &str) -> bool {
    line.trim_start().starts_with("Object ") && line.contains(" type")
}

/// `tool` in PATH, if it is there.
fn in_path(tool: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH").unwrap_or_else(|| "/usr/bin:/bin".into()))
        .map(|d| d.join(tool))
        .find(|p| p.is_file())
}

/// The pool a dataset or snapshot belongs to.
pub fn pool_of(name: &str) -> &str {
    name.split(['/', '@']).next().unwrap_or(name)
}

/// The dataset part of a snapshot name.
pub fn dataset_of(snap: &str) -> &str {
    snap.split('@').next().unwrap_or(snap)
}

/// The ZFS mounts (OpenZFS: type `zfs`; zfs-fuse: `fuse.zfs`) of a mount table, in mount order.
fn zfs_mounts(mounts: &[Mount]) -> impl DoubleEndedIterator<Item = &Mount> {
    mounts.iter().filter(|m| m.fstype == "zfs" || m.fstype == "fuse.zfs")
}

/// The ZFS dataset mounted exactly at `path`, from a mount table ([`sys::proc::Proc::mounts`], or
/// a process's).
pub fn dataset_mounted_at(mounts: &[Mount], path: &Path) -> Option<String> {
    let want = path.to_str()?.trim_end_matches('/');
    let want = if want.is_empty() { "/" } else { want };
    // The last matching line is the mount on top.
    zfs_mounts(mounts).rev().find(|m| m.point == want).map(|m| m.source.clone())
}

/// Where `dataset` is mounted: every mount point of it, in mount order (a bind of the dataset's
/// root shows up as a second one; a bind of one of its directories is not one).
pub fn mounts_of(mounts: &[Mount], dataset: &str) -> Vec<PathBuf> {
    zfs_mounts(mounts).filter(|m| m.source == dataset && m.root == "/").map(|m| PathBuf::from(&m.point)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOUNTINFO: &str = "\
42 29 0:37 / /tank rw,relatime - fuse.zfs tank rw,user_id=0,group_id=0,default_permissions,allow_other
43 42 0:38 / /tank/sb rw,relatime - fuse.zfs tank/sb rw,user_id=0,group_id=0
44 29 0:38 /data /mnt/data rw,relatime - fuse.zfs tank/sb rw,user_id=0,group_id=0
50 29 0:40 / /srv/my\\040box rw - zfs pool/my\\040box rw,xattr
60 29 0:45 / /var/lib/containers/storage/overlay/abc/merged rw - overlay overlay rw,lowerdir=/l/A,upperdir=/u,workdir=/w
";

    /// As zfs-fuse's zdb prints it (trimmed): a system object without a path, the root, a
    /// file, a file unlinked while open.
    const ZDB: &str = "\
Dataset tp/ds@s3 [ZPL], ID 37, cr_txg 23, 1000K, 210 objects, rootbp DVA[0]=<0:19e000:1000> [L0 DMU objset]

    Object  lvl   iblk   dblk  dsize  lsize   %full  type
         1    1    16K    512     8K    512  100.00  ZFS master node
\tdnode flags: USED_BYTES USERUSED_ACCOUNTED\x20
\tmicrozap: 512 bytes, 6 entries

\t\tROOT = 3\x20

    Object  lvl   iblk   dblk  dsize  lsize   %full  type
         3    1    16K    512     8K    512  100.00  ZFS directory
                                        264   bonus  ZFS znode
\tpath\t/
\tparent\t3
\tlinks\t4

    Object  lvl   iblk   dblk  dsize  lsize   %full  type
       209    1    16K    512     4K    512  100.00  ZFS plain file
                                        264   bonus  ZFS znode
\tpath\t/a/b/c/deep name
\tmode\t100644
\tlinks\t1

    Object  lvl   iblk   dblk  dsize  lsize   %full  type
        19    1    16K    512     4K    512  100.00  ZFS plain file
                                        264   bonus  ZFS znode
\tpath\t???<object#19>
\tlinks\t0
";

    /// OpenZFS 2.3's `zdb -ddddd` (a dnsize column, block pointers after each object).
    const ZDB_OPENZFS: &str = "\
    Object  lvl   iblk   dblk  dsize  dnsize  lsize   %full  type
         1    1   128K    512     1K     512    512  100.00  ZFS master node
\tdnode flags: USED_BYTES USERUSED_ACCOUNTED USEROBJUSED_ACCOUNTED 
\tmicrozap: 512 bytes, 7 entries

\t\tVERSION = 5 
\t\tROOT = 34 
Indirect blocks:
               0 L0 0:12800:200 200L/200P F=1 B=9/9 cksum=00000006af39cf97

    Object  lvl   iblk   dblk  dsize  dnsize  lsize   %full  type
         4    1   128K    512      0     512    512  100.00  ZFS plain file
                                               176   bonus  System attributes
\tdnode flags: USED_BYTES USERUSED_ACCOUNTED USEROBJUSED_ACCOUNTED 
\tpath\t/hard
\tuid     0
\tparent\t34
\tlinks\t2
Indirect blocks:
               0 L0 EMBEDDED et=0 200L/13P B=10

    Object  lvl   iblk   dblk  dsize  dnsize  lsize   %full  type
         2    1   128K    512      0     512    512  100.00  ZFS directory
                                               176   bonus  System attributes
\tpath\t/x1
\tlinks\t3
\t\tx2 = 3 (type: Directory)
";

    #[test]
    fn openzfs_zdb_objects_give_their_paths_too() {
        let o = parse_zdb_objects(ZDB_OPENZFS);
        let view: Vec<_> = o.iter().map(|o| (o.object, o.kind.as_str(), o.path.as_deref(), o.links)).collect();
        assert_eq!(o[0].root, Some(34));
        assert_eq!(
            view,
            [
                (1, "ZFS master node", None, None),
                (4, "ZFS plain file", Some("/hard"), Some(2)),
                (2, "ZFS directory", Some("/x1"), Some(3)),
            ]
        );
    }

    #[test]
    fn zdb_objects_give_their_paths() {
        let o = parse_zdb_objects(ZDB);
        let view: Vec<_> = o
            .iter()
            .map(|o| (o.object, o.kind.as_str(), o.path.as_deref(), o.links, o.is_dir(), o.unlinked()))
            .collect();
        assert_eq!(o[0].root, Some(3));
        assert_eq!(
            view,
            [
                (1, "ZFS master node", None, None, false, true),
                (3, "ZFS directory", Some("/"), Some(4), true, false),
                (209, "ZFS plain file", Some("/a/b/c/deep name"), Some(1), false, false),
                (19, "ZFS plain file", Some("???<object#19>"), Some(0), false, true),
            ]
        );
    }

    #[test]
    fn finds_the_dataset_mounted_exactly_at_a_path() {
        assert_eq!(
            dataset_mounted_at(&sys::proc::parse_mountinfo(MOUNTINFO), Path::new("/tank/sb")).as_deref(),
            Some("tank/sb")
        );
        assert_eq!(
            dataset_mounted_at(&sys::proc::parse_mountinfo(MOUNTINFO), Path::new("/tank/sb/")).as_deref(),
            Some("tank/sb")
        );
        assert_eq!(
            dataset_mounted_at(&sys::proc::parse_mountinfo(MOUNTINFO), Path::new("/srv/my box")).as_deref(),
            Some("pool/my box")
        );
        assert_eq!(dataset_mounted_at(&sys::proc::parse_mountinfo(MOUNTINFO), Path::new("/tank/sb/sub")), None);
        assert_eq!(mounts_of(&sys::proc::parse_mountinfo(MOUNTINFO), "tank/sb"), vec![PathBuf::from("/tank/sb")]);
        assert_eq!(
            mounts_of(&sys::proc::parse_mountinfo(MOUNTINFO), "pool/my box"),
            vec![PathBuf::from("/srv/my box")]
        );
        assert!(
            mounts_of(&sys::proc::parse_mountinfo(MOUNTINFO), "tank/none").is_empty()
                && mounts_of(&sys::proc::parse_mountinfo(MOUNTINFO), "overlay").is_empty()
        );
        assert_eq!(
            dataset_mounted_at(
                &sys::proc::parse_mountinfo(MOUNTINFO),
                Path::new("/var/lib/containers/storage/overlay/abc/merged")
            ),
            None
        );
    }

    #[test]
    fn names() {
        assert_eq!(pool_of("tank/a/b@s"), "tank");
        assert_eq!(dataset_of("tank/a/b@s"), "tank/a/b");
        assert_eq!(options(&[("mountpoint", "none")]), vec!["-o", "mountpoint=none"]);
    }

    #[test]
    fn errors_are_classified_from_stderr() {
        assert_eq!(classify("cannot create snapshot 'tank/sb@full': out of space"), Kind::NoSpace);
        assert_eq!(classify("cannot unmount '/tank/sb': Device or resource busy"), Kind::Busy);
        assert_eq!(classify("cannot rename 'tank/sb.new': dataset is busy"), Kind::Busy);
        assert_eq!(classify("cannot open 'tank/x': dataset does not exist"), Kind::NotFound);
    }

    #[test]
    fn a_missing_program_and_a_failing_command_are_typed_errors() {
        let z = Zfs::new("/nonexistent/zfs");
        assert!(matches!(z.run(&["list"]), Err(Error::Spawn { .. })));
        // `false` stands in for a zfs that fails with no message.
        let z = Zfs::new("/bin/false");
        let e = z.run(&["snapshot", "tank/x@y"]).unwrap_err();
        assert!(e.to_string().starts_with("`zfs snapshot tank/x@y` failed"), "{e}");
    }
}
