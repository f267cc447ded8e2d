//! `planarian`: an OCI runtime for Podman, layered over crun, that gives sandboxes statepoints.
//!
//! A thin binary: the command line ([`cli`]) → a verb → a call into the engine library
//! (`planarian-engine`) → one line on failure. Every OCI verb planarian does not own is executed
//! by crun with the very same arguments, stdio and environment (the process is replaced, so exit
//! codes and signals are crun's own).

mod cli;
mod commands;
mod config_cmd;
mod doctor;
mod install;
mod mcp;

use cli::Invocation;
use engine::config::Config;
use std::os::unix::process::CommandExt;
use std::process::Command;

/// What a verb that failed has to say: one line, from any engine error.
pub type Failure = Box<dyn std::error::Error + Send + Sync>;

pub const VERSION: &str = engine::VERSION;
/// The OCI runtime-spec version crun and planarian speak.
pub const SPEC_VERSION: &str = "1.0.0";

fn main() {
    let inv = Invocation::parse(std::env::args_os().skip(1).collect());
    let code = match run(&inv) {
        Ok(code) => code,
        Err(e) => {
            inv.sink().error(&e.to_string());
            1
        }
    };
    std::process::exit(code)
}

fn run(inv: &Invocation) -> Result<i32, Failure> {
    let args = inv.verb_args();
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
        Some("checkpoint") => commands::checkpoint(inv, args),
        Some("restore") => commands::restore(inv, args),
        Some("rollback") => commands::rollback(inv, args),
        Some("fork") => commands::fork(inv, args),
        Some("spare") => commands::spare(inv, args),
        Some("snapshot") => commands::snapshot(inv, args),
        Some("statepoint") => commands::statepoint(args),
        Some("ledger") => commands::ledger(args),
        Some("mcp") => commands::mcp(inv, args),
        Some("__snapshot-worker") => commands::snapshot_worker(args),
        Some("__rollback-cleanup") => commands::cleanup_worker(args),
        Some("gc") => commands::gc(args),
        Some("fsck") => commands::fsck(args),
        Some("zfs-base") => commands::zfs_base(args),
        Some("doctor") => doctor::main(args),
        Some("install") => install::main(args),
        Some("config") => config_cmd::main(inv, args),
        _ => Err(passthrough(inv)),
    }
}

/// Replaces this process by crun with the same arguments. Returns only on failure.
fn passthrough(inv: &Invocation) -> Failure {
    let cfg = match Config::load() {
        Ok(c) => c,
        Err(e) => return e.into(),
    };
    let crun = match engine::runtime::crun(&cfg) {
        Ok(p) => p,
        Err(e) => return e.into(),
    };
    // A container on a ZFS dataset runs on it (create points its config there), and one that
    // names an MCP service gets its sidecar; their removal removes both. The bundle's config is
    // read once, here.
    match inv.verb() {
        Some("create") => {
            if let (bundle, Some(id)) = cli::create_args(inv.verb_args()) {
                // An unreadable bundle is crun's to report, in crun's words.
                if let Ok(mut b) = engine::runtime::Bundle::load(&bundle) {
                    if let Err(e) = engine::local::zfs::create::on_create(&cfg, &id, &mut b) {
                        return e.into();
                    }
                    if let Err(e) = engine::remote::sidecar::on_create(&cfg, &id, &b.spec) {
                        return e.into();
                    }
                }
            }
        }
        Some("delete") => {
            if let Some(id) = cli::delete_container_id(inv.verb_args()) {
                engine::remote::sidecar::on_delete(&cfg, id);
                engine::local::zfs::on_delete(&cfg, id);
            }
        }
        _ => {}
    }
    // A tool call (exec) takes the container's shared lock, so it cannot start while a snapshot
    // or rollback holds the exclusive one. crun inherits the locked fd and holds it until it exits.
    let exec_id = inv.verb().filter(|v| *v == "exec").and_then(|_| cli::exec_container_id(inv.verb_args()));
    let _lock = match exec_id {
        Some(id) => match shared_tool_lock(&cfg, id) {
            Ok(l) => l,
            Err(e) => return e,
        },
        None => None,
    };
    // What the tool call leaves running must be in a session CRIU can dump (runtime/exec.rs).
    if let (Some(id), Some(file)) = (exec_id, cli::exec_process_file(inv.verb_args())) {
        if engine::runtime::exec::runtime_gives_exec_a_session(&crun) {
            // (crun 1.20 and later: already its own session)
        } else if let Ok(pid) =
            engine::runtime::Container::load(&crun, &inv.globals(), id).and_then(|c| c.running_pid())
        {
            engine::runtime::exec::rewrite_process_file(&file, pid);
        }
    }
    // conmon's `exec --detach`: crun returns once the command started; the lock is left with a
    // holder that lets go when the command exits (runtime/inflight.rs), so a snapshot waits for
    // it. crun's exit status is this process's.
    if let (Some(_), Some(id), Some(pid_file)) = (&_lock, exec_id, cli::exec_detached_pid_file(inv.verb_args())) {
        let lock = _lock.expect("matched");
        let status = match Command::new(&crun).args(&inv.args).status() {
            Ok(s) => s,
            Err(e) => return format!("cannot execute {}: {e}", crun.display()).into(),
        };
        if status.success() {
            if let Some(pid) = std::fs::read_to_string(&pid_file).ok().and_then(|p| p.trim().parse::<i32>().ok()) {
                let store = engine::store::ContainerStore::new(&cfg.store.path, id);
                let what = cli::exec_process_file(inv.verb_args())
                    .map(|f| engine::runtime::exec::command_line(&f))
                    .unwrap_or_default();
                // (what crun printed is all this prints: a holder that cannot start leaves the
                // command unwaited for, as before)
                let _ = engine::runtime::inflight::hold_until_exit(
                    lock,
                    pid,
                    &store.dir,
                    &what,
                    cfg.checkpoint.in_flight_wait(),
                );
            }
        }
        use std::os::unix::process::ExitStatusExt;
        std::process::exit(status.code().unwrap_or_else(|| 128 + status.signal().unwrap_or(0)));
    }
    let err = Command::new(&crun).args(&inv.args).exec();
    format!("cannot execute {}: {err}", crun.display()).into()
}

/// The shared lock of a container that has statepoints, as an fd crun will inherit.
fn shared_tool_lock(cfg: &Config, id: &str) -> Result<Option<std::fs::File>, Failure> {
    let store = engine::store::ContainerStore::new(&cfg.store.path, id);
    if !store.dir.exists() {
        return Ok(None);
    }
    let f = store.lock(false)?;
    use std::os::fd::AsRawFd;
    nix::fcntl::fcntl(&f, nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::empty()))
        .map_err(|e| format!("cannot pass the container lock to crun (fd {}): {e}", f.as_raw_fd()))?;
    Ok(Some(f))
}

fn version() -> i32 {
    println!("planarian version {VERSION}");
    println!("spec: {SPEC_VERSION}");
    match Config::load().map_err(Failure::from).and_then(|c| Ok(engine::runtime::crun(&c)?)) {
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
    println!("statepoints: checkpoint/restore, snapshot, rollback, fork (planarian-engine {VERSION})");
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
Statepoints (each verb has --help):
  snapshot CTR [--name N] [--description D] [--state FILE|-] [--async]   a statepoint of a running container
  rollback CTR STATEPOINT [--reason R] [--json]   processes, files, remote state back to it
  fork CTR STATEPOINT [--name NEW] [--json]       a new container running from a statepoint
  spare CTR STATEPOINT [--count N]                keep N forks of it ready (restored, frozen)
  statepoint list CTR [--json] | show CTR SP | set CTR SP [--name N] [--description D]
             [--outcome TEXT --status S --by W --reward R] | wait CTR SP | context CTR | rm CTR SP...
  ledger CTR [--json] [--max-chars N]          the statepoints as a tree, with their evidence
  mcp CTR [--allow fork,run]                   statepoint tools for the agent: an MCP server (stdio)
Planarian's own verbs:
  doctor [--json]           check that this host can run planarian, and how to fix what is missing
  install [--prefix DIR]    install the binary and register it with Podman (containers.conf.d)
  config [CONTAINER]        the effective configuration, with a container's io.planarian.* annotations
  gc [--wait ID]            remove the ZFS datasets of containers Podman has removed
  fsck [CTR...] [--repair] [--json]   check the statepoint store; repair what loses nothing committed
  zfs-base IMAGE [--parent-dataset DS]   copy an image into ZFS once, before its first container

Global flags (as runc/crun): --root DIR --log FILE --log-format text|json --log-level L --debug
  --systemd-cgroup --cgroup-manager M; any other flag is passed to crun untouched.
Configuration: /etc/planarian/planarian.conf (see `planarian doctor`).
";
