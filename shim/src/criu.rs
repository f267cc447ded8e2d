//! Driving the `criu` command line: the options a container needs, derived from its OCI config
//! the way crun derives them, built in one place.

use crate::container::Spec;
use std::ffi::OsString;
use std::os::fd::RawFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

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
    /// `/dev` is kept by planarian ([`crate::devfs`]): an external mount for CRIU.
    pub dev_external: bool,
    /// CRIU runs inside the container's network namespace ([`in_netns`]), which it then does
    /// not dump.
    pub join_netns: Option<RawFd>,
}

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
}

fn push(v: &mut Vec<OsString>, items: &[&str]) {
    v.extend(items.iter().map(OsString::from));
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
pub fn masked_dirs(pid: i32, spec: &Spec, mounts: &[Mount]) -> Vec<String> {
    spec.masked_paths
        .iter()
        .filter(|p| {
            let at: Vec<&Mount> = mounts.iter().filter(|m| &m.point == *p).collect();
            let below = format!("{}/", p.trim_end_matches('/'));
            let [m] = at[..] else { return false };
            m.fstype == "tmpfs"
                && m.options.split(',').any(|o| o == "ro")
                && !mounts.iter().any(|o| o.point.starts_with(&below))
                && std::fs::read_dir(format!("/proc/{pid}/root{p}")).is_ok_and(|mut d| d.next().is_none())
        })
        .cloned()
        .collect()
}

/// One line of /proc/PID/mountinfo: mount point, per-mount options, filesystem type and the
/// filesystem's own (superblock) options.
pub struct Mount {
    pub point: String,
    pub options: String,
    pub fstype: String,
    pub super_options: String,
}

impl Mount {
    fn parse(line: &str) -> Option<Mount> {
        let (pre, post) = line.split_once(" - ")?;
        let f: Vec<&str> = pre.split(' ').collect();
        let s: Vec<&str> = post.split(' ').collect();
        Some(Mount {
            point: zfs::unescape(f.get(4)?),
            options: f.get(5)?.to_string(),
            fstype: s.first()?.to_string(),
            super_options: s.get(2)?.to_string(),
        })
    }
}

/// The mount table of process `pid`'s mount namespace, as that process sees it (empty when it
/// cannot be read).
pub fn mounts(pid: i32) -> Vec<Mount> {
    std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).map(|t| t.lines().filter_map(Mount::parse).collect()).unwrap_or_default()
}

/// The empty, read-only directory bound over masked directories at restore (created when
/// missing). Refused if anything was put in it: a restore must not show a container what the
/// runtime hid from it.
pub fn empty_dir() -> Result<PathBuf, String> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    let dir = PathBuf::from("/run/planarian/empty");
    if !dir.is_dir() {
        std::fs::DirBuilder::new().recursive(true).mode(0o755).create(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    }
    let _ = std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o555));
    match std::fs::read_dir(&dir).map(|mut d| d.next().is_none()) {
        Ok(true) => Ok(dir),
        Ok(false) => Err(format!("{} is not empty: it is bound over the containers' masked directories at restore; empty it", dir.display())),
        Err(e) => Err(format!("cannot read {}: {e}", dir.display())),
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
pub fn network_lock(criu: &Path, setting: crate::config::NetworkLock, inside_netns: bool, tcp_established: bool) -> Option<&'static str> {
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
        let _ = crate::install::write_atomic(cache, format!("{key} {}\n", if ok { "yes" } else { "no" }).as_bytes(), 0o644);
    }
    ok.then_some("nftables")
}

pub fn dump_args(p: &DumpPlan) -> Vec<OsString> {
    let mut a: Vec<OsString> = Vec::new();
    push(&mut a, &["dump", "--tree", &p.pid.to_string()]);
    a.push("--images-dir".into());
    a.push(p.images_dir.into());
    a.push("--work-dir".into());
    a.push(p.images_dir.into());
    push(&mut a, &["--log-file", "dump.log", "-v4", "--leave-running", "--track-mem", "--manage-cgroups"]);
    a.push("--root".into());
    a.push(p.spec.root.clone().into());
    if let Some(cg) = p.freeze_cgroup {
        a.push("--freeze-cgroup".into());
        a.push(cg.into());
    }
    if let Some(prev) = p.prev_images_dir {
        push(&mut a, &["--prev-images-dir", prev]);
    }
    for (dest, _) in &p.spec.binds {
        push(&mut a, &["--ext-mount-map", &format!("{dest}:{dest}")]);
    }
    for f in masked_files(p.spec) {
        push(&mut a, &["--ext-mount-map", &format!("{f}:{f}")]);
    }
    for d in p.masked_dirs {
        push(&mut a, &["--ext-mount-map", &format!("{d}:{MASKED_DIR_KEY}")]);
    }
    if p.dev_external {
        push(&mut a, &["--ext-mount-map", &format!("/dev:{}", crate::devfs::KEY)]);
    }
    if let Some(m) = p.network_lock {
        push(&mut a, &["--network-lock", m]);
    }
    if p.tcp_established {
        a.push("--tcp-established".into());
    }
    if p.file_locks {
        a.push("--file-locks".into());
    }
    a
}

pub fn restore_args(p: &RestorePlan) -> Vec<OsString> {
    let mut a: Vec<OsString> = vec!["restore".into(), "--images-dir".into()];
    a.push(p.images_dir.into());
    a.push("--work-dir".into());
    a.push(p.work_dir.into());
    push(&mut a, &["--log-file", "restore.log", "-v4", "--restore-detached", "--restore-sibling", "--manage-cgroups"]);
    a.push("--pidfile".into());
    a.push(p.pid_file.into());
    a.push("--root".into());
    a.push(p.root.into());
    if let Some(cg) = &p.cgroup_root {
        push(&mut a, &["--cgroup-root", cg]);
    }
    for (dest, src) in &p.spec.binds {
        push(&mut a, &["--ext-mount-map", &format!("{dest}:{src}")]);
    }
    for f in masked_files(p.spec) {
        push(&mut a, &["--ext-mount-map", &format!("{f}:/dev/null")]);
    }
    if let Some(d) = p.empty_dir {
        push(&mut a, &["--ext-mount-map", &format!("{MASKED_DIR_KEY}:{}", d.display())]);
    }
    if let Some(d) = p.dev_tmpfs {
        push(&mut a, &["--ext-mount-map", &format!("{}:{}", crate::devfs::KEY, d.display())]);
    }
    if let Some(m) = p.network_lock {
        push(&mut a, &["--network-lock", m]);
    }
    if let Some(fd) = p.netns_fd {
        push(&mut a, &["--inherit-fd", &format!("fd[{fd}]:extRootNetNS")]);
    }
    for (fd, key) in &p.inherit_fds {
        push(&mut a, &["--inherit-fd", &format!("fd[{fd}]:{key}")]);
    }
    for s in &p.action_scripts {
        a.push("--action-script".into());
        a.push(s.into());
    }
    if p.tcp_established {
        a.push("--tcp-established".into());
    }
    if p.file_locks {
        a.push("--file-locks".into());
    }
    a
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
    let Ok(ns) = std::fs::File::open(format!("/proc/{pid}/ns/net")) else { return };
    let mut cmd = Command::new(nft);
    cmd.args(["delete", "table", "inet", &format!("CRIU-{pid}")]).stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null());
    in_netns(&mut cmd, Some(std::os::fd::AsRawFd::as_raw_fd(&ns)));
    let _ = cmd.status();
}

/// Whether a dump recorded a network namespace of its own (one taken outside the container's).
pub fn has_netns_image(images: &Path) -> bool {
    std::fs::read_dir(images).is_ok_and(|rd| {
        rd.filter_map(Result::ok).any(|e| e.file_name().to_str().is_some_and(|n| n.starts_with("netns-") && n.ends_with(".img")))
    })
}

/// Runs criu; on failure, the error names the log and quotes its last error line.
pub fn run(criu: &Path, args: &[OsString], log: &Path, keep_stdio: bool, envs: &[(&str, &Path)], netns: Option<RawFd>) -> Result<(), String> {
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
    let out = cmd.output().map_err(|e| format!("cannot run {}: {e}", criu.display()))?;
    if out.status.success() {
        return Ok(());
    }
    let why = first_error(log)
        .or_else(|| String::from_utf8_lossy(&out.stderr).lines().last().map(|l| l.trim().to_string()))
        .unwrap_or_else(|| format!("exit status {}", out.status));
    let verb = args.first().and_then(|a| a.to_str()).unwrap_or("criu");
    Err(format!("criu {verb} failed: {why} (log: {})", log.display()))
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

    /// A spec whose masked paths are a regular file (on the host) and a missing path.
    fn spec() -> Spec {
        let file = std::env::temp_dir().join(format!("planarian-masked-{}", std::process::id()));
        std::fs::write(&file, "").unwrap();
        Spec {
            root: "/merged".into(),
            binds: vec![("/etc/hosts".into(), "/run/ud/hosts".into())],
            masked_paths: vec![file.display().to_string(), "/nonexistent/firmware".into()],
            ..Default::default()
        }
    }

    fn masked_file() -> String {
        std::env::temp_dir().join(format!("planarian-masked-{}", std::process::id())).display().to_string()
    }

    fn s(v: &[OsString]) -> String {
        v.iter().map(|x| x.to_string_lossy().into_owned()).collect::<Vec<_>>().join(" ")
    }

    #[test]
    fn dump_options_for_a_podman_container() {
        let sp = spec();
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
        let f = masked_file();
        assert!(a.contains(&format!("--ext-mount-map {f}:{f}")), "{a}");
        assert!(!a.contains("/nonexistent/firmware"), "{a}");
        assert!(!a.contains("--file-locks") && !a.contains("--prev-images-dir"), "{a}");
        // Dumped from inside the container's network namespace: no namespace to name as external.
        assert!(!a.contains("--external net["), "{a}");
    }

    #[test]
    fn only_a_refusal_over_the_parent_is_retried() {
        let log = std::env::temp_dir().join(format!("planarian-dumplog-{}", std::process::id()));
        std::fs::write(&log, "(00.1) Error (criu/page-xfer.c:284): page-xfer: Missing 7f00 in parent pagemap\n(00.2) Error (criu/cr-dump.c:2053): Dumping FAILED.\n").unwrap();
        assert!(refused_parent(&log));
        // CRIU killed mid-dump: no "Dumping FAILED".
        std::fs::write(&log, "(00.1) Error (criu/page-xfer.c:284): page-xfer: Missing 7f00 in parent pagemap\n").unwrap();
        assert!(!refused_parent(&log));
        std::fs::write(&log, "(00.1) Error (criu/mount.c:1): no mount\n(00.2) Error (criu/cr-dump.c:2053): Dumping FAILED.\n").unwrap();
        assert!(!refused_parent(&log));
        std::fs::remove_file(&log).unwrap();
    }

    #[test]
    fn restore_maps_mounts_netns_and_stdio() {
        let sp = spec();
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
        assert!(a.contains(&format!("--ext-mount-map {}:/dev/null", masked_file())), "{a}");
    }

    #[test]
    fn mountinfo_lines() {
        let m = Mount::parse("96 85 0:31 / /proc/acpi ro,relatime - tmpfs tmpfs ro,size=0k,inode64").unwrap();
        assert_eq!((m.point.as_str(), m.options.as_str(), m.fstype.as_str()), ("/proc/acpi", "ro,relatime", "tmpfs"));
        assert_eq!(m.super_options, "ro,size=0k,inode64");
        // Optional fields before the separator, and an escaped space in the mount point.
        let m = Mount::parse("101 85 0:33 / /a\\040b rw shared:5 master:1 - fuse pool/ds rw").unwrap();
        assert_eq!((m.point.as_str(), m.fstype.as_str()), ("/a b", "fuse"));
        assert!(Mount::parse("garbage").is_none());
    }

    #[test]
    fn only_empty_read_only_tmpfs_masks_are_external() {
        // This process's own mounts: none of its directories is a masked tmpfs, so nothing is
        // taken from CRIU; a masked path that is not a mount point is not either.
        let spec = Spec { masked_paths: vec!["/proc/acpi".into(), "/nonexistent".into(), "/".into()], ..Default::default() };
        let me = std::process::id() as i32;
        let got = masked_dirs(me, &spec, &mounts(me));
        assert!(!got.contains(&"/".to_string()) && !got.contains(&"/nonexistent".to_string()), "{got:?}");
    }
}
