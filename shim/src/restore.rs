//! The `restore` verb conmon calls for `podman container restore`: CRIU restore of a statepoint
//! from planarian's store into the bundle Podman prepared, as a sibling (so conmon, a child
//! subreaper, becomes the restored init's parent), then crun is told about the container so that
//! `podman exec/stop/kill/rm` keep working.

use crate::cli::Invocation;
use crate::config::Config;
use crate::container::{self, Spec};
use crate::criu;
use crate::snapshot::MARKER;
use crate::store::{read_manifest, ContainerStore, Status};
use clap::Parser;
use std::ffi::OsString;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};

#[derive(Parser, Debug)]
#[command(name = "planarian restore", about = "Restore a container from a statepoint", args_override_self = true)]
pub struct RestoreArgs {
    #[arg(long, short = 'b')]
    pub bundle: Option<PathBuf>,
    #[arg(long)]
    pub pid_file: Option<PathBuf>,
    #[arg(long, short = 'd')]
    pub detach: bool,
    #[arg(long)]
    pub image_path: Option<PathBuf>,
    #[arg(long)]
    pub work_path: Option<PathBuf>,
    #[arg(long)]
    pub no_pivot: bool,
    #[arg(long)]
    pub no_new_keyring: bool,
    #[arg(long)]
    pub preserve_fds: Option<u32>,
    #[command(flatten)]
    pub criu: crate::cli::CriuFlags,
    #[arg(long)]
    pub lsm_profile: Option<String>,
    #[arg(long)]
    pub lsm_mount_context: Option<String>,
    #[arg(long)]
    pub console_socket: Option<PathBuf>,
    pub container_id: String,
}

/// Which statepoint a Podman checkpoint directory stands for.
pub fn read_marker(image_path: &Path) -> Result<(String, String), String> {
    let p = image_path.join(MARKER);
    let data = std::fs::read(&p).map_err(|_| {
        format!("{} holds no planarian statepoint (was it checkpointed by another runtime?)", image_path.display())
    })?;
    let v: serde_json::Value = serde_json::from_slice(&data).map_err(|e| format!("{}: {e}", p.display()))?;
    match (v["container-id"].as_str(), v["statepoint-id"].as_str()) {
        (Some(c), Some(s)) => Ok((c.to_string(), s.to_string())),
        _ => Err(format!("{} is malformed", p.display())),
    }
}

pub fn main(inv: &Invocation, args: &[OsString]) -> Result<i32, String> {
    let a: RestoreArgs = match crate::cli::parse_verb("restore", args) {
        Ok(a) => a,
        Err(code) => return Ok(code),
    };
    let cfg = Config::load().map_err(|e| e.to_string())?;
    let criu_bin = crate::criu_from(&cfg)?;
    let bundle = match &a.bundle {
        Some(b) => b.clone(),
        None => std::env::current_dir().map_err(|e| e.to_string())?,
    };
    let image_path = a.image_path.clone().unwrap_or_else(|| bundle.join("checkpoint"));
    let (ctr_id, sp_id) = read_marker(&image_path)?;
    crate::zfs_rootfs::prepare_bundle(&cfg, &a.container_id, &bundle)?;
    let spec = Spec::load(&bundle)?;
    let cfg = spec.configure(&cfg)?;
    let store = ContainerStore::new(&cfg.store.path, &ctr_id);
    // A rollback that started this restore holds the lock and has handed it over.
    let _lock = if take_handoff(&store, &a.container_id) { None } else { Some(store.lock(true)?) };
    let sp_dir = store.statepoint_dir(&sp_id);
    let m = read_manifest(&sp_dir.join("manifest.json")).map_err(|_| format!("unknown statepoint {sp_id} of container {ctr_id}"))?;
    if m.status != Status::Committed {
        return Err(format!("statepoint {sp_id} is not committed"));
    }
    if spec.terminal && a.console_socket.is_none() {
        return Err("a container with a terminal (-t) is restored only with --console-socket".into());
    }

    let pid_file = a.pid_file.clone().unwrap_or_else(|| bundle.join("pidfile"));
    let work = a.work_path.clone().unwrap_or_else(|| bundle.clone());
    let images = sp_dir.join(&m.local_state.criu_checkpoint_path);
    crate::chain::complete(&images)?;
    let restore_work = work.join("planarian-restore");
    std::fs::create_dir_all(&restore_work).map_err(|e| format!("cannot create {}: {e}", restore_work.display()))?;
    // CRIU creates its pid file exclusively, and Podman may have left one: CRIU writes its own,
    // planarian writes the one conmon reads.
    let criu_pid_file = restore_work.join("pidfile");
    let _ = std::fs::remove_file(&criu_pid_file);

    // CRIU's root must be a mount point: bind the rootfs Podman mounted.
    let criu_root = bundle.join("criu-root");
    let _root_mount = BindMount::new(&spec.root, &criu_root)?;
    let netns: Option<OwnedFd> = match &spec.netns_path {
        Some(p) => Some(open_inheritable(p)?),
        None => None,
    };
    let descriptors: Vec<String> = std::fs::read(sp_dir.join("descriptors.json"))
        .ok()
        .and_then(|d| serde_json::from_slice(&d).ok())
        .unwrap_or_default();
    let inherit_fds = descriptors
        .iter()
        .enumerate()
        .filter(|(_, t)| t.starts_with("pipe:"))
        .map(|(i, t)| (i as i32, t.clone()))
        .collect();
    // The pre-resume hook of Algorithm 1; without it the restore works and the next dump is full.
    let epoch_file = restore_work.join("epoch");
    let _ = std::fs::remove_file(&epoch_file);
    // (Through CRIU's RPC, for a terminal, the same step runs in-process: no binary needed.)
    let hooks = if !cfg.checkpoint.pre_resume_hook {
        Err("the pre-resume hook is off (checkpoint.pre_resume_hook)".to_string())
    } else if spec.terminal {
        Ok(None)
    } else {
        crate::criu_hooks_from(&cfg).map(Some)
    };
    let empty_dir = criu::empty_dir()?;
    let join_netns = !criu::has_netns_image(&images);
    // A /dev planarian kept: a fresh tmpfs for CRIU to bind, detached once the restore is done.
    let dev = if crate::devfs::saved(&sp_dir) { Some(crate::devfs::Restored::mount(&sp_dir, &restore_work.join("dev"))?) } else { None };
    let plan = criu::RestorePlan {
        images_dir: &images,
        work_dir: &restore_work,
        root: &criu_root,
        spec: &spec,
        pid_file: &criu_pid_file,
        cgroup_root: spec.cgroup_relpath(),
        // A dump taken inside the container's network namespace is restored inside its new one;
        // an older one that recorded the namespace as external gets it as that external.
        netns_fd: netns.as_ref().filter(|_| !join_netns).map(|f| f.as_raw_fd()),
        join_netns: netns.as_ref().filter(|_| join_netns).map(|f| f.as_raw_fd()),
        inherit_fds,
        action_scripts: hooks.iter().flatten().cloned().collect(),
        tcp_established: a.criu.tcp_established || m.options.tcp_established,
        file_locks: a.criu.file_locks || m.options.file_locks,
        empty_dir: Some(&empty_dir),
        network_lock: criu::network_lock(&criu_bin, cfg.checkpoint.network_lock, join_netns, a.criu.tcp_established || m.options.tcp_established),
        dev_tmpfs: dev.as_ref().map(|d| d.path.as_path()),
    };
    if hooks.is_ok() {
        // The restored tasks inherit this (CRIU keeps it): without it, writing a restored page into
        // an empty 2 MiB range can get a whole transparent huge page, filling the images' holes
        // with pages in no image that the cleared soft-dirty bits would call unchanged, and CRIU
        // then refuses the next incremental dump ("Missing … in parent pagemap").
        let _ = nix::sys::prctl::set_thp_disable(true);
    }
    crate::fault::point("restore.before-criu")?;
    let pid: i32 = if spec.terminal {
        restore_terminal(&criu_bin, &plan, a.console_socket.as_deref().unwrap(), hooks.is_ok(), &epoch_file)?
    } else {
        criu::run(&criu_bin, &criu::restore_args(&plan), &restore_work.join("restore.log"), true, &[("PLANARIAN_EPOCH_FILE", &epoch_file)], plan.join_netns)?;
        std::fs::read_to_string(&criu_pid_file)
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .ok_or_else(|| format!("criu restore wrote no pid to {}", criu_pid_file.display()))?
    };
    // Where Podman looks for them (`podman container restore --print-stats` reads the stats).
    for f in ["stats-restore", "restore.log"] {
        let _ = std::fs::copy(restore_work.join(f), work.join(f));
    }
    // The tasks run: until every record of them is written, a failure kills them again, so that a
    // failed restore leaves no container running that neither conmon nor crun knows.
    let mut restored = RestoredTree { pid, keep: false };
    drop(netns);
    drop(dev);
    crate::fault::point("restore.restored")?;
    crate::install::write_atomic(&pid_file, pid.to_string().as_bytes(), 0o644)?;
    register_with_crun(inv, &a.container_id, pid, &bundle, &spec)?;
    store.set_head(Some(&sp_id))?;
    let epoch = hooks.and_then(|_| read_epoch(&epoch_file, &restore_work));
    crate::chain::after_restore(&store, &m, epoch, container::start_time(pid).unwrap_or(0))?;
    restored.keep = true;
    // The sandbox runs again; so does its MCP sidecar (stopped when Podman deleted the container
    // after a checkpoint). Without it, database calls and the next snapshot fail with its error.
    if let Err(e) = crate::mcp::start(&cfg, &a.container_id) {
        crate::log::warn(inv, &e.to_string());
    }
    Ok(0)
}

/// A restored process tree that is killed (its init, and with it its PID namespace) when this is
/// dropped before `keep` is set.
struct RestoredTree {
    pid: i32,
    keep: bool,
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
fn restore_terminal(criu_bin: &Path, plan: &criu::RestorePlan, console: &Path, hook: bool, epoch_file: &Path) -> Result<i32, String> {
    let mut root: Option<i32> = None;
    let mut console_sent = false;
    let pid = crate::criu_rpc::restore(criu_bin, plan, |n| {
        match n.script.as_str() {
            "setup-namespaces" | "post-restore" => root = root.or(n.pid),
            "pre-resume" if hook => {
                // As with the action script, a failure here only costs a full next dump.
                let r = root.ok_or_else(|| "criu named no root task".to_string()).and_then(|r| criu_hooks::pre_resume(r, epoch_file));
                if let Err(e) = r {
                    let _ = std::fs::write(plan.work_dir.join("pre-resume.err"), e);
                }
            }
            "orphan-pts-master" => {
                let master = n.fd.ok_or("criu sent no terminal")?;
                crate::criu_rpc::send_console(console, &master)?;
                console_sent = true;
            }
            _ => {}
        }
        Ok(())
    })?;
    if !console_sent {
        return Err("criu restored the container without its terminal".into());
    }
    Ok(pid)
}

/// E in microseconds, as the pre-resume hook recorded it ("E CLK_TCK", in clock ticks).
fn read_epoch(file: &Path, work: &Path) -> Result<u64, String> {
    let missing = || format!("the pre-resume hook recorded no epoch (see {}/restore.log)", work.display());
    let text = std::fs::read_to_string(file).map_err(|_| missing())?;
    let mut f = text.split_whitespace().map(|x| x.parse::<u64>());
    match (f.next(), f.next()) {
        (Some(Ok(e)), Some(Ok(clk))) if clk > 0 => Ok(criu_hooks::ticks_to_usec(e, clk)),
        _ => Err(missing()),
    }
}

/// A handoff is a rollback's note that it holds the lock for the restore it started.
pub fn take_handoff(store: &ContainerStore, ctr_id: &str) -> bool {
    let p = store.dir.join("handoff");
    let Ok(text) = std::fs::read_to_string(&p) else { return false };
    let v: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
    let holder_alive = v["pid"].as_i64().is_some_and(|pid| Path::new(&format!("/proc/{pid}")).exists());
    holder_alive && v["container-id"].as_str() == Some(ctr_id)
}

fn open_inheritable(p: &Path) -> Result<OwnedFd, String> {
    use nix::fcntl::{open, OFlag};
    use nix::sys::stat::Mode;
    // Without O_CLOEXEC: criu inherits it.
    open(p, OFlag::O_RDONLY, Mode::empty()).map_err(|e| format!("cannot open {}: {e}", p.display()))
}

struct BindMount {
    target: PathBuf,
}

impl BindMount {
    fn new(source: &Path, target: &Path) -> Result<BindMount, String> {
        use nix::mount::{mount, MsFlags};
        std::fs::create_dir_all(target).map_err(|e| format!("cannot create {}: {e}", target.display()))?;
        mount(Some(source), target, None::<&str>, MsFlags::MS_BIND | MsFlags::MS_REC, None::<&str>)
            .map_err(|e| format!("cannot bind {} on {}: {e}", source.display(), target.display()))?;
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

/// Writes crun's record of a running container (`<root>/<id>/status` and the config), as crun
/// itself does after a restore, so later crun verbs know it.
fn register_with_crun(inv: &Invocation, id: &str, pid: i32, bundle: &Path, spec: &Spec) -> Result<(), String> {
    let descriptors: Vec<String> = (0..3)
        .map(|i| std::fs::read_link(format!("/proc/{pid}/fd/{i}")).map(|p| p.display().to_string()).unwrap_or_default())
        .collect();
    let root = inv.root.clone().unwrap_or_else(|| PathBuf::from(container::CRUN_ROOT));
    let dir = root.join(id);
    std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let systemd = inv.has_global_flag("--systemd-cgroup");
    let status = serde_json::json!({
        "pid": pid,
        "process-start-time": container::start_time(pid).unwrap_or(0),
        "cgroup-path": spec.cgroup_relpath().unwrap_or_default(),
        "scope": "",
        "rootfs": spec.root.display().to_string(),
        "systemd-cgroup": systemd,
        "bundle": bundle.display().to_string(),
        "created": crate::log::rfc3339(std::time::SystemTime::now()),
        "owner": "root",
        "detached": true,
        "external_descriptors": serde_json::to_string(&descriptors).unwrap_or_default(),
    });
    std::fs::copy(bundle.join("config.json"), dir.join("config.json"))
        .map_err(|e| format!("cannot copy config.json to {}: {e}", dir.display()))?;
    crate::install::write_atomic(&dir.join("status"), serde_json::to_string_pretty(&status).unwrap().as_bytes(), 0o700)
}
