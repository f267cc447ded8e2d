//! The snapshot protocol and the `checkpoint` verb Podman calls.
//!
//! exclusive lock → freeze the cgroup → CRIU dump (tasks left frozen) → files → remote hooks →
//! manifest committed → thaw (or kill, when Podman did not ask to leave the container running).
//! A failure anywhere discards the partial statepoint and leaves the container running.

use crate::cli::Invocation;
use crate::config::Config;
use crate::container::{self, Container};
use crate::criu;
use crate::freezer::{FreezeGuard, Freezer};
use crate::store::{self, ContainerStore, Manifest, Status};
use clap::Parser;
use std::ffi::OsString;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// The marker planarian leaves in Podman's checkpoint directory: which statepoint it is.
pub const MARKER: &str = "planarian-statepoint.json";

#[derive(Parser, Debug)]
#[command(name = "planarian checkpoint", about = "Create a statepoint of a running container", args_override_self = true)]
pub struct CheckpointArgs {
    /// Where Podman expects the checkpoint images.
    #[arg(long)]
    pub image_path: Option<PathBuf>,
    /// Where Podman expects logs and stats.
    #[arg(long)]
    pub work_path: Option<PathBuf>,
    #[arg(long)]
    pub leave_running: bool,
    #[command(flatten)]
    pub criu: crate::cli::CriuFlags,
    /// Podman's --pre-checkpoint: a memory pre-dump into --image-path, no statepoint.
    #[arg(long)]
    pub pre_dump: bool,
    /// Podman's --with-previous (relative to --image-path).
    #[arg(long)]
    pub parent_path: Option<PathBuf>,
    /// A name for the new statepoint (planarian's own flag).
    #[arg(long)]
    pub name: Option<String>,
    /// A description of the state (planarian's own flag).
    #[arg(long)]
    pub description: Option<String>,
    pub container_id: String,
}

/// Everything one statepoint operation needs.
pub struct Ctx {
    pub cfg: Config,
    pub crun: PathBuf,
    pub criu: PathBuf,
    pub ctr: Container,
    pub store: ContainerStore,
    pub root: Option<PathBuf>,
}

impl Ctx {
    pub fn load(inv: &Invocation, id: &str) -> Result<Ctx, String> {
        let cfg = Config::load().map_err(|e| e.to_string())?;
        let crun = crate::crun_from(&cfg)?;
        let criu = crate::criu_from(&cfg)?;
        let ctr = Container::load(&crun, inv.root.as_deref(), id)?;
        let cfg = ctr.spec.configure(&cfg)?;
        let store = ContainerStore::new(&cfg.store.path, &ctr.id);
        Ok(Ctx { cfg, crun, criu, ctr, store, root: inv.root.clone() })
    }

    /// Undoes what a crashed planarian may have left: a cgroup it froze, pending statepoints.
    /// Call with the exclusive lock held.
    pub fn recover(&self) {
        let marker = self.store.dir.join("frozen-by-planarian");
        if let Ok(dir) = std::fs::read_to_string(&marker) {
            // A planarian killed mid-window may have taken its CRIU, and CRIU's lock, with it.
            if let Ok(pid) = self.ctr.running_pid() {
                criu::remove_stale_network_lock(pid);
            }
            let _ = std::fs::write(Path::new(dir.trim()).join("cgroup.freeze"), "0");
            let _ = std::fs::remove_file(&marker);
        }
        self.store.discard_stale();
    }
}

pub struct SnapshotRequest {
    pub tcp_established: bool,
    pub file_locks: bool,
    pub leave_running: bool,
    pub internal: bool,
    pub name: Option<String>,
    pub description: Option<String>,
}

/// Takes a statepoint. With the exclusive lock held by the caller.
pub fn take(ctx: &Ctx, req: &SnapshotRequest) -> Result<Manifest, String> {
    let t0 = Instant::now();
    let pid = ctx.ctr.running_pid()?;
    if let Some(n) = &req.name {
        if ctx.store.find(n).is_ok() {
            return Err(format!("a statepoint named {n} already exists"));
        }
    }
    let rootfs = crate::rootfs::for_container(&ctx.cfg, &ctx.store, &ctx.ctr.id, container::overlay_upperdir_of(pid)?)?;
    let freezer = Freezer::of_pid(pid)?;

    let id = ctx.store.next_id();
    let dir = ctx.store.statepoint_dir(&id);
    let init_start = container::start_time(pid).unwrap_or(0);
    let plan = crate::chain::plan(&ctx.store, &id, init_start, ctx.cfg.checkpoint.full_dump_interval);
    let images = dir.join("criu");
    std::fs::create_dir_all(&images).map_err(|e| format!("cannot create {}: {e}", images.display()))?;
    let mut m = Manifest {
        statepoint_id: id.clone(),
        parent_statepoint_id: ctx.store.head(),
        branch_id: ctx.ctr.id.clone(),
        container_id: ctx.ctr.id.clone(),
        timestamp: crate::log::rfc3339(std::time::SystemTime::now()),
        name: req.name.clone(),
        state_evidence: store::Evidence { state_description: req.description.clone().unwrap_or_default(), prior_outcomes: vec![] },
        local_state: store::LocalState { criu_checkpoint_path: "criu".into(), ..Default::default() },
        remote_state: vec![],
        status: Status::Pending,
        internal: req.internal,
        options: store::Options {
            tcp_established: req.tcp_established,
            file_locks: req.file_locks,
            leave_running: req.leave_running,
        },
        measurements: store::Measurements::default(),
        chain: store::Chain { prev_images_dir: plan.prev_images_dir.clone(), depth: plan.depth, full_reason: plan.full_reason.clone() },
    };
    rootfs.plan(&id, &mut m.local_state);
    // Until the manifest is committed, the statepoint's directory is removed on any way out.
    let pending = PendingStatepoint { dir: &dir, dump_log: images.join("dump.log"), failed_log: ctx.store.dir.join("failed-dump.log"), committed: false };
    ctx.store.write_manifest(&m)?;
    record_descriptors(pid, &dir)?;
    crate::fault::point("snapshot.before-freeze")?;

    // Stop the world for the whole window: thawed when `frozen` is dropped, whatever happens.
    let tf = Instant::now();
    let frozen = FreezeGuard::freeze(&freezer, ctx.store.dir.join("frozen-by-planarian"))?;
    m.measurements.freeze_ms = ms(tf);
    crate::fault::point("snapshot.frozen")?;

    let mounts = criu::mounts(pid);
    let masked_dirs = criu::masked_dirs(pid, &ctx.ctr.spec, &mounts);
    // Podman's network namespace: CRIU dumps from inside it (see criu::in_netns).
    let netns = match &ctx.ctr.spec.netns_path {
        Some(_) => Some(open_netns(pid)?),
        None => None,
    };
    let dev = crate::devfs::dev_mount(&mounts);
    let network_lock = criu::network_lock(&ctx.criu, ctx.cfg.checkpoint.network_lock, netns.is_some(), req.tcp_established);
    // A CRIU that dies while the namespace is locked leaves its lock behind: removed on failure.
    let lock_guard = StaleNetworkLock { pid, armed: network_lock == Some("nftables") && netns.is_none() };
    // From CRIU's first dump on, a failure must make the next dump full.
    let dumping = crate::chain::DumpInProgress::start(&ctx.store, init_start);
    let result = std::thread::scope(|scope| -> Result<(), String> {
        // The files beside the memory: the container is frozen, and CRIU only reads its files.
        let (local, rootfs, dir, dev) = (m.local_state.clone(), &rootfs, &dir, &dev);
        let files = scope.spawn(move || {
            let t = Instant::now();
            if let Some(dev) = dev {
                crate::devfs::save(pid, dev, dir)?;
            }
            rootfs.snapshot(dir, &local).map(|()| ms(t))
        });
        let memory = (|| -> Result<(), String> {
            let td = Instant::now();
            let incremental = criu::DumpPlan {
                pid,
                images_dir: &images,
                spec: &ctx.ctr.spec,
                freeze_cgroup: Some(freezer.dir()),
                prev_images_dir: plan.prev_images_dir.as_deref(),
                tcp_established: req.tcp_established,
                file_locks: req.file_locks,
                masked_dirs: &masked_dirs,
                network_lock,
                dev_external: dev.is_some(),
                join_netns: netns.as_ref().map(|f| f.as_raw_fd()),
            };
            let dump = |p: &criu::DumpPlan| {
                if ctx.ctr.spec.terminal {
                    // The terminal's slave needs orphan_pts_master, which only CRIU's RPC has.
                    crate::criu_rpc::dump(&ctx.criu, p)
                } else {
                    criu::run(&ctx.criu, &criu::dump_args(p), &images.join("dump.log"), false, &[], p.join_netns)
                }
            };
            if let Err(e) = dump(&incremental) {
                // Only a dump CRIU itself refused over its parent images is retried: after a killed
                // or crashed CRIU the tasks are left alone (the error goes back, nothing committed).
                if plan.prev_images_dir.is_none() || !criu::refused_parent(&images.join("dump.log")) {
                    return Err(e);
                }
                // An incremental dump CRIU refused is retried in full, still frozen: slower, never
                // wrong. Its log stays beside the images, and the manifest says why.
                let _ = std::fs::rename(images.join("dump.log"), dir.join("dump-incremental-failed.log"));
                let _ = std::fs::remove_dir_all(&images);
                std::fs::create_dir_all(&images).map_err(|e| format!("cannot create {}: {e}", images.display()))?;
                dump(&criu::DumpPlan { prev_images_dir: None, ..incremental })?;
                m.chain = store::Chain { prev_images_dir: None, depth: 0, full_reason: Some(format!("the incremental dump failed ({e}); dumped in full")) };
            }
            if !images.join("inventory.img").exists() {
                return Err(format!("criu reported success but wrote no images into {}", images.display()));
            }
            m.measurements.criu_dump_ms = ms(td);
            if let Some(st) = crate::chain::dump_stats(&images) {
                m.measurements.pages_written = st.pages_written;
                m.measurements.pages_skipped_parent = st.pages_skipped_parent;
            }
            if !frozen.holds() {
                return Err("the container thawed during the dump: the statepoint would not be consistent".into());
            }
            crate::fault::point("snapshot.dumped")?;
            Ok(())
        })();
        let files = files.join().unwrap_or_else(|_| Err("the files snapshot failed".into()));
        match (memory, files) {
            (Ok(()), Ok(rootfs_ms)) => m.measurements.rootfs_ms = rootfs_ms,
            (Err(e), files) => {
                if files.is_ok() {
                    rootfs.discard(dir, &m.local_state);
                }
                return Err(e);
            }
            (Ok(()), Err(e)) => return Err(e),
        }
        let rest = (|| {
            // Remote positions, with the sandbox still frozen: consistent with files and processes.
            m.remote_state = crate::remote::capture(&crate::mcp::remote_hooks(&ctx.cfg)?, &ctx.ctr.id)?;
            crate::fault::point("snapshot.before-commit")?;
            m.measurements.criu_bytes = store::du(&images);
            m.measurements.rootfs_bytes = m.local_state.rootfs_copy_path.as_ref().map_or(0, |c| store::du(&dir.join(c)));
            m.measurements.frozen_ms = ms(tf);
            m.measurements.total_ms = ms(t0);
            m.status = Status::Committed;
            ctx.store.write_manifest(&m)
        })();
        if rest.is_err() {
            rootfs.discard(dir, &m.local_state);
        }
        rest
    });
    result?;
    pending.committed();
    dumping.committed();
    lock_guard.disarm();
    if !req.leave_running {
        // Kill while still frozen, so nothing runs past the statepoint.
        let _ = std::process::Command::new(&ctx.crun).args(crun_root_args(ctx)).args(["kill", &ctx.ctr.id, "KILL"]).status();
    }
    drop(frozen);
    if req.leave_running {
        crate::chain::after_dump(&ctx.store, &m, init_start)?;
    }
    if !req.internal {
        ctx.store.set_head(Some(&id))?;
        enforce_retention(ctx);
    }
    Ok(m)
}

/// The network lock of a dump that failed: CRIU unlocks the namespace when it ends, but not when
/// it is killed.
struct StaleNetworkLock {
    pid: i32,
    armed: bool,
}

impl StaleNetworkLock {
    fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for StaleNetworkLock {
    fn drop(&mut self) {
        if self.armed {
            criu::remove_stale_network_lock(self.pid);
        }
    }
}

/// A statepoint being taken: its directory goes away on any way out before it is committed,
/// CRIU's log of the failed attempt kept where an operator finds it.
struct PendingStatepoint<'a> {
    dir: &'a Path,
    dump_log: PathBuf,
    failed_log: PathBuf,
    committed: bool,
}

impl PendingStatepoint<'_> {
    fn committed(mut self) {
        self.committed = true;
    }
}

impl Drop for PendingStatepoint<'_> {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::copy(&self.dump_log, &self.failed_log);
            let _ = std::fs::remove_dir_all(self.dir);
        }
    }
}

pub fn crun_root_args(ctx: &Ctx) -> Vec<OsString> {
    match &ctx.root {
        Some(r) => vec!["--root".into(), r.clone().into()],
        None => vec![],
    }
}

/// The network namespace process `pid` is in.
fn open_netns(pid: i32) -> Result<std::os::fd::OwnedFd, String> {
    let p = format!("/proc/{pid}/ns/net");
    std::fs::File::open(&p).map(std::os::fd::OwnedFd::from).map_err(|e| format!("cannot open {p}: {e}"))
}

fn ms(t: Instant) -> f64 {
    (t.elapsed().as_secs_f64() * 1e6).round() / 1e3
}

/// Where the container's fds 0–2 pointed (pipes to conmon, /dev/null, a tty), for restore.
fn record_descriptors(pid: i32, dir: &Path) -> Result<(), String> {
    let fds: Vec<String> = (0..3)
        .map(|i| {
            std::fs::read_link(format!("/proc/{pid}/fd/{i}")).map(|p| p.display().to_string()).unwrap_or_default()
        })
        .collect();
    crate::install::write_atomic(&dir.join("descriptors.json"), serde_json::to_string(&fds).unwrap().as_bytes(), 0o644)
}

fn enforce_retention(ctx: &Ctx) {
    let keep = ctx.cfg.store.retention as usize;
    if keep == 0 {
        return;
    }
    let committed = ctx.store.committed();
    let head = ctx.store.head();
    let excess = committed.len().saturating_sub(keep);
    for m in committed.iter().filter(|m| Some(&m.statepoint_id) != head.as_ref()).take(excess) {
        let _ = ctx.store.remove(&m.statepoint_id);
    }
}

/// Leaves what Podman expects after a checkpoint: `inventory.img` at the image path (Podman
/// checks it before a restore), our marker, the CRIU log and stats in the work path.
pub fn leave_for_podman(m: &Manifest, sp_dir: &Path, image_path: &Path, work_path: Option<&Path>) -> Result<(), String> {
    std::fs::create_dir_all(image_path).map_err(|e| format!("cannot create {}: {e}", image_path.display()))?;
    let images = sp_dir.join(&m.local_state.criu_checkpoint_path);
    std::fs::copy(images.join("inventory.img"), image_path.join("inventory.img"))
        .map_err(|e| format!("cannot copy inventory.img to {}: {e}", image_path.display()))?;
    let marker = serde_json::json!({ "container-id": m.container_id, "statepoint-id": m.statepoint_id });
    crate::install::write_atomic(&image_path.join(MARKER), marker.to_string().as_bytes(), 0o644)?;
    if let Some(w) = work_path {
        for f in ["stats-dump", "dump.log"] {
            let _ = std::fs::copy(images.join(f), w.join(f));
        }
    }
    Ok(())
}

pub fn main(inv: &Invocation, args: &[OsString]) -> Result<i32, String> {
    let a: CheckpointArgs = match crate::cli::parse_verb("checkpoint", args) {
        Ok(a) => a,
        Err(code) => return Ok(code),
    };
    let result = checkpoint(inv, &a);
    if let (Err(e), Some(w)) = (&result, &a.work_path) {
        // Podman shows only the exit status of a failed checkpoint and points users at dump.log.
        use std::io::Write;
        if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(w.join("dump.log")) {
            let _ = writeln!(f, "planarian: {e}");
        }
    }
    result
}

fn checkpoint(inv: &Invocation, a: &CheckpointArgs) -> Result<i32, String> {
    let ctx = Ctx::load(inv, &a.container_id)?;
    let pid = ctx.ctr.running_pid()?;
    if a.pre_dump {
        let image_path = a.image_path.as_deref().ok_or("--pre-dump needs --image-path")?;
        std::fs::create_dir_all(image_path).map_err(|e| format!("cannot create {}: {e}", image_path.display()))?;
        let out = std::process::Command::new(&ctx.criu)
            .args(["pre-dump", "--tree", &pid.to_string(), "--track-mem", "--log-file", "dump.log", "--images-dir"])
            .arg(image_path)
            .output()
            .map_err(|e| e.to_string())?;
        return if out.status.success() { Ok(0) } else { Err(format!("criu pre-dump failed (log: {}/dump.log)", image_path.display())) };
    }
    let _lock = ctx.store.lock(true)?;
    ctx.recover();
    let m = take(
        &ctx,
        &SnapshotRequest {
            tcp_established: a.criu.tcp_established,
            file_locks: a.criu.file_locks,
            leave_running: a.leave_running,
            internal: false,
            name: a.name.clone(),
            description: a.description.clone(),
        },
    )?;
    if let Some(ip) = &a.image_path {
        leave_for_podman(&m, &ctx.store.statepoint_dir(&m.statepoint_id), ip, a.work_path.as_deref())?;
    }
    // What crun prints on success is nothing: Podman prints the container's ID or name after.
    crate::log::info(inv, &format!("statepoint {} of {} committed", m.statepoint_id, short(&ctx.ctr.id)));
    Ok(0)
}

pub fn short(id: &str) -> &str {
    &id[..id.len().min(12)]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::restore::RestoreArgs;

    fn os(v: &[&str]) -> Vec<OsString> {
        v.iter().map(OsString::from).collect()
    }

    #[test]
    fn accepts_exactly_what_podman_sends_to_checkpoint() {
        let a: CheckpointArgs = crate::cli::parse_verb(
            "checkpoint",
            &os(&["--image-path", "/u/checkpoint", "--work-path", "/u", "--leave-running", "--tcp-established",
                "--file-locks", "--leave-running", "abc"]),
        )
        .unwrap();
        assert!(a.leave_running && a.criu.tcp_established && a.criu.file_locks);
        assert_eq!(a.image_path.as_deref(), Some(Path::new("/u/checkpoint")));
        assert_eq!(a.container_id, "abc");
        let pre: CheckpointArgs =
            crate::cli::parse_verb("checkpoint", &os(&["--image-path", "/u/pre-checkpoint", "--work-path", "/u", "--pre-dump", "abc"])).unwrap();
        assert!(pre.pre_dump);
        let prev: CheckpointArgs = crate::cli::parse_verb(
            "checkpoint",
            &os(&["--image-path", "/u/checkpoint", "--work-path", "/u", "--parent-path", "../pre-checkpoint", "abc"]),
        )
        .unwrap();
        assert_eq!(prev.parent_path.as_deref(), Some(Path::new("../pre-checkpoint")));
    }

    #[test]
    fn accepts_exactly_what_conmon_sends_to_restore() {
        let a: RestoreArgs = crate::cli::parse_verb(
            "restore",
            &os(&["--bundle", "/u", "--pid-file", "/r/pidfile", "--no-new-keyring", "--detach", "--image-path", "/u/checkpoint",
                "--work-path", "/u", "--tcp-established", "--lsm-mount-context=system_u:object_r:x", "--console-socket",
                "/tmp/conmon-term.X", "abc"]),
        )
        .unwrap();
        assert!(a.detach && a.criu.tcp_established);
        assert_eq!(a.console_socket.as_deref(), Some(Path::new("/tmp/conmon-term.X")));
        assert_eq!(a.container_id, "abc");
    }

    #[test]
    fn help_exits_zero_for_podmans_probe() {
        assert_eq!(crate::cli::parse_verb::<CheckpointArgs>("checkpoint", &os(&["--help"])).unwrap_err(), 0);
        assert_ne!(crate::cli::parse_verb::<CheckpointArgs>("checkpoint", &os(&["--bogus", "x"])).unwrap_err(), 0);
    }
}
