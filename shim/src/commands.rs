//! planarian's own verbs and the statepoint verbs Podman calls: arguments in, one engine call,
//! what the user or Podman expects out.

use crate::cli::{self, Invocation};
use crate::Failure;
use engine::context::RestoreContext;
use engine::log::{LineProgress, Progress, StderrProgress};
use engine::runtime::podman;
use engine::statepoint::{self, async_snapshot, restore::RestoreRequest, snapshot::SnapshotRequest};
use engine::store::{Manifest, Outcome};
use engine::Engine;
use std::ffi::OsString;

/// Parses a verb's arguments; `--help` and usage errors are printed by clap, with its exit code.
macro_rules! parse {
    ($verb:literal, $args:expr) => {
        match cli::parse_verb($verb, $args) {
            Ok(a) => a,
            Err(code) => return Ok(code),
        }
    };
}

/// `checkpoint` (Podman): a statepoint, and only what crun would print (nothing); the news goes
/// to planarian's own log, and to `--log` when asked.
pub fn checkpoint(inv: &Invocation, args: &[OsString]) -> Result<i32, Failure> {
    let a: cli::CheckpointArgs = parse!("checkpoint", args);
    // (a configuration that cannot be read is told in dump.log too, like any failure)
    let engine = inv.engine().map_err(statepoint::Error::from);
    let result = engine.and_then(|engine| checkpoint_with(&engine, &a));
    match result {
        Ok(Some(m)) => {
            inv.sink().info(&format!(
                "statepoint {} of {} committed",
                m.statepoint_id,
                statepoint::short(&m.container_id)
            ));
            Ok(0)
        }
        Ok(None) => Ok(0),
        Err(e) => {
            // Podman shows only the exit status of a failed checkpoint and points users at dump.log.
            if let Some(w) = &a.work_path {
                use std::io::Write;
                if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(w.join("dump.log")) {
                    let _ = writeln!(f, "planarian: {e}");
                }
            }
            Err(e.into())
        }
    }
}

/// A checkpoint of container `a.container_id` (or Podman's `--pre-checkpoint`: a memory
/// pre-dump, no statepoint).
fn checkpoint_with(engine: &Engine, a: &cli::CheckpointArgs) -> Result<Option<Manifest>, statepoint::Error> {
    if a.pre_dump {
        let image_path = a.image_path.as_deref().ok_or(statepoint::Error::PreDumpNeedsImagePath)?;
        engine.pre_dump(&a.container_id, image_path).map(|()| None)
    } else {
        let req = SnapshotRequest {
            tcp_established: a.criu.tcp_established,
            file_locks: a.criu.file_locks,
            leave_running: a.leave_running,
            internal: false,
            name: a.name.clone(),
            description: a.description.clone(),
            state: None,
            id: None,
        };
        engine.checkpoint(&a.container_id, &req, a.image_path.as_deref(), a.work_path.as_deref()).map(Some)
    }
}

/// `restore` (conmon, and containerd's runc shim).
pub fn restore(inv: &Invocation, args: &[OsString]) -> Result<i32, Failure> {
    let a: cli::RestoreArgs = parse!("restore", &cli::single_dash_long(args));
    let req = RestoreRequest {
        container_id: a.container_id,
        bundle: a.bundle,
        pid_file: a.pid_file,
        image_path: a.image_path,
        work_path: a.work_path,
        tcp_established: a.criu.tcp_established,
        file_locks: a.criu.file_locks,
        console_socket: a.console_socket,
    };
    let restored = inv.engine()?.restore(&req)?;
    for w in &restored.warnings {
        inv.sink().warn(w);
    }
    Ok(0)
}

/// `planarian snapshot CTR`: prints the new statepoint's id.
pub fn snapshot(inv: &Invocation, args: &[OsString]) -> Result<i32, Failure> {
    engine::log::start_prelude("command");
    let a: cli::SnapshotArgs = parse!("snapshot", args);
    engine::log::prelude("parsed");
    let state = a.state.as_deref().map(read_state).transpose()?;
    let engine = inv.engine()?;
    engine::log::prelude("settings");
    if a.r#async {
        let req = SnapshotRequest {
            tcp_established: a.tcp_established,
            file_locks: a.file_locks,
            leave_running: true,
            name: a.name,
            description: a.description,
            state,
            ..Default::default()
        };
        let id = engine.snapshot_async(&a.container, &req, &std::env::current_exe()?)?;
        println!("{id}");
        return Ok(0);
    }
    let m = engine.snapshot(
        &a.container,
        &SnapshotRequest {
            tcp_established: a.tcp_established,
            file_locks: a.file_locks,
            leave_running: true,
            internal: false,
            name: a.name,
            description: a.description,
            state,
            id: None,
        },
    )?;
    for p in &m.local_state.outside_tree {
        eprintln!(
            "planarian: warning: {} does not hold {p}: {}",
            m.statepoint_id,
            engine::statepoint::snapshot::OUTSIDE_TREE
        );
    }
    println!("{}", m.statepoint_id);
    Ok(0)
}

/// `planarian rollback CTR SP`: phases on stderr, the result on stdout.
pub fn rollback(inv: &Invocation, args: &[OsString]) -> Result<i32, Failure> {
    let a: cli::RollbackArgs = parse!("rollback", args);
    let r = inv.engine()?.rollback(&a.container, &a.statepoint, true)?;
    let name = r.container.name.clone();
    let mut progress = StderrProgress::start(&r.title());
    let ctx = r.run(&mut progress, a.reason.as_deref(), a.by.into())?;
    progress.finish();
    if a.json {
        println!("{}", context_json(&ctx)?);
    } else {
        println!("{name} rolled back to {}", ctx.statepoint.id);
    }
    Ok(0)
}

/// `planarian fork CTR SP [--name NEW]...  [--count N]`.
pub fn fork(inv: &Invocation, args: &[OsString]) -> Result<i32, Failure> {
    let a: cli::ForkArgs = parse!("fork", args);
    let count = a.count.map_or(a.name.len().max(1), usize::from);
    if !a.name.is_empty() && a.name.len() != count {
        return Err(format!("--count {count} with {} --name: give one name per fork, or none", a.name.len()).into());
    }
    let names: Vec<Option<String>> =
        if a.name.is_empty() { vec![None; count] } else { a.name.iter().cloned().map(Some).collect() };
    // One fork, asked as always: its phases as one block, its context as one object.
    let single = a.count.is_none() && count == 1;
    let first = names[0].as_deref().filter(|_| single);
    let f = inv.engine()?.fork(&a.container, &a.statepoint, first)?;
    let (source, sp) = (f.source.name.clone(), f.target.statepoint_id.clone());
    if single {
        let mut progress = StderrProgress::start(&f.title());
        let (new, ctx) = f.run(&mut progress, a.by.into())?;
        progress.finish();
        if a.json {
            println!("{}", serde_json::to_string_pretty(&ContextOut::of(&ctx, Some(&new.id)))?);
        } else {
            println!("{} forked from {source} at {sp} ({})", ctx.container, new.id);
        }
        return Ok(0);
    }
    eprintln!(
        "planarian: forking {source} at {} {count} time(s), {} at once",
        statepoint::describe(&f.target),
        statepoint::fork::parallelism(count)
    );
    let started = std::time::Instant::now();
    let progress_for = |name: &str| -> Box<dyn Progress + Send> { Box::new(LineProgress::new(name)) };
    let results = f.run_many(&names, &progress_for, a.by.into())?;
    eprintln!("  {:<65} {:>7.2} s", "total", started.elapsed().as_secs_f64());
    let failed = results.iter().filter(|(_, r)| r.is_err()).count();
    let mut out = Vec::new();
    for (name, r) in &results {
        match r {
            Ok((new, ctx)) => {
                if !a.json {
                    println!("{} forked from {source} at {sp} ({})", ctx.container, new.id);
                }
                out.push(ForkOut::Made(ContextOut::of(ctx, Some(&new.id))));
            }
            Err(e) => {
                eprintln!("planarian: fork into {name} failed: {e}");
                out.push(ForkOut::Failed { container: name, error: e.to_string() });
            }
        }
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&out)?);
    }
    Ok(if failed > 0 { 1 } else { 0 })
}

/// `planarian spare CTR SP [--count N]`: the spares' names, a line each.
pub fn spare(inv: &Invocation, args: &[OsString]) -> Result<i32, Failure> {
    let a: cli::SpareArgs = parse!("spare", args);
    let engine = inv.engine()?;
    let pool = engine.spares(&a.container, &a.statepoint)?;
    let mut progress =
        StderrProgress::start(&format!("keeping {} spare(s) of {} at {}", a.count, a.container, pool.sp));
    let spares = engine.keep_spares(pool, a.count, &mut progress)?;
    progress.finish();
    for s in spares {
        println!("{} ({}, frozen)", s.name, statepoint::short(&s.id));
    }
    Ok(0)
}

/// `planarian statepoint list|show|set|rm`.
pub fn statepoint(inv: &Invocation, args: &[OsString]) -> Result<i32, Failure> {
    let a: cli::StatepointArgs = parse!("statepoint", args);
    let engine = inv.engine()?;
    match a.command {
        cli::StatepointCommand::List { container, json } => {
            let store = engine.store_of(&container)?;
            let list = store.committed();
            if json {
                println!("{}", serde_json::to_string_pretty(&list)?);
            } else {
                print!("{}", table(&list, store.head().as_deref()));
            }
        }
        cli::StatepointCommand::Show { container, statepoint } => {
            let store = engine.store_of(&container)?;
            println!("{}", serde_json::to_string_pretty(&store.find(&statepoint)?)?);
        }
        cli::StatepointCommand::Set { container, statepoint, name, description, outcome, status, by, reward } => {
            let outcomes = outcome.into_iter().map(|t| Outcome::now(t, status.into(), by.into(), reward)).collect();
            engine.annotate(&container, &statepoint, name.as_deref(), description.as_deref(), outcomes)?;
        }
        cli::StatepointCommand::Wait { container, statepoint } => {
            let o = engine.wait(&container, &statepoint)?;
            println!("{} {}", o.statepoint, o.status);
        }
        cli::StatepointCommand::Context { container, json } => {
            let store = engine.store_of(&container)?;
            let ctx = RestoreContext::last(&store)
                .ok_or_else(|| format!("container {container} was never rolled back or forked into"))?;
            if json {
                println!("{}", context_json(&ctx)?);
            } else {
                print!("{}", ctx.text());
            }
        }
        cli::StatepointCommand::Export { container, statepoint, file, since } => {
            let (m, e) = engine.export(&container, &statepoint, since.as_deref(), &file)?;
            println!(
                "exported {} of {container} to {}: {} ({} of memory images, files as {})",
                m.statepoint_id,
                file.display(),
                human(e.bytes),
                if e.levels == 1 { "1 level".to_string() } else { format!("{} levels", e.levels) },
                e.files
            );
        }
        cli::StatepointCommand::Import { file, name, parent_dataset } => {
            let c = engine.import(&file, name.as_deref(), parent_dataset.as_deref())?;
            println!("{} imported from {} at {} ({})", c.name, file.display(), c.statepoint, c.id);
        }
        cli::StatepointCommand::Rm { container, statepoints } => {
            // (all found first: a bad name changes nothing)
            engine.remove(&container, &statepoints, &mut |id| println!("{id}"))?;
        }
    }
    Ok(0)
}

/// `planarian ledger CTR`: the statepoints as a tree, with their evidence.
pub fn ledger(inv: &Invocation, args: &[OsString]) -> Result<i32, Failure> {
    let a: cli::LedgerArgs = parse!("ledger", args);
    let ledger = inv.engine()?.ledger(&a.container)?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&ledger)?);
    } else {
        print!("{}", ledger.text(a.max_chars));
    }
    Ok(0)
}

/// A restore context as JSON, with the text a harness appends to the conversation beside it.
fn context_json(ctx: &RestoreContext) -> Result<String, Failure> {
    Ok(serde_json::to_string_pretty(&ContextOut::of(ctx, None))?)
}

/// A restore context as a program reads it (`--json`, read by the SDK): its fields, the text a
/// model reads, and for a fork the new container's ID.
#[derive(serde::Serialize)]
struct ContextOut<'a> {
    #[serde(flatten)]
    ctx: &'a RestoreContext,
    text: String,
    #[serde(rename = "container-id", skip_serializing_if = "Option::is_none")]
    container_id: Option<&'a str>,
}

impl<'a> ContextOut<'a> {
    fn of(ctx: &'a RestoreContext, container_id: Option<&'a str>) -> ContextOut<'a> {
        ContextOut { text: ctx.text(), ctx, container_id }
    }
}

/// One fork of `fork --count N --json`: its context, or why it failed.
#[derive(serde::Serialize)]
#[serde(untagged)]
enum ForkOut<'a> {
    Made(ContextOut<'a>),
    Failed { container: &'a str, error: String },
}

/// A statepoint's structured state: JSON from a file, or from stdin for `-`.
fn read_state(path: &std::path::Path) -> Result<serde_json::Value, Failure> {
    let text = if path == std::path::Path::new("-") {
        std::io::read_to_string(std::io::stdin())?
    } else {
        std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?
    };
    serde_json::from_str(&text).map_err(|e| format!("--state {}: not JSON: {e}", path.display()).into())
}

/// `planarian mcp CTR`: serves the statepoint tools until the client closes stdin.
pub fn mcp(inv: &Invocation, args: &[OsString]) -> Result<i32, Failure> {
    let a: cli::McpArgs = parse!("mcp", args);
    crate::mcp::Server::new(&a.container, &a.allow, inv.globals())?.serve()?;
    Ok(0)
}

/// `planarian gc [--wait ID]`.
pub fn gc(inv: &Invocation, args: &[OsString]) -> Result<i32, Failure> {
    let a: cli::GcArgs = parse!("gc", args);
    engine::local::zfs::gc(inv.engine()?.config(), a.wait.as_deref())?;
    Ok(0)
}

/// `planarian fsck [CONTAINER...] [--repair] [--json]`: exit code 1 while something is wrong.
pub fn fsck(inv: &Invocation, args: &[OsString]) -> Result<i32, Failure> {
    let a: cli::FsckArgs = parse!("fsck", args);
    let engine = inv.engine()?;
    let cfg = engine.config();
    let ids: Vec<String> = if a.containers.is_empty() {
        engine::fsck::containers(cfg)
    } else {
        let mut ids = Vec::new();
        for c in &a.containers {
            let store = statepoint::store_of(cfg, c)?;
            if !store.dir.is_dir() {
                return Err(format!("{c}: planarian keeps no statepoints of it").into());
            }
            ids.push(store.container_id());
        }
        ids
    };
    let reports: Vec<engine::fsck::Report> = ids
        .iter()
        .map(|id| engine::fsck::check_container(&engine, id, a.repair, cfg.checkpoint.in_flight_wait()))
        .collect();
    let bad = reports.iter().filter(|r| r.busy || !r.findings.is_empty()).count();
    if a.json {
        #[derive(serde::Serialize)]
        struct FsckOut {
            ok: bool,
            containers: Vec<engine::fsck::Report>,
        }
        println!("{}", serde_json::to_string_pretty(&FsckOut { ok: bad == 0, containers: reports })?);
    } else {
        print!("{}", fsck_table(&reports));
    }
    Ok(if bad == 0 { 0 } else { 1 })
}

fn fsck_table(reports: &[engine::fsck::Report]) -> String {
    let mut out = format!("{:<14} {:>11}  {}\n", "CONTAINER", "STATEPOINTS", "RESULT");
    let line = |f: &engine::fsck::Finding, how: &str| {
        let sp = f.statepoint.as_deref().map(|s| format!("{s}: ")).unwrap_or_default();
        format!("  {how:<10} {sp}{}: {}\n", f.check, f.detail)
    };
    for r in reports {
        let id: String = r.container.chars().take(12).collect();
        let result = if r.busy {
            "busy (an operation holds its lock): not checked".to_string()
        } else if r.findings.is_empty() {
            if r.repaired.is_empty() {
                "ok".to_string()
            } else {
                format!("ok ({} repaired)", r.repaired.len())
            }
        } else {
            let can = r.findings.iter().filter(|f| f.repairable).count();
            let mut s = format!("{} problem(s)", r.findings.len());
            if can > 0 {
                s += &format!(", {can} that --repair puts right");
            }
            s
        };
        out += &format!("{id:<14} {:>11}  {result}\n", r.statepoints);
        for f in &r.repaired {
            out += &line(f, "repaired");
        }
        for f in &r.findings {
            out += &line(f, if f.repairable { "repairable" } else { "problem" });
        }
    }
    if reports.is_empty() {
        out += "(the store holds no containers)\n";
    }
    out
}

/// `planarian zfs-base IMAGE [--parent-dataset DS]`.
pub fn zfs_base(inv: &Invocation, args: &[OsString]) -> Result<i32, Failure> {
    let a: cli::ZfsBaseArgs = parse!("zfs-base", args);
    let engine = inv.engine()?;
    let cfg = engine.config();
    let Some(parent) = a.parent_dataset.or(cfg.zfs.parent_dataset.clone()) else {
        return Err("no parent dataset: give --parent-dataset, or set zfs.parent_dataset in the configuration"
            .to_string()
            .into());
    };
    let layers = podman::image_layers(&a.image)?;
    let started = std::time::Instant::now();
    let (base, made) = engine::local::zfs::create::prepare_image_base(cfg, &parent, &layers)?;
    if made {
        println!("{base}: {} copied ({} layers) in {:.1} s", a.image, layers.len(), started.elapsed().as_secs_f64());
    } else {
        println!("{base}: {} was copied before", a.image);
    }
    Ok(0)
}

fn table(list: &[Manifest], head: Option<&str>) -> String {
    let mut out = format!(
        "{:<6} {:<18} {:<7} {:<24} {:<6} {:>9} {:>9} {:>9}  {}\n",
        "ID", "NAME", "PARENT", "CREATED", "DUMP", "MEMORY", "FILES", "TOOK", "DESCRIPTION"
    );
    for m in list {
        let mark = if head == Some(m.statepoint_id.as_str()) { "*" } else { "" };
        out.push_str(&format!(
            "{:<6} {:<18} {:<7} {:<24} {:<6} {:>9} {:>9} {:>9}  {}\n",
            format!("{}{mark}", m.statepoint_id),
            m.name.as_deref().unwrap_or("-"),
            m.parent_statepoint_id.as_deref().unwrap_or("-"),
            &m.timestamp[..m.timestamp.len().min(19)],
            // Full dump, or incremental at depth N of its chain.
            if m.chain.prev_images_dir.is_some() { format!("inc{}", m.chain.depth) } else { "full".into() },
            human(m.measurements.criu_bytes),
            human(m.measurements.rootfs_bytes),
            format!("{:.0}ms", m.measurements.total_ms),
            m.state_evidence.state_description
        ));
    }
    out
}

fn human(b: u64) -> String {
    match b {
        b if b >= 1 << 30 => format!("{:.1}GiB", b as f64 / (1u64 << 30) as f64),
        b if b >= 1 << 20 => format!("{:.1}MiB", b as f64 / (1u64 << 20) as f64),
        b => format!("{:.0}KiB", b as f64 / 1024.0),
    }
}

/// The background half of `snapshot --async` (not for people: started by planarian itself with
/// the container's locked file).
/// `planarian __rollback-cleanup FD SPEC`: what a rollback in place leaves, removed.
pub fn cleanup_worker(inv: &Invocation, args: &[OsString]) -> Result<i32, Failure> {
    let [fd, spec] = args else { return Err("usage: planarian __rollback-cleanup FD SPEC".into()) };
    let fd: i32 = fd.to_str().and_then(|f| f.parse().ok()).ok_or("__rollback-cleanup: FD is a number")?;
    statepoint::rollback::cleanup_worker(&inv.engine()?, fd, &spec.to_string_lossy())?;
    Ok(0)
}

/// `planarian __lazy-pages READY GO STORE IMAGES VIEW WORK`: the page server of a lazy restore
/// (not for people: started by the `restore` verb with its two pipes).
pub fn lazy_pages(args: &[OsString]) -> Result<i32, Failure> {
    use std::os::fd::FromRawFd;
    let [ready, go, store, images, view, work] = args else {
        return Err("usage: planarian __lazy-pages READY GO STORE IMAGES VIEW WORK".into());
    };
    let fd =
        |a: &OsString| a.to_str().and_then(|f| f.parse::<i32>().ok()).ok_or("__lazy-pages: READY and GO are numbers");
    let (ready, go) = (fd(ready)?, fd(go)?);
    // SAFETY: the two pipe ends the restore verb left this process, owned by nothing else here.
    let (ready, go) = unsafe { (std::os::fd::OwnedFd::from_raw_fd(ready), std::os::fd::OwnedFd::from_raw_fd(go)) };
    let p = |a: &OsString| std::path::PathBuf::from(a);
    engine::local::lazy::work(ready, go, &p(store), &p(images), &p(view), &p(work))
        .map_err(|e| Failure::from(e.to_string()))?;
    Ok(0)
}

pub fn snapshot_worker(inv: &Invocation, args: &[OsString]) -> Result<i32, Failure> {
    let [fd, spec] = args else { return Err("usage: planarian __snapshot-worker FD SPEC".into()) };
    let fd: i32 = fd.to_str().and_then(|f| f.parse().ok()).ok_or("__snapshot-worker: FD is a number")?;
    async_snapshot::work(&inv.engine()?, fd, &spec.to_string_lossy())?;
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn human_sizes() {
        assert_eq!(human(3 << 20), "3.0MiB");
        assert_eq!(human(2048), "2KiB");
    }

    #[test]
    fn bad_input_is_a_usage_error_not_a_panic() {
        let os = |v: &[&str]| v.iter().map(OsString::from).collect::<Vec<_>>();
        let none = Invocation::parse(vec![]);
        assert_eq!(statepoint(&none, &os(&["frobnicate", "c"])).unwrap(), 2);
        assert_eq!(rollback(&none, &os(&["only-one"])).unwrap(), 2);
        assert_eq!(gc(&none, &os(&["--help"])).unwrap(), 0);
    }
}
