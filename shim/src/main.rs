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
        None if inv.has_global_flag("--version") || inv.has_global_flag("-v") => Ok(version(inv)),
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
        Some("statepoint") => commands::statepoint(inv, args),
        Some("ledger") => commands::ledger(inv, args),
        Some("mcp") => commands::mcp(inv, args),
        Some("__snapshot-worker") => commands::snapshot_worker(inv, args),
        Some("__lazy-pages") => commands::lazy_pages(args),
        Some("__rollback-cleanup") => commands::cleanup_worker(inv, args),
        Some("gc") => commands::gc(inv, args),
        Some("fsck") => commands::fsck(inv, args),
        Some("zfs-base") => commands::zfs_base(inv, args),
        Some("doctor") => doctor::main(args),
        Some("install") => install::main(args),
        Some("config") => config_cmd::main(inv, args),
        _ => Err(passthrough(inv)),
    }
}

/// Replaces this process by crun with the same arguments. Returns only on failure.
fn passthrough(inv: &Invocation) -> Failure {
    let engine = match inv.engine() {
        Ok(e) => e,
        Err(e) => return e.into(),
    };
    let crun = match engine.crun() {
        Ok(p) => p.to_path_buf(),
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
                    if let Err(e) = engine.on_create(&id, &mut b) {
                        return e.into();
                    }
                }
            }
        }
        Some("delete") => {
            if let Some(id) = cli::delete_container_id(inv.verb_args()) {
                engine.on_delete(id);
            }
        }
        _ => {}
    }
    // `pause` and `resume` wait while planarian holds the container frozen, and crun holds the
    // lock it inherits until it exits.
    let _freeze = match inv.verb().filter(|v| matches!(*v, "pause" | "resume")) {
        Some(verb) => match cli::last_operand(verb, inv.verb_args()).map(|id| engine.freeze_lock(id)).transpose() {
            Ok(l) => l.flatten(),
            Err(e) => return e.into(),
        },
        None => None,
    };
    let exec_id = inv.verb().filter(|v| *v == "exec").and_then(|_| cli::exec_container_id(inv.verb_args()));
    let lock = match exec_id.map(|id| engine.tool_call_lock(id)).transpose() {
        Ok(l) => l.flatten(),
        Err(e) => return e.into(),
    };
    // (and no window of planarian's with the container frozen until crun has started the
    // command: `--detach`, below; otherwise until crun starts)
    let unfrozen = match exec_id.map(|id| engine.exec_freeze_lock(id)).transpose() {
        Ok(l) => l.flatten(),
        Err(e) => return e.into(),
    };
    // conmon's `exec --detach`: crun returns once the command started, and the tool call's lock
    // is held until the command exits. crun's exit status is this process's.
    let detached = exec_id.zip(cli::exec_detached_pid_file(inv.verb_args()));
    // A command no client is attached to (`podman exec -d`) is the sandbox's own work, not a
    // tool call: started in the container's process tree, and not waited for.
    let background = detached.is_some() && engine.exec_detached_by(std::os::unix::process::parent_id() as i32);
    let mut wrapped = false;
    if let (Some(id), Some(file)) = (exec_id, cli::exec_process_file(inv.verb_args())) {
        wrapped = engine.prepare_exec(id, &file, background);
        let what = || engine::runtime::exec::command_line(&file);
        match (background, wrapped) {
            (true, true) => inv.sink().info(&format!(
                "{id}: {} started with podman exec -d: in the background of the container's tree, which statepoints capture",
                what()
            )),
            (true, false) => inv.sink().warn(&format!(
                "{id}: {} started with podman exec -d outside the container's process tree (no shell in the image, a user other than root, or a terminal): statepoints do not hold it",
                what()
            )),
            _ => {}
        }
    }
    let (Some(_), Some((id, pid_file))) = (&lock, detached) else {
        // (crun inherits the tool call's lock, if any, and holds it until it exits)
        let err = Command::new(&crun).args(&inv.args).exec();
        return format!("cannot execute {}: {err}", crun.display()).into();
    };
    // (crun refuses a frozen container: no window of planarian's until it has started the
    // command and returned, which `--detach` makes quick; then a `pause` need not wait)
    let status = match Command::new(&crun).args(&inv.args).status() {
        Ok(s) => s,
        Err(e) => return format!("cannot execute {}: {e}", crun.display()).into(),
    };
    drop(unfrozen);
    if status.success() {
        if let Some(pid) = std::fs::read_to_string(&pid_file).ok().and_then(|p| p.trim().parse::<i32>().ok()) {
            let what = cli::exec_process_file(inv.verb_args())
                .map(|f| engine::runtime::exec::command_line(&f))
                .unwrap_or_default();
            // (what crun printed is all this prints: a holder that cannot start leaves the
            // command unwaited for, as before)
            // The shell that starts a detached command ends once it did: until then the
            // command is its child, outside the container's tree, and a statepoint would miss
            // it. Waited for with the tool call's lock held; `podman exec -d` returns after.
            if wrapped {
                engine::runtime::exec::wait_for_exit(pid, Some(std::time::Duration::from_secs(30)));
            }
            if let Some(lock) = lock.filter(|_| !background) {
                let _ = engine.hold_tool_call(lock, id, pid, &what);
            }
        }
    }
    use std::os::unix::process::ExitStatusExt;
    std::process::exit(status.code().unwrap_or_else(|| 128 + status.signal().unwrap_or(0)));
}

fn version(inv: &Invocation) -> i32 {
    println!("planarian version {VERSION}");
    println!("spec: {SPEC_VERSION}");
    match inv.engine().map_err(Failure::from).and_then(|e| Ok(e.crun()?.to_path_buf())) {
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
