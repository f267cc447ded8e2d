//! The `restore` verb conmon calls for `podman container restore`: CRIU restore of a statepoint
//! from planarian's store into the bundle Podman prepared, as a sibling (so conmon, a child
//! subreaper, becomes the restored init's parent), then crun is told about the container so that
//! `podman exec/stop/kill/rm` keep working.

use super::podman_dir::{read_marker, Handoff};
use super::travel;
use super::{Error, Result};
use crate::chain::Epoch;
use crate::config::Config;
use crate::engine::Engine;
use crate::local::criu;
use crate::runtime::{self, container, Bundle};
use crate::store::{read_manifest, ContainerStore, Manifest};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use sys::Context;

/// What conmon asks of `restore` (runc's flags), in the engine's terms.
#[derive(Debug, Clone, Default)]
pub struct RestoreRequest {
    pub container_id: String,
    /// The bundle Podman prepared (default: the working directory).
    pub bundle: Option<PathBuf>,
    pub pid_file: Option<PathBuf>,
    pub image_path: Option<PathBuf>,
    pub work_path: Option<PathBuf>,
    pub tcp_established: bool,
    pub file_locks: bool,
    pub console_socket: Option<PathBuf>,
}

/// What a restore that succeeded has to say: warnings that did not fail it (a sidecar that
/// would not start), for the caller's log.
#[derive(Debug, Default)]
pub struct Restored {
    pub pid: i32,
    pub warnings: Vec<String>,
}

/// Restores the statepoint named by the marker in the checkpoint directory.
pub fn restore(engine: &Engine, a: &RestoreRequest) -> Result<Restored> {
    crate::log::start_marks();
    // (first: without CRIU nothing below is worth starting)
    let criu_bin = engine.criu()?.to_path_buf();
    let bundle = match &a.bundle {
        Some(b) => b.clone(),
        None => std::env::current_dir().at("read", ".")?,
    };
    let image_path = a.image_path.clone().unwrap_or_else(|| bundle.join("checkpoint"));
    let mut b = Bundle::load(&bundle)?;
    let cfg = b.spec.configure(engine.config())?;
    let Marked { store, import, marker_ctr, marker_sp } = marked(&cfg, a, &image_path)?;
    let _lock = lock_or_handoff(&store, &a.container_id)?;
    let (m, imported) = match &import {
        Some(from) => {
            let (m, guard) = travel::import(&cfg, &store, from, &a.container_id, &b, None)?;
            (m, Some(guard))
        }
        None => {
            let m = read_manifest(&store.statepoint_dir(&marker_sp).join("manifest.json"))
                .map_err(|_| Error::UnknownStatepoint { statepoint: marker_sp.clone(), container: marker_ctr })?;
            (super::committed(m)?, None)
        }
    };
    let sp_id = m.statepoint_id.clone();
    crate::log::mark("statepoint");
    crate::local::zfs::create::prepare_bundle(&cfg, &a.container_id, &mut b)?;
    crate::log::mark("bundle");
    let spec = b.spec;
    if spec.terminal && a.console_socket.is_none() {
        return Err(Error::TerminalNeedsConsole);
    }

    let (mut restored, epoch) = run_restore(&cfg, &criu_bin, a, &bundle, &m, &store, &spec)?;
    let pid = restored.pid;
    // (the one conmon reads)
    let pid_file = a.pid_file.clone().unwrap_or_else(|| bundle.join("pidfile"));
    sys::write_atomic(&pid_file, pid.to_string().as_bytes(), 0o644)?;
    container::register_with_crun(engine.globals(), &a.container_id, pid, &bundle, &spec)?;
    crate::log::mark("crun told");
    // The base first, then the head: a base recorded for a tree that is then killed is never
    // used (the next dump checks the init's start time), while a head moved before a failure
    // would name a statepoint the container is not at.
    crate::chain::after_restore(&store, &m, epoch, sys::proc::start_time(pid).unwrap_or(0))?;
    store.set_head(Some(&sp_id))?;
    restored.keep = true;
    if let Some(i) = imported {
        i.keep();
    }
    // The sandbox runs again; so does its MCP sidecar (stopped when Podman deleted the container
    // after a checkpoint). Without it, database calls and the next snapshot fail with its error.
    let mut warnings: Vec<String> = restored.eager_because.take().into_iter().collect();
    crate::log::mark("recorded");
    if let Err(e) = crate::remote::sidecar::start(&cfg, &a.container_id) {
        warnings.push(e.to_string());
    }
    crate::log::mark("sidecar");
    crate::log::log_marks(&format!("restore of {sp_id} into {} timeline (ms)", super::short(&a.container_id)));
    Ok(Restored { pid, warnings })
}

/// CRIU's restore of statepoint `m` (in `sp_dir`) into the bundle Podman prepared, as a
/// sibling: the tree runs (killed again when dropped before it is kept), with what the
/// pre-resume step of Algorithm 1 recorded. (Long: what CRIU's run borrows — the root's bind
/// mount, the network namespace, the empty directory, `/dev`'s tmpfs — is held from its making
/// to the run's end, each a guard undone however this ends.)
fn run_restore(
    cfg: &Config,
    criu_bin: &Path,
    a: &RestoreRequest,
    bundle: &Path,
    m: &Manifest,
    store: &ContainerStore,
    spec: &crate::runtime::Spec,
) -> Result<(RestoredTree, Epoch)> {
    let work = a.work_path.clone().unwrap_or_else(|| bundle.to_path_buf());
    let sp_dir = &store.statepoint_dir(&m.statepoint_id);
    let images = sp_dir.join(&m.local_state.criu_checkpoint_path);
    crate::chain::complete(&images)?;
    let restore_work = work.join("planarian-restore");
    std::fs::create_dir_all(&restore_work).at("create", &restore_work)?;
    // CRIU creates its pid file exclusively, and Podman may have left one: CRIU writes its own,
    // planarian writes the one conmon reads.
    let criu_pid_file = restore_work.join("pidfile");
    let _ = std::fs::remove_file(&criu_pid_file);

    // A rootfs prepared elsewhere (an import: the caller applied only the files diff) may lack
    // the points the container's mounts go on.
    ensure_mount_points(spec)?;
    // CRIU's root must be a mount point: bind the rootfs Podman mounted.
    let criu_root = bundle.join("criu-root");
    let _root_mount = BindMount::new(&spec.root, &criu_root)?;
    let netns: Option<OwnedFd> = match &spec.netns_path {
        Some(p) => Some(open_inheritable(p)?),
        None => None,
    };
    // The pre-resume hook of Algorithm 1; without it the restore works and the next dump is full.
    let epoch_file = restore_work.join("epoch");
    let _ = std::fs::remove_file(&epoch_file);
    let hooks = PreResume::of(cfg, spec.terminal);
    let empty_dir = criu::empty_dir()?;
    let join_netns = !criu::has_netns_image(&images);
    // A /dev planarian kept: a fresh tmpfs for CRIU to bind, detached once the restore is done.
    let dev = if crate::local::devfs::saved(sp_dir) {
        Some(crate::local::devfs::Restored::mount(sp_dir, &restore_work.join("dev"))?)
    } else {
        None
    };
    let tcp_established = a.tcp_established || m.options.tcp_established;
    crate::log::mark("prepared");
    let mut memory = Memory::of(cfg, store, &images, &restore_work);
    crate::log::mark("page server");
    let plan = criu::RestorePlan {
        images_dir: &images,
        work_dir: &restore_work,
        root: &criu_root,
        spec,
        pid_file: &criu_pid_file,
        cgroup_root: spec.cgroup_relpath(),
        // A dump taken inside the container's network namespace is restored inside its new one;
        // an older one that recorded the namespace as external gets it as that external.
        netns_fd: netns.as_ref().filter(|_| !join_netns).map(|f| f.as_raw_fd()),
        join_netns: netns.as_ref().filter(|_| join_netns).map(|f| f.as_raw_fd()),
        inherit_fds: inherited_pipes(sp_dir),
        action_scripts: match &hooks {
            PreResume::Script(p) => vec![p.clone()],
            _ => vec![],
        },
        tcp_established,
        file_locks: a.file_locks || m.options.file_locks,
        empty_dir: Some(&empty_dir),
        network_lock: criu::network_lock(criu_bin, cfg.checkpoint.network_lock, join_netns, tcp_established),
        dev_tmpfs: dev.as_ref().map(|d| d.path.as_path()),
        lazy_pages: false,
    };
    if !matches!(hooks, PreResume::Off(_)) {
        // The restored tasks inherit this (CRIU keeps it): without it, writing a restored page into
        // an empty 2 MiB range can get a whole transparent huge page, filling the images' holes
        // with pages in no image that the cleared soft-dirty bits would call unchanged, and CRIU
        // then refuses the next incremental dump ("Missing … in parent pagemap").
        let _ = nix::sys::prctl::set_thp_disable(true);
    }
    crate::fault::point("restore.before-criu")?;
    let pid = memory.restore(criu_bin, &plan, a, &hooks, &epoch_file)?;
    crate::log::mark("criu");
    // Where Podman looks for them (`podman container restore --print-stats` reads the stats).
    for f in ["stats-restore", "restore.log"] {
        let _ = std::fs::copy(restore_work.join(f), work.join(f));
    }
    // The tasks run: until every record of them is written, a failure kills them again, so that a
    // failed restore leaves no container running that neither conmon nor crun knows.
    let restored = RestoredTree { pid, keep: false, eager_because: memory.eager_because.take() };
    memory.restored(pid)?;
    crate::log::mark("server told");
    if !join_netns {
        criu::remove_restored_network_locks(pid);
    }
    drop(netns);
    drop(dev);
    let epoch = match hooks {
        PreResume::Off(why) => Epoch::Missing(why),
        _ => read_epoch(&epoch_file, &restore_work),
    };
    crate::fault::point("restore.restored")?;
    Ok((restored, epoch))
}

/// Where the statepoint a checkpoint directory names is: a directory handed out by another store
/// (another machine, a wiped store, Podman's `--import --name` copy) is imported into this
/// container's store; one this store holds is read from here.
struct Marked {
    store: ContainerStore,
    import: Option<travel::HandedOut>,
    marker_ctr: String,
    marker_sp: String,
}

fn marked(cfg: &Config, a: &RestoreRequest, image_path: &Path) -> Result<Marked> {
    let (marker_ctr, marker_sp) = read_marker(image_path)?;
    let handed = travel::HandedOut::read(image_path)?;
    let marker_store = ContainerStore::new(&cfg.store.path, &marker_ctr);
    let import = handed.filter(|h| marker_ctr != a.container_id || !h.held_by(cfg, &marker_store, &marker_sp));
    if import.is_none() && marker_ctr != a.container_id {
        // Only a directory this container's own checkpoint left is read from the store without
        // an import: a marker alone must not reach another container's statepoints.
        return Err(Error::ForeignMarker { statepoint: marker_sp, container: marker_ctr });
    }
    let store = if import.is_some() { ContainerStore::new(&cfg.store.path, &a.container_id) } else { marker_store };
    Ok(Marked { store, import, marker_ctr, marker_sp })
}

/// The container's lock, or none when a rollback that started this restore holds it and has
/// handed it over. Waited for either: a rollback killed meanwhile is recovered by the next
/// operation, which hands the lock over in turn and lets this restore end before it decides.
fn lock_or_handoff(store: &ContainerStore, id: &str) -> Result<Option<std::fs::File>> {
    loop {
        if Handoff::taken(store, id) {
            return Ok(None);
        }
        if let Some(l) = store.try_lock(true)? {
            return Ok(Some(l));
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// The descriptors of the statepoint's tree that were pipes (recorded at the dump), which CRIU
/// is handed as inherited.
fn inherited_pipes(sp_dir: &Path) -> Vec<(i32, String)> {
    let descriptors: Vec<String> = std::fs::read(sp_dir.join("descriptors.json"))
        .ok()
        .and_then(|d| serde_json::from_slice(&d).ok())
        .unwrap_or_default();
    descriptors.iter().enumerate().filter(|(_, t)| t.starts_with("pipe:")).map(|(i, t)| (i as i32, t.clone())).collect()
}

/// CRIU's restore of `plan`: through CRIU's RPC for a terminal, its binary otherwise. The
/// restored init's PID.
fn run_criu(
    criu_bin: &Path,
    plan: &criu::RestorePlan,
    a: &RestoreRequest,
    hooks: &PreResume,
    epoch_file: &Path,
) -> Result<i32> {
    if plan.spec.terminal {
        let console = a.console_socket.as_deref().ok_or(Error::TerminalNeedsConsole)?;
        return restore_terminal(criu_bin, plan, console, !matches!(hooks, PreResume::Off(_)), epoch_file);
    }
    criu::run(
        criu_bin,
        &criu::restore_args(plan),
        &plan.work_dir.join("restore.log"),
        true,
        &[("PLANARIAN_EPOCH_FILE", epoch_file)],
        plan.join_netns,
    )?;
    let pid = std::fs::read_to_string(plan.pid_file).ok().and_then(|s| s.trim().parse().ok());
    Ok(pid.ok_or_else(|| criu::Error::NoPid(plan.pid_file.to_path_buf()))?)
}

/// How the pre-resume step of Algorithm 1 runs for this restore: CRIU's action script, in
/// this process (CRIU's RPC, for a terminal), or not at all, and why (the restore still works;
/// the next dump is full).
enum PreResume {
    Script(PathBuf),
    InProcess,
    Off(String),
}

impl PreResume {
    /// (Through CRIU's RPC, for a terminal, the step runs in this process: no binary needed.)
    fn of(cfg: &Config, terminal: bool) -> PreResume {
        if !cfg.checkpoint.pre_resume_hook {
            PreResume::Off("the pre-resume hook is off (checkpoint.pre_resume_hook)".to_string())
        } else if terminal {
            PreResume::InProcess
        } else {
            match runtime::criu_hooks(cfg) {
                Ok(p) => PreResume::Script(p),
                Err(e) => PreResume::Off(e.to_string()),
            }
        }
    }
}

/// A restored process tree that is killed (its init, and with it its PID namespace) when this is
/// dropped before `keep` is set.
struct RestoredTree {
    pid: i32,
    keep: bool,
    /// Why memory was restored whole though `checkpoint.lazy_pages` asked for it on demand.
    eager_because: Option<String>,
}

/// How a restore brings memory back: whole, or on demand (`checkpoint.lazy_pages`) from a page
/// server, CRIU reading the view of the dump that leaves the server its pages.
struct Memory {
    server: Option<(PathBuf, crate::local::lazy::Worker)>,
    /// Why memory is restored whole though on demand was asked for.
    eager_because: Option<String>,
}

impl Memory {
    /// The server started and listening in `work`, when asked for and the dump at `images` leaves
    /// it pages to serve.
    fn of(cfg: &Config, store: &ContainerStore, images: &Path, work: &Path) -> Memory {
        use crate::local::lazy;
        let started = || -> std::result::Result<_, lazy::Error> {
            // (too little for the server to pay, or nothing lazy: no view made)
            let least = cfg.checkpoint.lazy_pages_min_mib.saturating_mul(1 << 20);
            // (a dump it cannot count, one of a zombie without a page map: the view counts)
            if lazy::view::pages(images).is_ok_and(|n| n.saturating_mul(sys::proc::PAGE_SIZE) < least) {
                return Ok(None);
            }
            let view = lazy::view::make(images)?;
            if view.lazy_pages == 0 || view.lazy_pages.saturating_mul(sys::proc::PAGE_SIZE) < least {
                return Ok(None);
            }
            let exe =
                std::env::current_exe().map_err(|e| lazy::Error::Start(format!("cannot find this binary: {e}")))?;
            Ok(Some((view.dir.clone(), lazy::Worker::start(&exe, store, images, &view.dir, work)?)))
        };
        match cfg.checkpoint.lazy_pages.then(started) {
            None => Memory { server: None, eager_because: None },
            Some(Ok(server)) => Memory { server, eager_because: None },
            Some(Err(e)) => {
                Memory { server: None, eager_because: Some(format!("restored memory whole, not on demand: {e}")) }
            }
        }
    }

    /// CRIU's restore of `plan`: on demand when there is a server. One that fails (CRIU or the
    /// kernel without what it needs, the server) is tried again whole: what failed is said, and
    /// only the whole one's error fails the restore.
    fn restore(
        &mut self,
        criu_bin: &Path,
        plan: &criu::RestorePlan,
        a: &RestoreRequest,
        hooks: &PreResume,
        epoch_file: &Path,
    ) -> Result<i32> {
        if let Some((view, _)) = &self.server {
            let lazily = criu::RestorePlan { images_dir: view, lazy_pages: true, ..plan.clone() };
            match run_criu(criu_bin, &lazily, a, hooks, epoch_file) {
                Ok(pid) => return Ok(pid),
                Err(e) => {
                    self.server = None;
                    self.eager_because =
                        Some(format!("restored memory whole, not on demand: the lazy restore failed: {e}"));
                    let _ = std::fs::remove_file(plan.pid_file);
                }
            }
        }
        run_criu(criu_bin, plan, a, hooks, epoch_file)
    }

    /// The restore ended with `pid` the first process: the server is told.
    fn restored(self, pid: i32) -> Result<()> {
        if let Some((_, server)) = self.server {
            server.restored(pid).map_err(crate::local::Error::from)?;
        }
        Ok(())
    }
}

impl Drop for RestoredTree {
    fn drop(&mut self) {
        if !self.keep {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.pid), nix::sys::signal::Signal::SIGKILL);
        }
    }
}

/// A terminal container, through CRIU's RPC: the new terminal's master goes to conmon's console
/// socket, and the pre-resume step of Algorithm 1 runs here. Returns the restored init's pid.
fn restore_terminal(
    criu_bin: &Path,
    plan: &criu::RestorePlan,
    console: &Path,
    hook: bool,
    epoch_file: &Path,
) -> Result<i32> {
    let mut root: Option<i32> = None;
    let mut console_sent = false;
    let pid = criu::rpc::restore(criu_bin, plan, |n| {
        match n.script.as_str() {
            "setup-namespaces" | "post-restore" => root = root.or(n.pid),
            "pre-resume" if hook => {
                // As with the action script, a failure here only costs a full next dump.
                let r = root.ok_or(criu_hooks::HookError::NoRoot).and_then(|r| criu_hooks::pre_resume(r, epoch_file));
                if let Err(e) = r {
                    let _ = std::fs::write(plan.work_dir.join("pre-resume.err"), e.to_string());
                }
            }
            "orphan-pts-master" => {
                let master = n.fd.ok_or_else(|| criu::Error::Rpc("criu sent no terminal".into()))?;
                criu::rpc::send_console(console, &master)?;
                console_sent = true;
            }
            _ => {}
        }
        Ok(())
    })?;
    if !console_sent {
        return Err(Error::NoTerminal);
    }
    Ok(pid)
}

/// E in microseconds, as the pre-resume hook recorded it ("E CLK_TCK", in clock ticks).
fn read_epoch(file: &Path, work: &Path) -> Epoch {
    let missing =
        || Epoch::Missing(format!("the pre-resume hook recorded no epoch (see {}/restore.log)", work.display()));
    let Ok(text) = std::fs::read_to_string(file) else { return missing() };
    let mut f = text.split_whitespace().map(|x| x.parse::<u64>());
    match (f.next(), f.next()) {
        (Some(Ok(e)), Some(Ok(clk))) if clk > 0 => Epoch::Recorded(criu_hooks::ticks_to_usec(e, clk)),
        _ => missing(),
    }
}

/// Creates the mount points of the container's mounts that its rootfs lacks, as crun does
/// before a restore: a directory, or an empty file for a bind mount of a file; none below a
/// tmpfs mount (CRIU restores those with their contents) or for cgroups (CRIU's). A path through
/// a symbolic link is left alone: what it points at is not ours to create (CRIU says what is
/// missing).
fn ensure_mount_points(spec: &crate::runtime::Spec) -> Result<()> {
    let tmpfs: Vec<&str> =
        spec.mounts.iter().filter(|(_, t)| t == "tmpfs").map(|(d, _)| d.trim_end_matches('/')).collect();
    let on_tmpfs =
        |d: &str| tmpfs.iter().any(|t| d.len() > t.len() && d.starts_with(t) && d.as_bytes()[t.len()] == b'/');
    let binds = spec.binds.iter().map(|(d, src)| (d, !Path::new(src).is_dir() && Path::new(src).exists()));
    let others = spec.mounts.iter().filter(|(_, t)| t != "cgroup" && t != "cgroup2").map(|(d, _)| (d, false));
    for (dest, file) in binds.chain(others) {
        if on_tmpfs(dest) {
            continue;
        }
        let mut at = spec.root.clone();
        let parts: Vec<&str> = dest.split('/').filter(|p| !p.is_empty() && *p != ".").collect();
        if parts.contains(&"..") {
            continue;
        }
        for (i, part) in parts.iter().enumerate() {
            at.push(part);
            match std::fs::symlink_metadata(&at) {
                Ok(md) if md.file_type().is_symlink() => break,
                Ok(_) => {}
                Err(_) if file && i + 1 == parts.len() => {
                    std::fs::File::create(&at).at("create the mount point", &at)?;
                }
                Err(_) => std::fs::create_dir(&at).at("create the mount point", &at)?,
            }
        }
    }
    Ok(())
}

fn open_inheritable(p: &Path) -> Result<OwnedFd> {
    use nix::fcntl::{open, OFlag};
    use nix::sys::stat::Mode;
    // Without O_CLOEXEC: criu inherits it.
    Ok(open(p, OFlag::O_RDONLY, Mode::empty()).map_err(std::io::Error::from).at("open", p)?)
}

struct BindMount {
    target: PathBuf,
}

impl BindMount {
    fn new(source: &Path, target: &Path) -> Result<BindMount> {
        use nix::mount::{mount, MsFlags};
        std::fs::create_dir_all(target).at("create", target)?;
        mount(Some(source), target, None::<&str>, MsFlags::MS_BIND | MsFlags::MS_REC, None::<&str>)
            .map_err(std::io::Error::from)
            .at("bind-mount the rootfs on", target)?;
        let _ = mount(None::<&str>, target, None::<&str>, MsFlags::MS_PRIVATE | MsFlags::MS_REC, None::<&str>);
        Ok(BindMount { target: target.to_path_buf() })
    }
}

impl Drop for BindMount {
    fn drop(&mut self) {
        let _ = nix::mount::umount2(&self.target, nix::mount::MntFlags::MNT_DETACH);
        let _ = std::fs::remove_dir(&self.target);
    }
}
