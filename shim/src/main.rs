//! `planarian`: an OCI runtime for Podman, layered over crun.
//!
//! Every OCI verb that planarian does not own is executed by crun with the very same arguments,
//! stdio and environment (the process is replaced, so exit codes and signals are crun's own).
//! planarian owns checkpoint/restore (statepoints, not yet in this build) and its own verbs
//! (`doctor`, `install`).

mod chain;
mod cli;
mod config;
mod config_cmd;
mod container;
mod criu;
mod criu_rpc;
mod devfs;
mod fork;
mod fault;
mod freezer;
mod podman;
mod remote;
mod restore;
mod rollback;
mod rootfs;
mod snapshot;
mod statepoint_cmd;
mod store;
mod doctor;
mod install;
mod log;
mod lookup;
mod tools;
mod zfs_rootfs;
mod mcp;

use cli::Invocation;
use std::os::unix::process::CommandExt;
use std::process::Command;

pub const VERSION: &str = env!("CARGO_PKG_VERSION");
/// The OCI runtime-spec version crun and planarian speak.
pub const SPEC_VERSION: &str = "1.0.0";

fn main() {
    let inv = Invocation::parse(std::env::args_os().skip(1).collect());
    let code = match run(&inv) {
        Ok(code) => code,
        Err(msg) => {
            log::error(&inv, &msg);
            1
        }
    };
    std::process::exit(code)
}

fn run(inv: &Invocation) -> Result<i32, String> {
    match inv.verb() {
        None if inv.has_global_flag("--version") || inv.has_global_flag("-v") => Ok(version()),
        None if inv.args.is_empty() || inv.has_global_flag("--help") || inv.has_global_flag("-h") => {
            print!("{}", HELP);
            Ok(0)
        }
        Some("help") => {
            print!("{}", HELP);
            Ok(0)
        }
        Some("checkpoint") => snapshot::main(inv, inv.verb_args()),
        Some("restore") => restore::main(inv, inv.verb_args()),
        Some("rollback") => rollback::main(inv, inv.verb_args()),
        Some("fork") => fork::main(inv, inv.verb_args()),
        Some("snapshot") => statepoint_cmd::snapshot_main(inv, inv.verb_args()),
        Some("statepoint") => statepoint_cmd::main(inv.verb_args()),
        Some("doctor") => doctor::main(inv.verb_args()),
        Some("install") => install::main(inv.verb_args()),
        Some("config") => config_cmd::main(inv, inv.verb_args()),
        Some("gc") => zfs_rootfs::gc_main(inv.verb_args()),
        _ => Err(passthrough(inv)),
    }
}

/// Replaces this process by crun with the same arguments. Returns only on failure.
fn passthrough(inv: &Invocation) -> String {
    let cfg = match config::Config::load() {
        Ok(c) => c,
        Err(e) => return e.to_string(),
    };
    let crun = match crun_from(&cfg) {
        Ok(p) => p,
        Err(e) => return e,
    };
    // A tool call (exec) takes the container's shared lock, so it cannot start while a snapshot
    // or rollback holds the exclusive one. crun inherits the locked fd and holds it until it exits.
    // A container on a ZFS dataset runs on it (create points its config there); its removal
    // removes the dataset.
    match inv.verb() {
        Some("create") => {
            if let Err(e) = zfs_rootfs::on_create(&cfg, inv.verb_args()) {
                return e;
            }
            if let Err(e) = mcp::on_create(&cfg, inv.verb_args()) {
                return e;
            }
        }
        Some("delete") => {
            mcp::on_delete(&cfg, inv.verb_args());
            zfs_rootfs::on_delete(&cfg, inv.verb_args())
        }
        _ => {}
    }
    let _lock = match inv.verb() {
        Some("exec") => match cli::exec_container_id(inv.verb_args()) {
            Some(id) => match shared_tool_lock(&cfg, id) {
                Ok(l) => l,
                Err(e) => return e,
            },
            None => None,
        },
        _ => None,
    };
    let err = Command::new(&crun).args(&inv.args).exec();
    format!("cannot execute {}: {err}", crun.display())
}

/// The shared lock of a container that has statepoints, as an fd crun will inherit.
fn shared_tool_lock(cfg: &config::Config, id: &str) -> Result<Option<std::fs::File>, String> {
    let store = store::ContainerStore::new(&cfg.store.path, id);
    if !store.dir.exists() {
        return Ok(None);
    }
    let f = store.lock(false)?;
    use std::os::fd::AsRawFd;
    nix::fcntl::fcntl(&f, nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::empty()))
        .map_err(|e| format!("cannot pass the container lock to crun (fd {}): {e}", f.as_raw_fd()))?;
    Ok(Some(f))
}

fn crun_path() -> Result<std::path::PathBuf, String> {
    let cfg = config::Config::load().map_err(|e| e.to_string())?;
    crun_from(&cfg)
}

fn crun_from(cfg: &config::Config) -> Result<std::path::PathBuf, String> {
    tools::locate("crun", cfg.runtime.crun_path.as_deref(), "[runtime] crun_path").map_err(|e| e.to_string())
}

fn criu_from(cfg: &config::Config) -> Result<std::path::PathBuf, String> {
    tools::locate("criu", cfg.runtime.criu_path.as_deref(), "[runtime] criu_path").map_err(|e| e.to_string())
}

/// The pre-resume hook: configured, or installed beside this binary.
fn criu_hooks_from(cfg: &config::Config) -> Result<std::path::PathBuf, String> {
    let beside = std::env::current_exe().ok().and_then(|e| Some(e.parent()?.join("planarian-criu-hooks")));
    let configured = cfg.runtime.criu_hooks_path.as_deref().or(beside.as_deref());
    tools::locate("planarian-criu-hooks", configured, "[runtime] criu_hooks_path").map_err(|e| e.to_string())
}

fn version() -> i32 {
    println!("planarian version {VERSION}");
    println!("spec: {SPEC_VERSION}");
    match crun_path() {
        Ok(crun) => {
            let out = Command::new(&crun).arg("--version").output();
            let first = out
                .ok()
                .and_then(|o| String::from_utf8(o.stdout).ok())
                .and_then(|s| s.lines().next().map(str::to_owned))
                .unwrap_or_else(|| "unknown version".into());
            println!("runtime: {first} ({})", crun.display());
        }
        Err(e) => println!("runtime: {e}"),
    }
    println!("statepoints: not implemented in this build");
    0
}

const HELP: &str = "\
planarian: an OCI runtime for Podman, layered over crun, that gives sandboxes statepoints.

Usage: planarian [GLOBAL FLAGS] VERB [ARGS...]

OCI verbs (executed by crun with the same arguments):
  create start state kill delete exec ps pause resume update features spec list run
OCI verbs owned by planarian (called by Podman and conmon):
  checkpoint                a new statepoint (podman container checkpoint [--leave-running])
  restore                   restore the statepoint a checkpoint left (podman container restore)
Statepoints:
  snapshot CTR [--name N] [--description D]    take a statepoint of a running container
  rollback CTR STATEPOINT                      processes and files back to a statepoint
  fork CTR STATEPOINT --name NEW               a new container running from a statepoint
  statepoint list CTR [--json] | show CTR SP | set CTR SP [--name N] [--description D]
             [--outcome TEXT] | rm CTR SP...
Planarian's own verbs:
  doctor [--json]           check that this host can run planarian, and how to fix what is missing
  install [--prefix DIR]    install the binary and register it with Podman (containers.conf.d)
  config [CONTAINER]        the effective configuration, with a container's io.planarian.* annotations

Global flags (as runc/crun): --root DIR --log FILE --log-format text|json --log-level L --debug
  --systemd-cgroup --cgroup-manager M; any other flag is passed to crun untouched.
Configuration: /etc/planarian/planarian.conf (see `planarian doctor`).
";
