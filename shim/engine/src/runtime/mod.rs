//! What the runtime knows of a container: its bundle and OCI config ([`spec`]), crun's record of
//! it ([`container`]), and what Podman says ([`podman`], [`lookup`]).

pub mod container;
pub mod crun;
pub mod exec;
pub(crate) mod inflight;
pub(crate) mod lookup;
pub mod podman;
pub mod spec;

use crate::config::{Config, ConfigError};
use crate::tools::{self, NotFound};
use std::path::PathBuf;

pub use container::{Container, CRUN_ROOT};
pub use spec::{Bundle, Spec};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Io(#[from] sys::IoError),
    #[error("{what}: {source}")]
    Json { what: String, source: serde_json::Error },
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Tool(#[from] NotFound),
    #[error("cannot run {tool}: {source}")]
    Run { tool: PathBuf, source: std::io::Error },
    #[error("container {0} is not known to crun (is it running?)")]
    NotKnownToCrun(String),
    /// `crun state` failed: crun's own reason.
    #[error("unknown container {id}: {why}")]
    CrunStateFailed { id: String, why: String },
    #[error("crun state {id}: {why}")]
    CrunState { id: String, why: String },
    #[error("container {id} is not running (it is {status})")]
    NotRunning { id: String, status: String },
    #[error("no such container {0}")]
    NoSuchContainer(String),
    #[error("container {name} is not run by planarian (its runtime is {runtime})")]
    NotPlanarian { name: String, runtime: String },
    /// A Podman command failed; its own last line.
    #[error("podman {command}: {message}")]
    Podman { command: String, message: String },
    #[error("container {id} did not stop within {secs} s (it is {status})")]
    DidNotStop { id: String, secs: u64, status: String },
    #[error("{0} is not an object")]
    NotAnObject(PathBuf),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The global flags of the runc command line that the engine acts on: crun's state directory
/// (`--root`) and the cgroup manager Podman chose.
#[derive(Debug, Clone, Default)]
pub struct Globals {
    pub root: Option<PathBuf>,
    pub systemd_cgroup: bool,
}

impl Globals {
    /// These globals for container `id` — or, when none names a root and crun's default root
    /// does not hold it, the `--root` of the CRI engine that runs it through planarian
    /// (containerd's, [`lookup::cri_root`]): what a user's `planarian rollback ID` needs.
    pub fn for_container(&self, id: &str) -> Globals {
        if self.root.is_none() && !std::path::Path::new(CRUN_ROOT).join(id).exists() {
            if let Some(root) = lookup::cri_root(id) {
                return Globals { root: Some(root), ..self.clone() };
            }
        }
        self.clone()
    }

    /// `--root DIR` for crun, when one was given.
    pub fn crun_args(&self) -> Vec<std::ffi::OsString> {
        match &self.root {
            Some(r) => vec!["--root".into(), r.clone().into()],
            None => vec![],
        }
    }
}

/// The external programs, found by absolute path ([`tools::locate`]).
pub fn crun(cfg: &Config) -> Result<PathBuf, NotFound> {
    tools::locate("crun", cfg.runtime.crun_path.as_deref(), "[runtime] crun_path")
}

pub fn criu(cfg: &Config) -> Result<PathBuf, NotFound> {
    tools::locate("criu", cfg.runtime.criu_path.as_deref(), "[runtime] criu_path")
}

/// The pre-resume hook: configured, or installed beside this binary.
pub fn criu_hooks(cfg: &Config) -> Result<PathBuf, NotFound> {
    let beside = std::env::current_exe().ok().and_then(|e| Some(e.parent()?.join("planarian-criu-hooks")));
    let configured = cfg.runtime.criu_hooks_path.as_deref().or(beside.as_deref());
    tools::locate("planarian-criu-hooks", configured, "[runtime] criu_hooks_path")
}
