//! The statepoint engine: everything planarian does to a sandbox, as a library that the
//! `planarian` runtime binary (and, next, an MCP server and a harness SDK) call.
//!
//! Every front-end (the runtime binary's verbs and commands, its MCP server, its background
//! workers) makes one [`Engine`] — the configuration read once, the runtime's global flags, the
//! tools found once — and hands it to the operations.
//!
//! Layers, each using only the ones below it:
//!
//! ```text
//!  engine       the front door: configuration, global flags, tools; create/delete/exec hooks
//!  statepoint   snapshot · restore · rollback · fork as operations; Ctx; the checkpoint
//!               directory handed to Podman; removal, retention, recovery
//!  local        criu (command line and RPC from one option list) · freezer · devfs · files:
//!               copy and ZFS backends            remote   hooks (capture/compensate) · sidecar
//!  chain        Algorithm 1's bases and chains of CRIU images
//!  store        the registry: manifests, ids, heads, locks
//!  runtime      what the runtime knows of a container: OCI spec, crun's state, Podman
//!  config · tools · log · fault                 (and below everything, the `sys` crate:
//!                                               /proc, atomic writes, I/O errors)
//! ```
//!
//! Every library error is a typed enum (`thiserror`); the binaries turn them into the one line a
//! user reads and the runc-style JSON line Podman reads.
//!
//! The public API is what the front-ends use: [`Engine`]; the operations in [`statepoint`]
//! (snapshot, checkpoint, restore, rollback, fork, spares, travel, the asynchronous snapshot);
//! the registry ([`store`]) and what a model reads of it ([`context`]); [`config`], [`log`],
//! [`fsck`], [`tools`]; of [`runtime`], Podman's and crun's typed calls and the OCI bundle; of
//! [`local`], the ZFS commands (`gc`, `zfs-base`) and the CRIU and freezer types the operations
//! name. The rest — Algorithm 1's chains, the rollback in place, the unchanged check, the copy
//! path, the remote-state hooks, a fork's record, the rollback journal, fault points — is
//! `pub(crate)`.

pub mod config;
pub mod engine;
pub(crate) mod fault;
pub mod fsck;
pub mod log;
pub(crate) mod pidfd;
pub mod tools;

pub(crate) mod chain;
pub mod context;
pub mod local;
pub(crate) mod remote;
pub mod runtime;
pub mod statepoint;
pub mod store;

pub use engine::Engine;
pub use sys::{Context, IoError};

/// The version of the runtime, as `planarian --version` prints it.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
