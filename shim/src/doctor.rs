//! `planarian doctor`: can this host run planarian, and how to fix what is missing.
//!
//! Each check passes or fails with the fix. A failing *required* check makes the exit code 1;
//! an optional one (soft-dirty tracking, ZFS) only degrades what planarian can do, and says how.

use crate::Failure;
use clap::Parser;
use engine::config::Config;
use engine::tools;
use serde::Serialize;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;

#[derive(Parser, Debug)]
#[command(name = "planarian doctor", about = "Check that this host can run planarian")]
struct Args {
    /// Print the checks as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Pass,
    Fail,
    Warn,
}

#[derive(Debug, Serialize)]
pub struct Check {
    pub name: &'static str,
    pub required: bool,
    pub status: Status,
    pub detail: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fix: Option<String>,
}

impl Check {
    fn pass(name: &'static str, detail: impl Into<String>) -> Check {
        Check { name, required: true, status: Status::Pass, detail: detail.into(), fix: None }
    }
    fn fail(name: &'static str, required: bool, detail: impl Into<String>, fix: impl Into<String>) -> Check {
        Check {
            name,
            required,
            status: if required { Status::Fail } else { Status::Warn },
            detail: detail.into(),
            fix: Some(fix.into()),
        }
    }
    fn optional(mut self) -> Check {
        self.required = false;
        self
    }
}

pub fn main(args: &[OsString]) -> Result<i32, Failure> {
    let args: Args = match crate::cli::parse_verb("doctor", args) {
        Ok(a) => a,
        Err(code) => return Ok(code),
    };
    let checks = run_checks();
    let failed = checks.iter().filter(|c| c.status == Status::Fail).count();
    if args.json {
        let v = serde_json::json!({ "ok": failed == 0, "checks": checks });
        println!("{}", serde_json::to_string_pretty(&v).expect("checks serialise"));
    } else {
        for c in &checks {
            let tag = match c.status {
                Status::Pass => "[ ok ]",
                Status::Fail => "[FAIL]",
                Status::Warn => "[warn]",
            };
            println!("{tag} {}: {}", c.name, c.detail);
            if let Some(fix) = &c.fix {
                println!("       fix: {fix}");
            }
        }
        if failed == 0 {
            println!("planarian can run on this host.");
        } else {
            println!("{failed} required check(s) failed.");
        }
    }
    Ok(if failed == 0 { 0 } else { 1 })
}

pub fn run_checks() -> Vec<Check> {
    let mut checks = Vec::new();
    let cfg = match Config::load() {
        Ok(c) => {
            checks.push(Check::pass("config", "planarian.conf read"));
            c
        }
        Err(e) => {
            checks.push(Check::fail("config", true, e.to_string(), "correct the file named above"));
            Config::default()
        }
    };
    checks.push(check_crun(&cfg));
    checks.extend(check_criu(&cfg));
    checks.push(match engine::runtime::criu_hooks(&cfg) {
        Ok(p) => Check::pass("pre-resume hook", format!("{}: dumps stay incremental after a restore", p.display()))
            .optional(),
        Err(e) => Check::fail(
            "pre-resume hook",
            false,
            format!("{e}: the first dump after every restore is full"),
            "run `planarian install` from the build directory, or set [runtime] criu_hooks_path",
        ),
    });
    checks.push(check_cgroup());
    checks.push(check_zfs(&cfg));
    checks.push(check_store(&cfg));
    checks.extend(check_podman());
    checks
}

/// Runs a tool and returns (success, stdout, stderr).
fn run(path: &Path, args: &[&str]) -> Result<(bool, String, String), String> {
    let out = Command::new(path).args(args).output().map_err(|e| format!("cannot run {}: {e}", path.display()))?;
    Ok((
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

fn first_line(s: &str) -> &str {
    s.lines().map(str::trim).find(|l| !l.is_empty()).unwrap_or("")
}

fn last_line(s: &str) -> &str {
    s.lines().map(str::trim).rfind(|l| !l.is_empty()).unwrap_or("")
}

fn check_crun(cfg: &Config) -> Check {
    let crun = match tools::locate("crun", cfg.runtime.crun_path.as_deref(), "[runtime] crun_path") {
        Ok(p) => p,
        Err(e) => return Check::fail("crun", true, e.to_string(), "apt-get install crun (or dnf install crun)"),
    };
    match run(&crun, &["--version"]) {
        Ok((true, out, _)) => Check::pass("crun", format!("{} ({})", first_line(&out), crun.display())),
        Ok((false, _, err)) => Check::fail(
            "crun",
            true,
            format!("{} --version failed: {}", crun.display(), last_line(&err)),
            "reinstall crun",
        ),
        Err(e) => Check::fail("crun", true, e, "reinstall crun"),
    }
}

fn check_criu(cfg: &Config) -> Vec<Check> {
    let fix_install = "apt-get install criu (CRIU 3.17 or newer; 4.1+ on kernels 6.15 and later)";
    let criu = match tools::locate("criu", cfg.runtime.criu_path.as_deref(), "[runtime] criu_path") {
        Ok(p) => p,
        Err(e) => return vec![Check::fail("criu", true, e.to_string(), fix_install)],
    };
    let mut checks = Vec::new();
    match run(&criu, &["--version"]) {
        Ok((true, out, _)) => checks.push(Check::pass("criu", format!("{} ({})", first_line(&out), criu.display()))),
        other => {
            let why = match other {
                Err(e) => e,
                Ok((_, _, err)) => last_line(&err).to_string(),
            };
            return vec![Check::fail("criu", true, why, fix_install)];
        }
    }
    // `criu check` needs root; its last line is "Looks good." when the kernel can checkpoint.
    checks.push(match run(&criu, &["check"]) {
        Ok((true, out, err)) if out.contains("Looks good") || err.contains("Looks good") => {
            Check::pass("criu check", "Looks good.")
        }
        Ok((_, out, err)) => {
            let why =
                [last_line(&err), last_line(&out)].into_iter().find(|l| !l.is_empty()).unwrap_or("failed").to_string();
            let fix = if why.contains("vDSO") {
                "this CRIU is too old for this kernel: use CRIU 4.1 or newer, or a distribution kernel before 6.15"
            } else if !nix::unistd::geteuid().is_root() {
                "run planarian doctor as root"
            } else {
                "see `criu check --all`; a distribution kernel (Debian, Ubuntu, Fedora) has what CRIU needs"
            };
            Check::fail("criu check", true, why, fix)
        }
        Err(e) => Check::fail("criu check", true, e, fix_install),
    });
    checks.push(match run(&criu, &["check", "--feature", "mem_dirty_track"]) {
        Ok((true, _, _)) => Check::pass("soft-dirty tracking", "supported: statepoints are incremental").optional(),
        Ok((false, out, err)) => Check::fail(
            "soft-dirty tracking",
            false,
            format!("not supported ({}): every statepoint is a full memory dump", last_line(&format!("{out}{err}"))),
            "use a kernel built with CONFIG_MEM_SOFT_DIRTY (x86_64 distribution kernels have it)",
        ),
        Err(e) => Check::fail("soft-dirty tracking", false, e, fix_install),
    });
    checks.push(match run(&criu, &["check", "--feature", "network_lock_nftables"]) {
        Ok((true, _, _)) => Check::pass("network lock", "nftables, inside CRIU (checkpoint.network_lock = \"auto\" uses it)").optional(),
        Ok((false, out, err)) => Check::fail(
            "network lock",
            false,
            format!("no nftables locking ({}): every dump and restore runs iptables-restore, a fixed cost of each statepoint", last_line(&format!("{out}{err}"))),
            "a CRIU built with libnftables (Debian's is) and a kernel with nf_tables",
        ),
        Err(e) => Check::fail("network lock", false, e, fix_install),
    });
    checks
}

const CGROUP2_SUPER_MAGIC: i64 = 0x6367_7270;

fn check_cgroup() -> Check {
    use nix::sys::statfs::statfs;
    let name = "cgroups";
    let root = Path::new("/sys/fs/cgroup");
    let magic = match statfs(root) {
        // The field's type differs between targets.
        #[allow(clippy::unnecessary_cast)]
        Ok(s) => s.filesystem_type().0 as i64,
        Err(e) => {
            return Check::fail(
                name,
                true,
                format!("cannot stat /sys/fs/cgroup: {e}"),
                "mount cgroup2 on /sys/fs/cgroup",
            )
        }
    };
    if magic == CGROUP2_SUPER_MAGIC {
        // The freezer of cgroup v2 is cgroup.freeze in every non-root cgroup (Linux 5.2+).
        let own = sys::proc::Proc::own().read("cgroup").unwrap_or_default();
        let rel = own.lines().find_map(|l| l.strip_prefix("0::")).unwrap_or("/").trim_start_matches('/');
        let probe = if rel.is_empty() { None } else { Some(root.join(rel).join("cgroup.freeze")) };
        let has_freeze =
            probe.as_deref().is_some_and(Path::exists) || any_child_has_freeze(root) || new_child_has_freeze(root);
        return if has_freeze {
            Check::pass(name, "cgroup v2 (unified), freezer available")
        } else {
            Check::fail(name, true, "cgroup v2 without cgroup.freeze", "use Linux 5.2 or newer")
        };
    }
    if root.join("unified").exists() {
        return Check::fail(
            name,
            true,
            "hybrid cgroup v1/v2 mode: crun cannot start containers with it",
            "boot with systemd.unified_cgroup_hierarchy=1 (cgroup v2)",
        );
    }
    if root.join("freezer").exists() {
        Check::pass(name, "cgroup v1, freezer controller mounted")
    } else {
        Check::fail(
            name,
            true,
            "cgroup v1 without the freezer controller",
            "mount the freezer controller or switch to cgroup v2",
        )
    }
}

/// Where no cgroup but the root exists yet (a host without systemd, a fresh guest: the root
/// cgroup has no cgroup.freeze of its own), a child made for the question answers it.
fn new_child_has_freeze(root: &Path) -> bool {
    let child = root.join(format!("planarian-doctor-{}", std::process::id()));
    if std::fs::create_dir(&child).is_err() {
        return false;
    }
    let has = child.join("cgroup.freeze").exists();
    let _ = std::fs::remove_dir(&child);
    has
}

fn any_child_has_freeze(root: &Path) -> bool {
    std::fs::read_dir(root)
        .map(|rd| rd.filter_map(Result::ok).any(|e| e.path().join("cgroup.freeze").exists()))
        .unwrap_or(false)
}

fn check_zfs(cfg: &Config) -> Check {
    let name = "zfs";
    let required = cfg.zfs.parent_dataset.is_some();
    let fallback = "containers use the copy-based rootfs path (slower snapshots, full copies)";
    let zfs = match tools::locate("zfs", cfg.runtime.zfs_path.as_deref(), "[runtime] zfs_path") {
        Ok(p) => p,
        Err(e) => {
            return Check::fail(
                name,
                required,
                format!("{e}; {fallback}"),
                "apt-get install zfsutils-linux (or zfs-fuse)",
            )
        }
    };
    let engine = if Path::new("/sys/module/zfs").exists() {
        "kernel module"
    } else if process_running("zfs-fuse") {
        "zfs-fuse"
    } else {
        return Check::fail(
            name,
            required,
            format!("{} found but no ZFS is running; {fallback}", zfs.display()),
            "modprobe zfs, or start zfs-fuse",
        );
    };
    match &cfg.zfs.parent_dataset {
        None => Check { required: false, ..Check::pass(name, format!("{engine}; no parent dataset configured: containers whose rootfs is a ZFS dataset use it, others the copy-based path")) },
        Some(ds) => match run(&zfs, &["get", "-H", "-o", "value", "mountpoint", ds]) {
            Ok((true, mp, _)) if mp.trim().starts_with('/') => Check::pass(
                name,
                format!("{engine}; parent dataset {ds} (mounted at {}): containers on Podman's overlay get their own dataset, cloned from a per-image base", mp.trim()),
            ),
            Ok((true, mp, _)) => Check::fail(name, true, format!("parent dataset {ds} has no mount point ({})", mp.trim()), format!("zfs set mountpoint=/{ds} {ds}")),
            Ok((false, _, err)) => Check::fail(name, true, format!("parent dataset {ds}: {}", last_line(&err)), format!("zfs create {ds}, or fix [zfs] parent_dataset")),
            Err(e) => Check::fail(name, true, e, "reinstall zfs"),
        },
    }
}

fn process_running(comm: &str) -> bool {
    sys::proc::processes()
        .unwrap_or_default()
        .into_iter()
        .any(|p| sys::proc::Proc::of(p).read("comm").is_ok_and(|c| c.trim_end() == comm))
}

fn check_store(cfg: &Config) -> Check {
    let path = &cfg.store.path;
    let existing: PathBuf = path.ancestors().find(|p| p.exists()).unwrap_or(Path::new("/")).to_path_buf();
    match nix::unistd::access(&existing, nix::unistd::AccessFlags::W_OK) {
        Ok(()) => Check::pass("store", format!("{} (writable)", path.display())),
        Err(e) => Check::fail(
            "store",
            true,
            format!("{} is not writable ({e})", existing.display()),
            "run as root, or set [store] path",
        ),
    }
}

fn check_podman() -> Vec<Check> {
    let podman = match tools::locate("podman", None, "PATH") {
        Ok(p) => p,
        Err(e) => return vec![Check::fail("podman", true, e.to_string(), "apt-get install podman")],
    };
    let version = match run(&podman, &["--version"]) {
        Ok((true, out, _)) => Check::pass("podman", first_line(&out).to_string()),
        Ok((false, _, err)) => Check::fail("podman", true, last_line(&err).to_string(), "reinstall podman"),
        Err(e) => Check::fail("podman", true, e, "reinstall podman"),
    };
    let registered = match run(&podman, &["--runtime", "planarian", "info", "--format", "{{.Host.OCIRuntime.Path}}"]) {
        Ok((true, out, _)) => Check::pass("podman runtime", format!("planarian registered ({})", first_line(&out))),
        Ok((false, _, err)) => Check::fail(
            "podman runtime",
            true,
            format!("planarian is not registered with Podman: {}", last_line(&err)),
            "run `planarian install` (adds /etc/containers/containers.conf.d/planarian.conf)",
        ),
        Err(e) => Check::fail("podman runtime", true, e, "reinstall podman"),
    };
    vec![version, registered]
}
