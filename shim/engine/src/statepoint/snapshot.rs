//! The snapshot protocol, and the `checkpoint` verb Podman calls.
//!
//! exclusive lock → freeze the cgroup → CRIU dump (tasks left frozen) → files → remote hooks →
//! manifest committed → thaw (or kill, when Podman did not ask to leave the container running).
//! A failure anywhere discards the partial statepoint and leaves the container running: every
//! invariant of the window is a guard ([`FreezeGuard`], the pending statepoint, the soft-dirty
//! base, CRIU's network lock).

use super::{Ctx, Error, Result};
use crate::local::criu;
use crate::local::freezer::{FreezeGuard, Freezer};
use crate::store::{self, Manifest, Status};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::Instant;
use sys::Context;

#[derive(Debug, Clone, Default)]
pub struct SnapshotRequest {
    pub tcp_established: bool,
    pub file_locks: bool,
    pub leave_running: bool,
    pub internal: bool,
    pub name: Option<String>,
    pub description: Option<String>,
    /// Structured state the caller records with the statepoint (StateRecord).
    pub state: Option<serde_json::Value>,
    /// An id reserved before (an asynchronous snapshot answers with it at once).
    pub id: Option<String>,
}

/// Takes a statepoint. With the exclusive lock held by the caller.
pub fn take(ctx: &Ctx, req: &SnapshotRequest) -> Result<Manifest> {
    take_then(ctx, req, |_| Ok(()))
}

/// Takes a statepoint and runs `before_release` on it, committed: before the sandbox is killed,
/// when the request does not leave it running (after the thaw otherwise). When `before_release`
/// fails the sandbox is not killed: it runs on from the statepoint, which stays committed, and
/// the error is returned.
pub fn take_then(
    ctx: &Ctx,
    req: &SnapshotRequest,
    before_release: impl FnOnce(&Manifest) -> Result<()>,
) -> Result<Manifest> {
    if !req.internal {
        crate::log::start_marks();
    }
    // A sandbox restored on demand is dumped once its memory is all there and settled.
    crate::local::lazy::settled(&ctx.store).map_err(crate::local::Error::from)?;
    let t = Taking::begin(ctx, req)?;
    t.mark("begun");
    let mut m = t.manifest();
    // Until the manifest is committed, the statepoint's directory is removed on any way out.
    let pending = PendingStatepoint {
        dir: &t.dir,
        dump_log: t.images.join("dump.log"),
        failed_log: ctx.store.dir.join("failed-dump.log"),
        committed: false,
    };
    ctx.store.write_manifest(&m)?;
    record_descriptors(t.pid, &t.dir)?;
    t.mark("pending");
    crate::fault::point("snapshot.before-freeze")?;

    // Stop the world for the whole window: thawed when `frozen` is dropped, whatever happens.
    let tf = Instant::now();
    let frozen = FreezeGuard::freeze(&t.freezer, ctx.store.dir.join(crate::local::freezer::MARKER))?;
    m.measurements.freeze_ms = ms(tf);
    t.mark("frozen");
    crate::fault::point("snapshot.frozen")?;
    let setting = DumpSetting::of(ctx, t.pid)?;
    // (its processes, frozen: the same through the dump)
    let pids = crate::local::inplace::cgroup_pids(t.freezer.dir());
    t.rootfs.processes(&pids);
    m.local_state.outside_tree = crate::local::inplace::outside_tree(&pids, t.pid);
    for p in &m.local_state.outside_tree {
        crate::log::own_log("warning", &format!("statepoint {} does not hold {p}: {OUTSIDE_TREE}", t.id));
    }
    // (read before a dump invalidates it; compared in the capture, beside the files)
    let base = crate::chain::read_base(&ctx.store);
    let network_lock =
        criu::network_lock(&ctx.criu, ctx.cfg.checkpoint.network_lock, setting.netns.is_some(), req.tcp_established);
    // A CRIU that dies while the namespace is locked leaves its lock behind: removed on failure.
    let lock_guard =
        StaleNetworkLock { pid: t.pid, armed: network_lock == Some("nftables") && setting.netns.is_none() };
    // From CRIU's first dump on, a failure must make the next dump full.
    let dumping = crate::chain::DumpInProgress::ready(&ctx.store, t.init_start);
    let window = Window { frozen: &frozen, setting: &setting, network_lock, pids: &pids, dumping: &dumping };
    m.measurements.rootfs_ms = t.capture(&mut m, &window, base)?;
    if let Err(e) = t.commit(&mut m, tf) {
        t.rootfs.discard(&t.dir, &m.local_state);
        return Err(e);
    }
    t.mark("committed");
    pending.committed();
    // The next dump builds on this one (a tree killed below is restored with a base of its own).
    crate::chain::after_dump(&ctx.store, &m, t.init_start)?;
    dumping.committed();
    lock_guard.disarm();
    let released = t.release(&m, frozen, before_release);
    t.mark("thawed");
    if !req.internal {
        ctx.store.set_head(Some(&t.id))?;
        t.mark("head");
        super::enforce_retention(&ctx.cfg, &ctx.store);
        t.mark("retention");
        crate::log::log_marks(&format!("snapshot {} of {} timeline (ms)", t.id, super::short(&ctx.ctr.id)));
    }
    released.map(|()| m)
}

/// Why a process outside the container's tree is in no statepoint.
pub const OUTSIDE_TREE: &str = "it runs outside the container's process tree (an exec's command still running, a child of conmon), which no dump reaches; a rollback or a fork does not have it";

/// A snapshot under way ([`take_then`]'s phases): what it was asked, and what it found before
/// the freeze.
struct Taking<'a> {
    ctx: &'a Ctx,
    req: &'a SnapshotRequest,
    t0: Instant,
    pid: i32,
    id: String,
    dir: PathBuf,
    images: PathBuf,
    init_start: u64,
    plan: crate::chain::DumpChain,
    rootfs: Box<dyn crate::local::files::Rootfs>,
    freezer: Freezer,
}

/// Whether the frozen tree did nothing since the last dump: its fingerprint (kept beside a dump's
/// images, compared with the last dump's), and the statepoint whose dump is this one's when so.
struct Unchanged {
    print: std::result::Result<u64, crate::local::unchanged::Unfit>,
    same_as: Option<Manifest>,
    /// The threads' user times seen, when compared with the base's.
    times: Option<std::collections::BTreeMap<String, u64>>,
}

/// What the capture of a frozen tree works with.
struct Window<'w> {
    frozen: &'w FreezeGuard<'w>,
    setting: &'w DumpSetting,
    network_lock: Option<&'static str>,
    /// The tree's processes, frozen: the same through the dump.
    pids: &'w [i32],
    /// Begun when CRIU is about to run.
    dumping: &'w crate::chain::DumpInProgress<'w>,
}

impl<'a> Taking<'a> {
    /// Checks the request and finds the container's files, freezer and dump chain (nothing made
    /// but the statepoint's directory).
    fn begin(ctx: &'a Ctx, req: &'a SnapshotRequest) -> Result<Taking<'a>> {
        let t0 = Instant::now();
        let pid = ctx.ctr.running_pid()?;
        if let Some(n) = &req.name {
            super::check_name(n)?;
            if ctx.store.find(n).is_ok() {
                return Err(Error::NameTaken(n.to_string()));
            }
        }
        let upperdir = crate::runtime::container::overlay_upperdir_of(pid)?;
        let rootfs = crate::local::rootfs_for(&ctx.cfg, &ctx.store, &ctx.ctr.id, upperdir)?;
        let freezer = Freezer::of_pid(pid)?;
        let id = req.id.clone().unwrap_or_else(|| ctx.store.next_id());
        let dir = ctx.store.statepoint_dir(&id);
        let init_start = sys::proc::start_time(pid).unwrap_or(0);
        let plan = crate::chain::plan(&ctx.store, &id, init_start, ctx.cfg.checkpoint.full_dump_interval);
        let images = dir.join("criu");
        std::fs::create_dir_all(&images).at("create", &images)?;
        Ok(Taking { ctx, req, t0, pid, id, dir, images, init_start, plan, rootfs, freezer })
    }

    /// Where its time goes, one line of planarian's log (not for a rollback's safety statepoint:
    /// the rollback's own line has it).
    fn mark(&self, what: &'static str) {
        if !self.req.internal {
            crate::log::mark(what)
        }
    }

    /// The statepoint's manifest, pending.
    fn manifest(&self) -> Manifest {
        let (ctx, req) = (self.ctx, self.req);
        let mut m = Manifest {
            statepoint_id: self.id.clone(),
            parent_statepoint_id: ctx.store.head(),
            branch_id: ctx.ctr.id.clone(),
            container_id: ctx.ctr.id.clone(),
            timestamp: crate::log::rfc3339(std::time::SystemTime::now()),
            name: req.name.clone(),
            state_evidence: store::Evidence {
                state_description: req.description.clone().unwrap_or_default(),
                state: req.state.clone(),
                prior_outcomes: vec![],
            },
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
            chain: store::Chain {
                prev_images_dir: self.plan.prev_images_dir.clone(),
                depth: self.plan.depth,
                full_reason: self.plan.full_reason.clone(),
                same_as: None,
            },
            imported_from: None,
            rollbacks: vec![],
            unreachable: None,
        };
        self.rootfs.plan(&self.id, &mut m.local_state);
        m
    }

    /// The frozen tree's fingerprint (only where it can serve: a plain snapshot left running,
    /// whose dump becomes the base), and the chain's `base` it is unchanged since, if any. When
    /// no thread ran in user mode since the base (a cheap look), its memory is compared beside
    /// the fingerprint.
    fn unchanged(&self, pids: &[i32], base: Option<crate::chain::Base>) -> Unchanged {
        use crate::local::unchanged;
        let (ctx, req) = (self.ctx, self.req);
        if !ctx.cfg.checkpoint.skip_unchanged || !req.leave_running || req.internal {
            let why = "not a plain snapshot left running";
            if ctx.cfg.checkpoint.skip_unchanged && !req.internal {
                crate::log::own_log("info", &format!("statepoint {}: a memory dump ({why})", self.id));
            }
            self.mark("changed");
            return Unchanged { print: Err(unchanged::Unfit(why.into())), same_as: None, times: None };
        }
        let mut times = None;
        let candidate = base_dump(ctx, req, self.init_start, base).and_then(|(m, dir, recorded)| {
            let now = unchanged::user_times(pids).map_err(|u| u.0)?;
            let then =
                recorded.user_time.as_ref().ok_or_else(|| format!("{} recorded no user times", m.statepoint_id))?;
            if let Some(pid) = unchanged::ran_since(pids, then, &now) {
                return Err(format!("process {pid} ran since {}", m.statepoint_id));
            }
            times = Some(now);
            Ok((m, dir, recorded))
        });
        let (print, compared) = std::thread::scope(|scope| {
            let memory = candidate
                .as_ref()
                .ok()
                .map(|(m, dir, _)| scope.spawn(move || memory_unchanged(pids, dir, &m.statepoint_id)));
            let print = unchanged::fingerprint(pids, self.pid);
            self.mark("fingerprint");
            let compared = memory.map(|h| h.join().unwrap_or_else(|_| Err("the memory's comparison panicked".into())));
            (print, compared)
        });
        // (a tree that can have no fingerprint says why first: no base of it says nothing)
        let same_as = match &print {
            Err(unfit) => Err(unfit.0.clone()),
            Ok(print) => candidate.and_then(|(m, _, recorded)| {
                if recorded.fingerprint != print.to_string() {
                    return Err(format!("the processes changed since {}", m.statepoint_id));
                }
                compared.unwrap_or_else(|| Err("the memory was not compared".into()))?;
                Ok(m)
            }),
        };
        let same_as = same_as
            .map_err(|why| crate::log::own_log("info", &format!("statepoint {}: a memory dump ({why})", self.id)))
            .ok();
        self.mark(if same_as.is_some() { "unchanged" } else { "changed" });
        Unchanged { print, same_as, times }
    }

    /// Memory and files, side by side, the container frozen: the files' time. On failure
    /// neither is left. The memory is the chain's `base`'s when the tree did nothing since it.
    fn capture(&self, m: &mut Manifest, w: &Window, base: Option<crate::chain::Base>) -> Result<f64> {
        std::thread::scope(|scope| -> Result<f64> {
            // The files beside the memory (and beside the look for whether the tree did anything):
            // the container is frozen, and neither CRIU nor that look writes its files.
            let local = m.local_state.clone();
            let files = scope.spawn(move || self.save_files(&local, w.setting.dev.as_ref()));
            let unchanged = self.unchanged(w.pids, base);
            let memory = self.dump_memory(m, w, &unchanged);
            self.mark("memory");
            let files = files.join().map_err(|_| Error::FilesPanicked).and_then(|r| r);
            self.mark("files");
            match (memory, files) {
                (Ok(()), Ok(rootfs_ms)) => Ok(rootfs_ms),
                (Err(e), files) => {
                    if files.is_ok() {
                        self.rootfs.discard(&self.dir, &m.local_state);
                    }
                    Err(e)
                }
                (Ok(()), Err(e)) => Err(e),
            }
        })
    }

    /// The files (and `/dev`, when planarian keeps it). Their time.
    fn save_files(&self, local: &store::LocalState, dev: Option<&crate::local::devfs::DevMount>) -> Result<f64> {
        let t = Instant::now();
        if let Some(dev) = dev {
            crate::local::devfs::save(self.pid, dev, &self.dir)?;
        }
        self.rootfs.snapshot(&self.dir, local)?;
        Ok(ms(t))
    }

    /// The memory: the last dump's images when nothing ran since it, else a CRIU dump
    /// (incremental on the chain's last; retried in full when CRIU refuses its parent).
    fn dump_memory(&self, m: &mut Manifest, w: &Window, unchanged: &Unchanged) -> Result<()> {
        let (ctx, req, images) = (self.ctx, self.req, &self.images);
        let td = Instant::now();
        if let Some(base) = &unchanged.same_as {
            // Nothing ran: the last dump's images are this statepoint's (hard links).
            let from = ctx.store.statepoint_dir(&base.statepoint_id).join(&base.local_state.criu_checkpoint_path);
            link_dump(&from, images)?;
            // (what this statepoint saw of the tree, for the next one to compare with: the
            // base's times with one more thaw's tick counted)
            if let (Ok(fp), Some(times)) = (&unchanged.print, &unchanged.times) {
                let record =
                    crate::local::unchanged::Record { fingerprint: fp.to_string(), user_time: Some(times.clone()) };
                let text = serde_json::to_string(&record).expect("strings and numbers encode");
                // (the base's is a link to its own: replaced, never written through)
                sys::write_atomic(&images.join(crate::local::unchanged::FILE), text.as_bytes(), 0o644)?;
            }
            m.chain = store::Chain { same_as: Some(base.statepoint_id.clone()), ..base.chain.clone() };
            m.measurements.criu_dump_ms = ms(td);
            return self.still_frozen(w.frozen);
        }
        w.dumping.begin();
        let incremental = criu::DumpPlan {
            pid: self.pid,
            images_dir: images,
            spec: &ctx.ctr.spec,
            freeze_cgroup: Some(self.freezer.dir()),
            prev_images_dir: self.plan.prev_images_dir.as_deref(),
            tcp_established: req.tcp_established,
            file_locks: req.file_locks,
            masked_dirs: &w.setting.masked_dirs,
            network_lock: w.network_lock,
            dev_external: w.setting.dev.is_some(),
            join_netns: w.setting.netns.as_ref().map(|f| f.as_raw_fd()),
        };
        if let Err(e) = self.dump(&incremental) {
            // Only a dump CRIU itself refused over its parent images is retried: after a killed
            // or crashed CRIU the tasks are left alone (the error goes back, nothing committed).
            if self.plan.prev_images_dir.is_none() || !criu::refused_parent(&images.join("dump.log")) {
                return Err(e);
            }
            // An incremental dump CRIU refused is retried in full, still frozen: slower, never
            // wrong. Its log stays beside the images, and the manifest says why.
            let _ = std::fs::rename(images.join("dump.log"), self.dir.join("dump-incremental-failed.log"));
            let _ = std::fs::remove_dir_all(images);
            std::fs::create_dir_all(images).at("create", images)?;
            self.dump(&criu::DumpPlan { prev_images_dir: None, ..incremental })?;
            m.chain = store::Chain {
                prev_images_dir: None,
                depth: 0,
                full_reason: Some(format!("the incremental dump failed ({e}); dumped in full")),
                same_as: None,
            };
        }
        if !images.join("inventory.img").exists() {
            return Err(Error::NoImages(images.clone()));
        }
        m.measurements.criu_dump_ms = ms(td);
        if let Some(st) = crate::chain::dump_stats(images) {
            m.measurements.pages_written = st.pages_written;
            m.measurements.pages_skipped_parent = st.pages_skipped_parent;
        }
        if let Ok(fp) = &unchanged.print {
            // (the threads' user time once CRIU's parasite has run in them: any later is theirs)
            // (none read: recorded as none, which nothing later equals)
            let cpu = crate::local::unchanged::user_times(w.pids).ok();
            let record = crate::local::unchanged::Record { fingerprint: fp.to_string(), user_time: cpu };
            let text = serde_json::to_string(&record).expect("strings and numbers encode");
            sys::write_atomic(&images.join(crate::local::unchanged::FILE), text.as_bytes(), 0o644)?;
        }
        self.still_frozen(w.frozen)
    }

    /// One CRIU dump of the tree.
    fn dump(&self, p: &criu::DumpPlan) -> Result<()> {
        let ctx = self.ctx;
        if ctx.ctr.spec.terminal {
            // The terminal's slave needs orphan_pts_master, which only CRIU's RPC has.
            Ok(criu::rpc::dump(&ctx.criu, p)?)
        } else {
            Ok(criu::run(&ctx.criu, &criu::dump_args(p), &self.images.join("dump.log"), false, &[], p.join_netns)?)
        }
    }

    /// The memory is this statepoint's only if the tree stayed frozen through its capture.
    fn still_frozen(&self, frozen: &FreezeGuard) -> Result<()> {
        if !frozen.holds() {
            return Err(Error::Thawed);
        }
        crate::fault::point("snapshot.dumped")?;
        Ok(())
    }

    /// Remote positions, the sandbox still frozen (consistent with files and processes), then
    /// the manifest committed.
    fn commit(&self, m: &mut Manifest, tf: Instant) -> Result<()> {
        let ctx = self.ctx;
        let parent = m
            .parent_statepoint_id
            .as_deref()
            .and_then(|p| ctx.store.find(p).ok())
            .map(|p| p.remote_state)
            .unwrap_or_default();
        m.remote_state =
            crate::remote::hooks::capture(&crate::remote::sidecar::remote_hooks(&ctx.cfg)?, &ctx.ctr.id, &parent)?;
        self.mark("remote");
        crate::fault::point("snapshot.before-commit")?;
        m.measurements.criu_bytes = store::du(&self.images);
        m.measurements.rootfs_bytes =
            m.local_state.rootfs_copy_path.as_ref().map_or(0, |c| store::du_unshared(&self.dir.join(c)));
        m.measurements.frozen_ms = ms(tf);
        m.measurements.total_ms = ms(self.t0);
        m.status = Status::Committed;
        Ok(self.ctx.store.write_manifest(m)?)
    }

    /// The statepoint committed: a sandbox left running thaws first; one to be killed waits,
    /// frozen, for `before_release`, then is killed while still frozen, so nothing runs past the
    /// statepoint.
    fn release(
        &self,
        m: &Manifest,
        frozen: FreezeGuard,
        before_release: impl FnOnce(&Manifest) -> Result<()>,
    ) -> Result<()> {
        if self.req.leave_running {
            drop(frozen);
            return before_release(m);
        }
        let released = before_release(m);
        if released.is_ok() {
            let ctx = self.ctx;
            ctx.crun().kill(&ctx.ctr.id, false);
        }
        drop(frozen);
        released
    }
}

/// The statepoint whose dump is the base of the next one (the chain's `base`), where its
/// images are, and what it recorded of the tree, when this statepoint may take that dump's
/// images as its own should the tree have done nothing since. Otherwise why not, for the log.
fn base_dump(
    ctx: &Ctx,
    req: &SnapshotRequest,
    init_start: u64,
    base: Option<crate::chain::Base>,
) -> std::result::Result<(Manifest, PathBuf, crate::local::unchanged::Record), String> {
    let base = base.ok_or("no base")?;
    let images = base.images.ok_or("no base images")?;
    let sp =
        images.strip_prefix("statepoints/").and_then(|s| s.strip_suffix("/criu")).ok_or("the base is a restore's")?;
    if base.init_start_time != init_start || sp.contains('/') {
        return Err("another process tree".into());
    }
    let m = ctx.store.find(sp).map_err(|e| e.to_string())?;
    if m.options.tcp_established != req.tcp_established || m.options.file_locks != req.file_locks {
        return Err("other dump options".into());
    }
    let dir = ctx.store.statepoint_dir(sp).join(&m.local_state.criu_checkpoint_path);
    let recorded = std::fs::read(dir.join(crate::local::unchanged::FILE))
        .ok()
        .and_then(|d| serde_json::from_slice(&d).ok())
        .ok_or_else(|| format!("{sp} recorded no fingerprint"))?;
    Ok((m, dir, recorded))
}

/// Whether the memory of the tree `pids` is still what the dump in `dir` (of statepoint `sp`)
/// holds: no timer armed at the dump, and every soft-dirty page the same. Otherwise why not.
fn memory_unchanged(pids: &[i32], dir: &Path, sp: &str) -> std::result::Result<(), String> {
    use crate::local::unchanged;
    if unchanged::timers_armed(dir).map_err(|u| u.0)? {
        return Err(format!("a timer was armed at {sp}"));
    }
    if !sys::proc::pagemap::soft_dirty_kept() {
        return Err("this kernel keeps no soft-dirty bits".into());
    }
    match unchanged::memory_differs(pids, dir) {
        Ok(None) => Ok(()),
        Ok(Some(what)) => Err(format!("memory was written since {sp}: {what}")),
        Err(u) => Err(u.0),
    }
}

/// A dump's images (and its `parent` link, the same relative path from a sibling directory),
/// as hard links in `into`.
fn link_dump(from: &Path, into: &Path) -> Result<()> {
    crate::chain::link_files(from, into)?;
    if let Ok(target) = std::fs::read_link(from.join("parent")) {
        std::os::unix::fs::symlink(&target, into.join("parent")).at("link parent in", into)?;
    }
    // (a log of this statepoint's own: the base's dump log is not this one's)
    let _ = std::fs::remove_file(into.join("dump.log"));
    Ok(())
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

/// A full CRIU dump of the frozen tree of `pid` into `images` and nothing else: no statepoint,
/// no parent images, the chain's base untouched (what the tests compare a rollback in place
/// with).
pub(crate) fn raw_dump(ctx: &Ctx, pid: i32, freezer: &Freezer, images: &Path) -> Result<()> {
    let DumpSetting { masked_dirs, netns, dev } = DumpSetting::of(ctx, pid)?;
    std::fs::create_dir_all(images).at("create", images)?;
    let p = criu::DumpPlan {
        pid,
        images_dir: images,
        spec: &ctx.ctr.spec,
        freeze_cgroup: Some(freezer.dir()),
        prev_images_dir: None,
        tcp_established: false,
        file_locks: false,
        masked_dirs: &masked_dirs,
        network_lock: criu::network_lock(&ctx.criu, ctx.cfg.checkpoint.network_lock, netns.is_some(), false),
        dev_external: dev.is_some(),
        join_netns: netns.as_ref().map(|f| f.as_raw_fd()),
    };
    Ok(criu::run(&ctx.criu, &criu::dump_args(&p), &images.join("dump.log"), false, &[], p.join_netns)?)
}

/// What every CRIU dump of a container's tree needs from the container as it is now.
struct DumpSetting {
    masked_dirs: Vec<String>,
    /// Podman's network namespace: CRIU dumps from inside it (see criu::in_netns).
    netns: Option<std::os::fd::OwnedFd>,
    /// `/dev`, when planarian keeps it (see devfs).
    dev: Option<crate::local::devfs::DevMount>,
}

impl DumpSetting {
    fn of(ctx: &Ctx, pid: i32) -> Result<DumpSetting> {
        let mounts = sys::proc::Proc::of(pid).mounts().unwrap_or_default();
        let netns = match &ctx.ctr.spec.netns_path {
            Some(_) => Some(open_netns(pid)?),
            None => None,
        };
        Ok(DumpSetting {
            masked_dirs: criu::masked_dirs(pid, &ctx.ctr.spec, &mounts),
            netns,
            dev: crate::local::devfs::dev_mount(&mounts),
        })
    }
}

/// The network namespace process `pid` is in.
fn open_netns(pid: i32) -> Result<std::os::fd::OwnedFd> {
    Ok(sys::proc::Proc::of(pid).open("ns/net").map(std::os::fd::OwnedFd::from)?)
}

fn ms(t: Instant) -> f64 {
    (t.elapsed().as_secs_f64() * 1e6).round() / 1e3
}

/// Where the container's fds 0–2 pointed (pipes to conmon, /dev/null, a tty), for restore.
fn record_descriptors(pid: i32, dir: &Path) -> Result<()> {
    let fds: Vec<String> = (0..3).map(|i| sys::proc::Proc::of(pid).fd_target(i)).collect();
    let text = serde_json::to_string(&fds).expect("strings serialise");
    Ok(sys::write_atomic(&dir.join("descriptors.json"), text.as_bytes(), 0o644)?)
}

/// The `checkpoint` verb (Podman's `podman container checkpoint`): a statepoint of running
/// container `id`, and what Podman expects in `image_path`/`work_path`.
pub fn checkpoint(
    engine: &crate::Engine,
    id: &str,
    req: &SnapshotRequest,
    image_path: Option<&Path>,
    work_path: Option<&Path>,
) -> Result<Manifest> {
    let mut ctx = Ctx::load(engine, id)?;
    ctx.ctr.running_pid()?;
    let _lock = ctx.store.lock_for_statepoint(ctx.cfg.checkpoint.in_flight_wait(), &mut |_| {})?;
    // (Podman runs this verb holding the container's lock: a recovery, which calls Podman, would
    // wait for it forever)
    if let Some(target) = super::journal::interrupted_to(&ctx.store) {
        return Err(Error::Worker(format!(
            "a rollback to {target} was interrupted: any planarian command on the container, or `planarian fsck --repair`, finishes or undoes it first"
        )));
    }
    ctx.recover()?;
    // What Podman or CRI-O reads is written before the container is let go: when it cannot be
    // (a full disk during a hand-out), the checkpoint fails and the container runs on.
    take_then(&ctx, req, |m| {
        let Some(ip) = image_path else { return Ok(()) };
        use super::podman_dir::leave_for_podman;
        if super::travel::leaves() {
            super::travel::leave_for_podman(&ctx.cfg, &ctx.store, m, ip, work_path)?;
        } else {
            leave_for_podman(m, &ctx.store.statepoint_dir(&m.statepoint_id), ip, work_path)?;
        }
        Ok(crate::fault::point("checkpoint.handed-out")?)
    })
}

/// Podman's `--pre-checkpoint`: a memory pre-dump of container `id` into `image_path`, no
/// statepoint.
pub fn pre_dump(engine: &crate::Engine, id: &str, image_path: &Path) -> Result<()> {
    let ctx = Ctx::load(engine, id)?;
    let pid = ctx.ctr.running_pid()?;
    std::fs::create_dir_all(image_path).map_err(|e| sys::IoError::new("create", image_path, e))?;
    // CRIU's --track-mem clears the soft-dirty bits: the pages written since the base are then
    // in the pre-dump only, which no statepoint keeps.
    let _lock = ctx.store.lock_for_statepoint(ctx.cfg.checkpoint.in_flight_wait(), &mut |_| {})?;
    let init_start = sys::proc::start_time(pid).unwrap_or(0);
    crate::chain::invalidate_base(
        &ctx.store,
        init_start,
        "a pre-dump (podman --pre-checkpoint) cleared the soft-dirty bits",
    );
    let out = std::process::Command::new(&ctx.criu)
        .args(["pre-dump", "--tree", &pid.to_string(), "--track-mem", "--log-file", "dump.log", "--images-dir"])
        .arg(image_path)
        .output()
        .map_err(|source| criu::Error::Run { tool: ctx.criu.clone(), source })?;
    if out.status.success() {
        Ok(())
    } else {
        Err(Error::PreDump(image_path.to_path_buf()))
    }
}
