//! Driving CRIU: the options a container needs, derived from its OCI config the way crun
//! derives them, built in one place ([`DumpPlan::options`], [`RestorePlan::options`]) as one
//! list of [`Opt`]s, which [`cli_args`] renders as a command line and [`rpc`] as CRIU's
//! `criu_opts` (for a terminal, whose slave only the RPC's `orphan_pts_master` restores).

pub mod rpc;

use crate::runtime::Spec;
use std::ffi::OsString;
use std::os::fd::RawFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use sys::Context;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Io(#[from] sys::IoError),
    #[error("cannot run {}: {source}", tool.display())]
    Run { tool: PathBuf, source: std::io::Error },
    /// CRIU failed; its own first error line and where its log is.
    #[error("criu {verb} failed: {why} (log: {})", log.display())]
    Failed { verb: &'static str, why: String, log: PathBuf },
    /// Talking to `criu swrk` failed.
    #[error("{0}")]
    Rpc(String),
    #[error("{script}: {why}")]
    Notify { script: String, why: String },
    #[error("criu restore wrote no pid to {}", .0.display())]
    NoPid(PathBuf),
    #[error("{} is not empty: it is bound over the containers' masked directories at restore; empty it", .0.display())]
    EmptyDirNotEmpty(PathBuf),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// One CRIU option, as both the command line and `criu_opts` know it. Options one mode does not
/// have are left out by that mode's renderer (and say so where they are rendered).
#[derive(Debug, Clone, PartialEq)]
pub enum Opt {
    /// The process tree to dump (`--tree`; `pid`).
    Tree(i32),
    /// `--images-dir` (RPC: `images_dir_fd`, opened by the caller).
    ImagesDir(PathBuf),
    /// `--work-dir` (RPC: `work_dir_fd`).
    WorkDir(PathBuf),
    /// `--log-file` (relative to the work directory) at `-v4`.
    LogFile(&'static str),
    LeaveRunning,
    TrackMem,
    ManageCgroups,
    Root(PathBuf),
    FreezeCgroup(PathBuf),
    /// `--prev-images-dir` (RPC: `parent_img`), relative to the images directory.
    PrevImagesDir(String),
    /// `--ext-mount-map KEY:VAL` (RPC: `ext_mnt`).
    ExtMount(String, String),
    NetworkLock(&'static str),
    TcpEstablished(bool),
    FileLocks(bool),
    /// Command line only: the RPC caller stays CRIU's parent anyway.
    RestoreDetached,
    RestoreSibling,
    /// Command line only: the RPC answers with the pid.
    PidFile(PathBuf),
    CgroupRoot(String),
    /// `--inherit-fd fd[N]:KEY` (RPC: `inherit_fd`).
    InheritFd(i32, String),
    /// `--lazy-pages`: private anonymous memory is left to a page server (see
    /// [`crate::local::lazy`]) listening in the work directory.
    LazyPages,
    /// Command line only: in RPC mode CRIU runs no action scripts, and notifies the caller
    /// instead (see [`rpc`]).
    ActionScript(PathBuf),
}

pub struct DumpPlan<'a> {
    pub pid: i32,
    pub images_dir: &'a Path,
    pub spec: &'a Spec,
    pub freeze_cgroup: Option<&'a Path>,
    /// Relative to `images_dir`.
    pub prev_images_dir: Option<&'a str>,
    pub tcp_established: bool,
    pub file_locks: bool,
    /// Masked directories recorded as external mounts instead of tmpfs contents ([`masked_dirs`]).
    pub masked_dirs: &'a [String],
    /// CRIU's `--network-lock` method, when not its default ([`network_lock`]).
    pub network_lock: Option<&'static str>,
    /// `/dev` is kept by planarian ([`crate::local::devfs`]): an external mount for CRIU.
    pub dev_external: bool,
    /// CRIU runs inside the container's network namespace ([`in_netns`]), which it then does
    /// not dump.
    pub join_netns: Option<RawFd>,
}

#[derive(Clone)]
pub struct RestorePlan<'a> {
    pub images_dir: &'a Path,
    pub work_dir: &'a Path,
    pub root: &'a Path,
    pub spec: &'a Spec,
    pub pid_file: &'a Path,
    pub cgroup_root: Option<String>,
    /// The fd (in the restoring process) of the container's new network namespace.
    pub netns_fd: Option<i32>,
    /// (fd, key) pairs: the restored tasks get our fd `fd` where they had `key` (e.g. `pipe:[123]`).
    pub inherit_fds: Vec<(i32, String)>,
    pub action_scripts: Vec<PathBuf>,
    pub tcp_established: bool,
    pub file_locks: bool,
    /// The empty directory bound where a dump recorded a masked directory ([`empty_dir`]).
    pub empty_dir: Option<&'a Path>,
    pub network_lock: Option<&'static str>,
    /// The tmpfs planarian filled for `/dev`, when the dump recorded it as external.
    pub dev_tmpfs: Option<&'a Path>,
    /// CRIU runs inside this network namespace (the container's new one), where the tasks of a
    /// dump taken inside the old one are restored ([`in_netns`]).
    pub join_netns: Option<RawFd>,
    /// Memory on demand from planarian's page server, listening in `work_dir`.
    pub lazy_pages: bool,
}

fn ext(a: impl Into<String>, b: impl Into<String>) -> Opt {
    Opt::ExtMount(a.into(), b.into())
}

impl DumpPlan<'_> {
    /// The options of this dump, in the order the command line gives them.
    pub fn options(&self) -> Vec<Opt> {
        let mut o = vec![
            Opt::Tree(self.pid),
            Opt::ImagesDir(self.images_dir.to_path_buf()),
            Opt::WorkDir(self.images_dir.to_path_buf()),
            Opt::LogFile("dump.log"),
            Opt::LeaveRunning,
            Opt::TrackMem,
            Opt::ManageCgroups,
            Opt::Root(self.spec.root.clone()),
        ];
        if let Some(cg) = self.freeze_cgroup {
            o.push(Opt::FreezeCgroup(cg.to_path_buf()));
        }
        if let Some(prev) = self.prev_images_dir {
            o.push(Opt::PrevImagesDir(prev.to_string()));
        }
        o.extend(self.spec.binds.iter().map(|(dest, _)| ext(dest, dest)));
        o.extend(masked_files(self.spec).map(|f| ext(f, f)));
        o.extend(self.masked_dirs.iter().map(|d| ext(d, MASKED_DIR_KEY)));
        if self.dev_external {
            o.push(ext("/dev", crate::local::devfs::KEY));
        }
        if let Some(m) = self.network_lock {
            o.push(Opt::NetworkLock(m));
        }
        o.push(Opt::TcpEstablished(self.tcp_established));
        o.push(Opt::FileLocks(self.file_locks));
        o
    }
}

impl RestorePlan<'_> {
    /// The options of this restore, in the order the command line gives them.
    pub fn options(&self) -> Vec<Opt> {
        let mut o = vec![
            Opt::ImagesDir(self.images_dir.to_path_buf()),
            Opt::WorkDir(self.work_dir.to_path_buf()),
            Opt::LogFile("restore.log"),
            Opt::RestoreDetached,
            Opt::RestoreSibling,
            Opt::ManageCgroups,
            Opt::PidFile(self.pid_file.to_path_buf()),
            Opt::Root(self.root.to_path_buf()),
        ];
        if let Some(cg) = &self.cgroup_root {
            o.push(Opt::CgroupRoot(cg.clone()));
        }
        o.extend(self.spec.binds.iter().map(|(dest, src)| ext(dest, src)));
        o.extend(masked_files(self.spec).map(|f| ext(f, "/dev/null")));
        if let Some(d) = self.empty_dir {
            o.push(ext(MASKED_DIR_KEY, d.display().to_string()));
        }
        if let Some(d) = self.dev_tmpfs {
            o.push(ext(crate::local::devfs::KEY, d.display().to_string()));
        }
        if let Some(m) = self.network_lock {
            o.push(Opt::NetworkLock(m));
        }
        if let Some(fd) = self.netns_fd {
            o.push(Opt::InheritFd(fd, "extRootNetNS".into()));
        }
        o.extend(self.inherit_fds.iter().map(|(fd, key)| Opt::InheritFd(*fd, key.clone())));
        o.extend(self.action_scripts.iter().map(|s| Opt::ActionScript(s.clone())));
        if self.lazy_pages {
            o.push(Opt::LazyPages);
        }
        o.push(Opt::TcpEstablished(self.tcp_established));
        o.push(Opt::FileLocks(self.file_locks));
        o
    }
}

/// The command line of `criu VERB` with these options.
pub fn cli_args(verb: &str, opts: &[Opt]) -> Vec<OsString> {
    let mut a: Vec<OsString> = vec![verb.into()];
    for o in opts {
        let (name, value): (&str, Option<OsString>) = match o {
            Opt::Tree(pid) => ("--tree", Some(pid.to_string().into())),
            Opt::ImagesDir(p) => ("--images-dir", Some(p.into())),
            Opt::WorkDir(p) => ("--work-dir", Some(p.into())),
            Opt::LogFile(f) => {
                a.extend(["--log-file".into(), (*f).into()]);
                ("-v4", None)
            }
            Opt::LeaveRunning => ("--leave-running", None),
            Opt::TrackMem => ("--track-mem", None),
            Opt::ManageCgroups => ("--manage-cgroups", None),
            Opt::Root(p) => ("--root", Some(p.into())),
            Opt::FreezeCgroup(p) => ("--freeze-cgroup", Some(p.into())),
            Opt::PrevImagesDir(p) => ("--prev-images-dir", Some(p.into())),
            Opt::ExtMount(k, v) => ("--ext-mount-map", Some(format!("{k}:{v}").into())),
            Opt::NetworkLock(m) => ("--network-lock", Some(m.into())),
            Opt::TcpEstablished(false) | Opt::FileLocks(false) => continue,
            Opt::TcpEstablished(true) => ("--tcp-established", None),
            Opt::FileLocks(true) => ("--file-locks", None),
            Opt::RestoreDetached => ("--restore-detached", None),
            Opt::RestoreSibling => ("--restore-sibling", None),
            Opt::PidFile(p) => ("--pidfile", Some(p.into())),
            Opt::CgroupRoot(c) => ("--cgroup-root", Some(c.into())),
            Opt::InheritFd(fd, key) => ("--inherit-fd", Some(format!("fd[{fd}]:{key}").into())),
            Opt::ActionScript(p) => ("--action-script", Some(p.into())),
            Opt::LazyPages => ("--lazy-pages", None),
        };
        a.push(name.into());
        a.extend(value);
    }
    a
}

pub fn dump_args(p: &DumpPlan) -> Vec<OsString> {
    cli_args("dump", &p.options())
}

pub fn restore_args(p: &RestorePlan) -> Vec<OsString> {
    cli_args("restore", &p.options())
}

/// Masked paths that are regular files on the host are bind mounts of /dev/null in the
/// container: external mounts for CRIU.
pub(crate) fn masked_files(spec: &Spec) -> impl Iterator<Item = &String> {
    spec.masked_paths.iter().filter(|p| std::fs::metadata(p).is_ok_and(|m| m.is_file()))
}

/// The key under which a dump records masked directories as external mounts.
pub const MASKED_DIR_KEY: &str = "planarian-masked-dir";

/// A container's masked directories that are exactly what the runtime made of them: one empty,
/// read-only tmpfs with nothing mounted below it. CRIU would archive each with `tar` (a fork and
/// two execs per mount, a fixed cost of every dump); recorded as external mounts instead, they
/// come back at restore as read-only binds of one empty directory ([`empty_dir`]), as crun does.
/// Anything else (written to, remounted, mounted over) is left to CRIU.
pub fn masked_dirs(pid: i32, spec: &Spec, mounts: &[sys::proc::Mount]) -> Vec<String> {
    spec.masked_paths
        .iter()
        .filter(|p| {
            let at: Vec<&sys::proc::Mount> = mounts.iter().filter(|m| &m.point == *p).collect();
            let below = format!("{}/", p.trim_end_matches('/'));
            let [m] = at[..] else { return false };
            m.fstype == "tmpfs"
                && m.options.split(',').any(|o| o == "ro")
                && !mounts.iter().any(|o| o.point.starts_with(&below))
                && std::fs::read_dir(format!("{}{p}", sys::proc::Proc::of(pid).root().display()))
                    .is_ok_and(|mut d| d.next().is_none())
        })
        .cloned()
        .collect()
}

/// The empty, read-only directory bound over masked directories at restore (created when
/// missing). Refused if anything was put in it: a restore must not show a container what the
/// runtime hid from it.
pub fn empty_dir() -> Result<PathBuf> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    let dir = PathBuf::from("/run/planarian/empty");
    if !dir.is_dir() {
        std::fs::DirBuilder::new().recursive(true).mode(0o755).create(&dir).at("create", &dir)?;
    }
    let _ = std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o555));
    match std::fs::read_dir(&dir).map(|mut d| d.next().is_none()) {
        Ok(true) => Ok(dir),
        Ok(false) => Err(Error::EmptyDirNotEmpty(dir)),
        Err(e) => Err(sys::IoError::new("read", dir, e).into()),
    }
}

/// The `--network-lock` method for this CRIU: the configured one, or for `auto` nftables when
/// `criu check --feature network_lock_nftables` says this CRIU and kernel have it. The answer is
/// remembered per CRIU binary until the next boot (in /run/planarian), so only the first dump
/// after a boot pays for the check. `None`: CRIU's default (iptables).
///
/// Run inside the container's network namespace ([`in_netns`]) CRIU locks only established TCP
/// connections, one by one: without `--tcp-established` there are none, iptables runs nothing,
/// and nftables would still build its table, so no method is passed.
pub fn network_lock(
    criu: &Path,
    setting: crate::config::NetworkLock,
    inside_netns: bool,
    tcp_established: bool,
) -> Option<&'static str> {
    use crate::config::NetworkLock;
    if inside_netns && !tcp_established {
        return None;
    }
    match setting {
        NetworkLock::Nftables => return Some("nftables"),
        NetworkLock::Iptables => return None,
        NetworkLock::Auto => {}
    }
    use std::os::unix::fs::MetadataExt;
    let md = std::fs::metadata(criu).ok()?;
    let key = format!("{}:{}:{}:{}.{}", md.dev(), md.ino(), md.size(), md.mtime(), md.mtime_nsec());
    let cache = Path::new("/run/planarian/criu-nftables");
    if let Ok(text) = std::fs::read_to_string(cache) {
        if let Some((k, v)) = text.trim().rsplit_once(' ') {
            if k == key {
                return (v == "yes").then_some("nftables");
            }
        }
    }
    let ok = Command::new(criu)
        .args(["check", "--feature", "network_lock_nftables"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if std::fs::create_dir_all("/run/planarian").is_ok() {
        let _ = sys::write_atomic(cache, format!("{key} {}\n", if ok { "yes" } else { "no" }).as_bytes(), 0o644);
    }
    ok.then_some("nftables")
}

/// Starts criu inside network namespace `netns`.
///
/// A container's network namespace is Podman's (`/run/netns/…`), so CRIU is told it is external;
/// it still locks that namespace (netfilter rules in, rules out) and dumps its links, a fixed
/// cost of every dump and restore. Run inside it, CRIU sees the tasks share its own network
/// namespace and dumps none: the sockets are dumped as they are, and a restore run inside the
/// container's new namespace puts the tasks there. (Established TCP connections are still locked
/// one by one, as CRIU does for any process outside a namespace of its own.)
pub fn in_netns(cmd: &mut Command, netns: Option<RawFd>) {
    use std::os::unix::process::CommandExt;
    if let Some(fd) = netns {
        // SAFETY: setns(2) only, async-signal-safe, between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                let fd = std::os::fd::BorrowedFd::borrow_raw(fd);
                nix::sched::setns(fd, nix::sched::CloneFlags::CLONE_NEWNET).map_err(std::io::Error::from)
            });
        }
    }
}

/// Removes the nftables table a CRIU that died mid-dump left in the network namespace of `pid`
/// (`inet CRIU-<root pid>`, CRIU 3.17's network lock when it dumps the namespace itself): left
/// there, it makes every later dump of the container fail with "Locking network failed".
/// Quietly does nothing when there is no such table, or no `nft` to remove it with.
pub fn remove_stale_network_lock(pid: i32) {
    let Ok(nft) = crate::tools::locate("nft", None, "PATH") else { return };
    let Ok(ns) = sys::proc::Proc::of(pid).open("ns/net") else { return };
    let mut cmd = Command::new(nft);
    cmd.args(["delete", "table", "inet", &format!("CRIU-{pid}")])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    in_netns(&mut cmd, Some(std::os::fd::AsRawFd::as_raw_fd(&ns)));
    let _ = cmd.status();
}

/// Deletes the network lock tables CRIU left in the network namespace of `pid`, which a restore
/// made from the dump's images. The dump's lock table is in the images (its ruleset was saved
/// while locked), and CRIU before 4.1 unlocks after a restore the table named after the restored
/// root's host PID (`inet CRIU-PID`), not the dump's: every packet of the container, loopback
/// too, was dropped after a restore. (CRIU 4.1 records the dump's table name; nothing is left
/// then.) Run once the restore is done: any such table is stale.
pub fn remove_restored_network_locks(pid: i32) {
    let Ok(nft) = crate::tools::locate("nft", None, "PATH") else { return };
    let Ok(ns) = sys::proc::Proc::of(pid).open("ns/net") else { return };
    let netns = Some(std::os::fd::AsRawFd::as_raw_fd(&ns));
    let mut list = Command::new(&nft);
    list.args(["list", "tables"]).stdin(Stdio::null()).stderr(Stdio::null());
    in_netns(&mut list, netns);
    let Ok(out) = list.output() else { return };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Some(name) = line.trim().strip_prefix("table inet ") else { continue };
        if name.strip_prefix("CRIU-").is_some_and(|rest| !rest.is_empty()) {
            let mut cmd = Command::new(&nft);
            cmd.args(["delete", "table", "inet", name])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            in_netns(&mut cmd, netns);
            let _ = cmd.status();
        }
    }
}

/// Whether a dump recorded a network namespace of its own (one taken outside the container's).
pub fn has_netns_image(images: &Path) -> bool {
    std::fs::read_dir(images).is_ok_and(|rd| {
        rd.filter_map(Result::ok)
            .any(|e| e.file_name().to_str().is_some_and(|n| n.starts_with("netns-") && n.ends_with(".img")))
    })
}

/// Runs criu; on failure, the error names the log and quotes its first error line.
pub fn run(
    criu: &Path,
    args: &[OsString],
    log: &Path,
    keep_stdio: bool,
    envs: &[(&str, &Path)],
    netns: Option<RawFd>,
) -> Result<()> {
    let mut cmd = Command::new(criu);
    cmd.args(args).stdin(Stdio::null());
    in_netns(&mut cmd, netns);
    for (k, v) in envs {
        cmd.env(k, v);
    }
    if !keep_stdio {
        cmd.stdout(Stdio::null()).stderr(Stdio::piped());
    } else {
        // The restored tasks inherit our stdio (conmon's pipes): CRIU itself must not write there.
        cmd.stdin(Stdio::inherit()).stdout(Stdio::inherit()).stderr(Stdio::inherit());
    }
    let out = cmd.output().map_err(|source| Error::Run { tool: criu.to_path_buf(), source })?;
    if out.status.success() {
        return Ok(());
    }
    let why = first_error(log)
        .or_else(|| String::from_utf8_lossy(&out.stderr).lines().last().map(|l| l.trim().to_string()))
        .unwrap_or_else(|| out.status.to_string());
    let verb = if args.first().is_some_and(|a| a == "dump") { "dump" } else { "restore" };
    Err(Error::Failed { verb, why, log: log.to_path_buf() })
}

/// The cause CRIU logged: its first error line (the last ones only say "Dumping FAILED").
pub fn first_error(log: &Path) -> Option<String> {
    let text = std::fs::read_to_string(log).ok()?;
    let mut errors = text.lines().filter(|l| l.contains("Error") || l.contains("error"));
    let first = errors.next()?.trim().to_string();
    Some(first)
}

/// Whether CRIU finished its dump log with an error about the parent images (it refused an
/// incremental dump), as opposed to being killed or failing for another reason.
pub fn refused_parent(log: &Path) -> bool {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    text.contains("Dumping FAILED") && text.lines().any(|l| l.contains("Error") && l.contains("parent"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A spec whose masked paths are a regular file (on the host, in a scratch directory removed
    /// when the first is dropped) and a missing path.
    fn spec() -> (tempfile::TempDir, Spec) {
        let scratch = tempfile::tempdir().unwrap();
        let file = scratch.path().join("masked");
        std::fs::write(&file, "").unwrap();
        let spec = Spec {
            root: "/merged".into(),
            binds: vec![("/etc/hosts".into(), "/run/ud/hosts".into())],
            masked_paths: vec![file.display().to_string(), "/nonexistent/firmware".into()],
            ..Default::default()
        };
        (scratch, spec)
    }

    fn s(v: &[OsString]) -> String {
        v.iter().map(|x| x.to_string_lossy().into_owned()).collect::<Vec<_>>().join(" ")
    }

    #[test]
    fn dump_options_for_a_podman_container() {
        let (_scratch, sp) = spec();
        let a = s(&dump_args(&DumpPlan {
            pid: 42,
            images_dir: Path::new("/st/sp1/criu"),
            spec: &sp,
            freeze_cgroup: Some(Path::new("/sys/fs/cgroup/x")),
            prev_images_dir: None,
            tcp_established: true,
            file_locks: false,
            masked_dirs: &["/proc/acpi".to_string()],
            network_lock: Some("nftables"),
            dev_external: true,
            join_netns: Some(7),
        }));
        assert!(a.starts_with("dump --tree 42 --images-dir /st/sp1/criu"), "{a}");
        for want in [
            "--leave-running",
            "--track-mem",
            "--root /merged",
            "--freeze-cgroup /sys/fs/cgroup/x",
            "--ext-mount-map /etc/hosts:/etc/hosts",
            "--tcp-established",
            "--ext-mount-map /proc/acpi:planarian-masked-dir",
            "--network-lock nftables",
            "--ext-mount-map /dev:planarian-dev",
        ] {
            assert!(a.contains(want), "{want} missing from {a}");
        }
        // A masked regular file is an external mount; a path missing on the host is not.
        let f = &sp.masked_paths[0];
        assert!(a.contains(&format!("--ext-mount-map {f}:{f}")), "{a}");
        assert!(!a.contains("/nonexistent/firmware"), "{a}");
        assert!(!a.contains("--file-locks") && !a.contains("--prev-images-dir"), "{a}");
        // Dumped from inside the container's network namespace: no namespace to name as external.
        assert!(!a.contains("--external net["), "{a}");
    }

    #[test]
    fn only_a_refusal_over_the_parent_is_retried() {
        let scratch = tempfile::tempdir().unwrap();
        let log = scratch.path().join("dumplog");
        std::fs::write(&log, "(00.1) Error (criu/page-xfer.c:284): page-xfer: Missing 7f00 in parent pagemap\n(00.2) Error (criu/cr-dump.c:2053): Dumping FAILED.\n").unwrap();
        assert!(refused_parent(&log));
        // CRIU killed mid-dump: no "Dumping FAILED".
        std::fs::write(&log, "(00.1) Error (criu/page-xfer.c:284): page-xfer: Missing 7f00 in parent pagemap\n")
            .unwrap();
        assert!(!refused_parent(&log));
        std::fs::write(
            &log,
            "(00.1) Error (criu/mount.c:1): no mount\n(00.2) Error (criu/cr-dump.c:2053): Dumping FAILED.\n",
        )
        .unwrap();
        assert!(!refused_parent(&log));
    }

    #[test]
    fn restore_maps_mounts_netns_and_stdio() {
        let (_scratch, sp) = spec();
        let a = s(&restore_args(&RestorePlan {
            images_dir: Path::new("/st/sp1/criu"),
            work_dir: Path::new("/w"),
            root: Path::new("/b/criu-root"),
            spec: &sp,
            pid_file: Path::new("/run/pidfile"),
            cgroup_root: Some("/libpod_parent/libpod-abc".into()),
            netns_fd: Some(7),
            inherit_fds: vec![(1, "pipe:[123]".into())],
            action_scripts: vec![],
            tcp_established: false,
            file_locks: true,
            empty_dir: Some(Path::new("/run/planarian/empty")),
            network_lock: None,
            dev_tmpfs: Some(Path::new("/u/planarian-restore/dev")),
            join_netns: None,
            lazy_pages: false,
        }));
        for want in [
            "--restore-detached",
            "--restore-sibling",
            "--pidfile /run/pidfile",
            "--root /b/criu-root",
            "--cgroup-root /libpod_parent/libpod-abc",
            "--ext-mount-map /etc/hosts:/run/ud/hosts",
            "--inherit-fd fd[7]:extRootNetNS",
            "--inherit-fd fd[1]:pipe:[123]",
            "--file-locks",
            "--ext-mount-map planarian-masked-dir:/run/planarian/empty",
            "--ext-mount-map planarian-dev:/u/planarian-restore/dev",
        ] {
            assert!(a.contains(want), "{want} missing from {a}");
        }
        assert!(!a.contains("--network-lock"), "{a}");
        assert!(a.contains(&format!("--ext-mount-map {}:/dev/null", sp.masked_paths[0])), "{a}");
    }

    #[test]
    fn only_empty_read_only_tmpfs_masks_are_external() {
        // This process's own mounts: none of its directories is a masked tmpfs, so nothing is
        // taken from CRIU; a masked path that is not a mount point is not either.
        let spec =
            Spec { masked_paths: vec!["/proc/acpi".into(), "/nonexistent".into(), "/".into()], ..Default::default() };
        let me = std::process::id() as i32;
        let got = masked_dirs(me, &spec, &sys::proc::Proc::of(me).mounts().unwrap());
        assert!(!got.contains(&"/".to_string()) && !got.contains(&"/nonexistent".to_string()), "{got:?}");
    }
}
